"""The chaos run's verdict on the object store (issue 28), pure: every stored result read back
against its SHA-256, every object under the run's prefix a recorded result, an archived log or a
stored input of a dispatch of the run (`orphans`), every planned failure naming an archived log
that is there (`missing_logs`), and no secret input's marker anywhere the run can read
(`MarkerScan`: the Jobs and Pods the observer saw, Kubernetes events, Celery messages, the engine's
event log and every process's log)."""

from __future__ import annotations

import base64
import binascii
import json
import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from k8s_dispatch.artifacts import keys
from k8s_dispatch.artifacts.errors import InvalidResultReference
from k8s_dispatch.artifacts.reference import parse_reference

EXAMPLES = 5  # problems shown per kind


@dataclass
class ObjectVerdict:
    """What the run found in the object store and wherever a secret input must not be."""

    large: int = 0  # stored-result dispatches planned
    large_bad: int = 0  # ...whose bytes could not be read back or are not those of their SHA-256
    objects: int = 0  # objects under the run's prefix after convergence
    orphan_objects: int = 0  # ...that are no recorded result, archived log or stored input of a dispatch of the run
    logs_archived: int = 0  # planned failures whose detail names an archived log that is there
    logs_missing: int = 0  # ...that name none, or one that is not there
    # Other failures (timeouts, poison, cancelled...) whose detail names an archived log the store
    # does not hold: counted, not judged (a Pod killed at its deadline may have no log to read).
    other_logs_missing: int = 0
    secrets: int = 0  # dispatches with a secret input
    secret_leaks: int = 0  # (marker, place) pairs found
    scanned: dict[str, int] = field(default_factory=dict)  # place -> things read for markers
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.large_bad or self.orphan_objects or self.logs_missing or self.secret_leaks)

    def problem(self, kind: str, text: str) -> None:
        if sum(p.startswith(f"{kind}: ") for p in self.problems) < EXAMPLES:
            self.problems.append(f"{kind}: {text}")


def recorded_key(payload: Mapping[str, Any] | None) -> str | None:
    """The key a WORKER_COMPLETED payload's output references; None for a small result."""
    try:
        return parse_reference((payload or {}).get("output")).key
    except InvalidResultReference:
        return None


def orphans(prefix: str, listed: Iterable[str], *, known: set[str], recorded: Mapping[str, str]) -> list[str]:
    """The keys of `listed` (everything under `prefix`/) that are none of: the recorded result of
    their dispatch (`recorded`: dispatch id -> its recorded key), an archived log, the stored
    input or a map's packed item inputs of a dispatch of the run (`known`)."""
    found = []
    for key in listed:
        owner = keys.dispatch_of(prefix, key)
        if (
            owner is None
            or owner not in known
            or not (
                recorded.get(owner) == key
                or keys.parse_log_key(prefix, key) is not None
                or key == keys.input_key(prefix, owner)
                or keys.is_items_key(prefix, key)
            )
        ):
            found.append(key)
    return found


def log_problem(payload: Mapping[str, Any] | None, listed: set[str]) -> str | None:
    """Why a planned failure's terminal event does not name an archived log that is there, or None."""
    detail = (payload or {}).get("detail")
    key = detail.get("log_key") if isinstance(detail, dict) else None
    if not key:
        return f"its detail names no archived log ({sorted(detail) if isinstance(detail, dict) else detail!r})"
    if key not in listed:
        return f"its detail names {key}, which the store does not hold"
    return None


class MarkerScan:
    """Looks for the run's secret markers in what it is given; thread-safe (the observer's
    threads and the harness's tick feed it)."""

    def __init__(self, markers: Iterable[str]) -> None:
        self.markers = sorted(set(markers))
        self._pattern = re.compile("|".join(re.escape(m) for m in self.markers)) if self.markers else None
        self._lock = threading.Lock()
        self.leaks: dict[tuple[str, str], str] = {}  # (marker, place) -> where exactly
        self.scanned: dict[str, int] = {}

    def scan(self, place: str, text: str, *, where: str = "") -> None:
        """Note each marker in `text`, read from `place` (a kind of source; `where` names the thing)."""
        with self._lock:
            self.scanned[place] = self.scanned.get(place, 0) + 1
        if self._pattern is None:
            return
        for found in set(self._pattern.findall(text)):
            with self._lock:
                self.leaks.setdefault((found, place), where)

    def scan_message(self, raw: bytes | str, *, where: str) -> None:
        """A Celery message as kombu's Redis transport keeps it (a JSON envelope, the body base64),
        read whole and with its body decoded."""
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        self.scan("celery message", text + "\n" + decoded_body(text), where=where)

    def judge(self, verdict: ObjectVerdict) -> None:
        with self._lock:
            verdict.scanned = dict(sorted(self.scanned.items()))
            verdict.secret_leaks = len(self.leaks)
            for (marker, place), where in sorted(self.leaks.items()):
                verdict.problem("secret leak", f"{marker} in a {place}: {where}")


def decoded_body(text: str) -> str:
    """The body of a kombu envelope (base64 when its properties say so); "" if it is not one."""
    try:
        envelope = json.loads(text)
    except ValueError:
        return ""
    if isinstance(envelope, list) and envelope:  # an unacknowledged one: [envelope, exchange, routing key]
        envelope = envelope[0]
    if not isinstance(envelope, dict) or not isinstance(envelope.get("body"), str):
        return ""
    properties = envelope.get("properties")
    if isinstance(properties, dict) and properties.get("body_encoding") == "base64":
        try:
            return base64.b64decode(envelope["body"]).decode(errors="replace")
        except (binascii.Error, ValueError):
            return ""
    return str(envelope["body"])
