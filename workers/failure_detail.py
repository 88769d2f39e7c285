"""Why a Job failed, and which of its Pods were disrupted (pure): from the Job, its Pods, their
Warning Events and the failed container's log tail, the structured detail a WORKER_FAILED keeps,
and each disrupted Pod as a WORKER_DISRUPTED records it.

It also reads off a Pod whose log it holds and how it ended (`pod_log`), what the archiving of
logs (`artifacts.logs`) decides by and names its object with.

Everything here is bounded and valid text whatever the cluster sent: a log is bytes (cut to its
last 2 KiB, on a character boundary, invalid UTF-8 replaced), every string is cut to a bound and
freed of lone surrogates, so the store's canonical JSON always keeps the payload.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from k8s_dispatch.core.errors import LabelMismatch
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.job_status import parse_timestamp, terminated_state
from k8s_dispatch.workers.manifest import CONTAINER_NAME

OOM_KILLED = "OOMKilled"  # the container's reason, and the dispatch's
DISRUPTED = "Disrupted"  # more disruptions than the capability's maxDisruptions
DISRUPTION_CONDITION = "DisruptionTarget"
MAX_LOG_BYTES = 2048
LOG_TAIL_LINES = 100  # asked of pods/log; the bytes bound is what holds
LOG_LIMIT_BYTES = 16 * 1024  # `limitBytes` cuts from the start of the tail: ask for more, keep the end
MAX_TEXT = 1024  # one message (a condition's, an event's)
MAX_EVENTS = 10
WARNING = "Warning"
# Job reasons that say "a Pod failed", where the Pod's own reason says more.
_POD_FAILURE_REASONS = frozenset({"BackoffLimitExceeded", "PodFailurePolicy", "JobFailed"})


def text(value: object, limit: int = MAX_TEXT) -> str | None:
    """`value` as a string the store keeps: its first `limit` characters, lone surrogates replaced."""
    if not isinstance(value, str):
        return None
    cut = value if len(value) <= limit else value[: limit - 3] + "..."
    return cut.encode("utf-8", "replace").decode("utf-8")


def log_tail(raw: bytes | None) -> str | None:
    """The last MAX_LOG_BYTES of a log, from a line start where one is near, as valid text."""
    if not raw:
        return None
    tail = raw[-MAX_LOG_BYTES:]
    if len(raw) > MAX_LOG_BYTES:
        while tail and (tail[0] & 0xC0) == 0x80:  # not mid-character
            tail = tail[1:]
        newline = tail.find(b"\n")
        if 0 <= newline < len(tail) - 1 and newline < 256:
            tail = tail[newline + 1 :]
    text = tail.decode("utf-8", "replace")
    size = 0
    for i in range(len(text) - 1, -1, -1):  # each invalid byte became a 3-byte U+FFFD: cut again
        size += len(text[i].encode("utf-8"))
        if size > MAX_LOG_BYTES:
            return text[i + 1 :]
    return text


@dataclass(frozen=True)
class Disruption:
    """One Pod the cluster disrupted (evicted, preempted, its node lost): what WORKER_DISRUPTED records."""

    pod_uid: str
    pod_name: str
    node: str | None
    reason: str  # the DisruptionTarget condition's: EvictionByEvictionAPI, PreemptionByScheduler, ...
    message: str | None
    at: str | None  # the condition's lastTransitionTime

    def payload(self) -> dict[str, Any]:
        return {
            "pod_uid": self.pod_uid,
            "pod": self.pod_name,
            "node": self.node,
            "reason": self.reason,
            "message": self.message,
            "at": self.at,
        }


def disruptions(pods: Iterable[Mapping[str, Any]]) -> list[Disruption]:
    """The Pods that ended disrupted: phase Failed with DisruptionTarget True (what the Job's
    podFailurePolicy Ignores), by name."""
    found = []
    for pod in pods:
        status = _dict(pod.get("status"))
        if status.get("phase") != "Failed":
            continue
        condition = next(
            (
                _dict(c)
                for c in _list(status.get("conditions"))
                if _dict(c).get("type") == DISRUPTION_CONDITION and _dict(c).get("status") == "True"
            ),
            None,
        )
        metadata = _dict(pod.get("metadata"))
        uid = metadata.get("uid")
        if condition is None or not isinstance(uid, str) or not uid:
            continue
        found.append(
            Disruption(
                pod_uid=text(uid, 64) or "",
                pod_name=text(metadata.get("name"), 253) or "",
                node=text(_dict(pod.get("spec")).get("nodeName"), 253),
                reason=text(condition.get("reason"), 128) or DISRUPTION_CONDITION,
                message=text(condition.get("message")),
                at=text(condition.get("lastTransitionTime"), 64),
            )
        )
    return sorted(found, key=lambda d: (d.pod_name, d.pod_uid))


def failed_pod(pods: Sequence[Mapping[str, Any]], *, container: str = CONTAINER_NAME) -> Mapping[str, Any] | None:
    """The Pod that speaks for a failed Job: the latest to end that was not disrupted (else the latest)."""
    ended = [p for p in pods if _terminated(p, container) is not None]
    if not ended:
        return None
    own = [p for p in ended if not disruptions([p])] or ended
    return max(own, key=lambda p: (str(_dict(_terminated(p, container)).get("finishedAt") or ""), _name(p)))


def failure_reason(
    job_reason: str | None, pod: Mapping[str, Any] | None, *, container: str = CONTAINER_NAME
) -> str | None:
    """The dispatch's reason: OOMKilled when the failing container was, else the Job's."""
    terminated = _terminated(pod, container) if pod is not None else None
    if (
        terminated is not None
        and terminated.get("reason") == OOM_KILLED
        and (job_reason in _POD_FAILURE_REASONS or not job_reason)
    ):
        return OOM_KILLED
    return job_reason


def detail(
    job: Mapping[str, Any],
    pod: Mapping[str, Any] | None,
    *,
    events: Iterable[Mapping[str, Any]] = (),
    log: bytes | None = None,
    disrupted: Sequence[Disruption] = (),
    container: str = CONTAINER_NAME,
    log_key: str | None = None,
) -> dict[str, Any]:
    """The structured detail of a failed Job: its failing container's exit code, signal, reason and
    message, the Pod's reason, node and times, the log's tail, the Job's and the Pods' Warning
    Events (oldest first, at most MAX_EVENTS) and the disruptions it met. Only what is known.
    `log_key`: the object the failing Pod's whole log is archived to (`artifacts.logs`), whose
    upload comes after this detail is recorded, before the Pod is freed."""
    out: dict[str, Any] = {}
    condition = _failed_condition(job)
    if condition:
        out["job_reason"] = text(condition.get("reason"), 128)
        out["job_message"] = text(condition.get("message"))
    if pod is not None:
        metadata, status = _dict(pod.get("metadata")), _dict(pod.get("status"))
        out["pod"] = text(metadata.get("name"), 253)
        out["node"] = text(_dict(pod.get("spec")).get("nodeName"), 253)
        out["pod_reason"] = text(status.get("reason"), 128)
        out["pod_message"] = text(status.get("message"))
        terminated = _terminated(pod, container)
        if terminated is not None:
            code = terminated.get("exitCode")
            if isinstance(code, int) and not isinstance(code, bool):
                out["exit_code"] = code
                out["signal"] = signal_name(terminated.get("signal"), code)
            out["container_reason"] = text(terminated.get("reason"), 128)
            out["started_at"] = text(terminated.get("startedAt"), 64)
            out["finished_at"] = text(terminated.get("finishedAt"), 64)
    tail = log_tail(log)
    if tail:
        out["log_tail"] = tail
    out["log_key"] = text(log_key)
    warnings = sorted(
        (e for e in events if _dict(e).get("type") == WARNING),
        key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or ""),
    )[-MAX_EVENTS:]
    if warnings:
        out["events"] = [_event(e) for e in warnings]
    if disrupted:
        out["disruptions"] = [d.payload() for d in disrupted]
    return {k: v for k, v in out.items() if v is not None}


@dataclass(frozen=True)
class PodLog:
    """A Pod of ours whose container log may be archived: whose it is (from the labels and the
    attempt annotation its Job's template gave it) and how it ended."""

    pod: str
    container: str
    dispatch_id: str
    capability: str
    attempt: int
    started: bool  # the container ran (else there is no log to read)
    failed: bool  # the Pod failed (phase Failed, or its container exited non-zero)
    # When its container ended (`state.terminated.finishedAt`, the node's clock); None while it
    # runs or when its node never said (lost with it): how long an unreadable log is waited for.
    finished_at: datetime | None = None


def pod_log(pod: Mapping[str, Any], *, container: str = CONTAINER_NAME) -> PodLog | None:
    """What `PodLog` says of `pod`; None for a Pod that is not ours or not readably so."""
    metadata = _dict(pod.get("metadata"))
    annotations = _dict(metadata.get("annotations"))
    try:
        ref = job_labels.decode(_dict(metadata.get("labels")), annotations)
    except LabelMismatch:
        return None
    attempt = annotations.get(job_labels.ATTEMPT_KEY, "0")
    name = metadata.get("name")
    if (
        not isinstance(name, str)
        or not name
        or not isinstance(attempt, str)
        or not (attempt.isascii() and attempt.isdigit())
    ):
        return None
    status = _dict(pod.get("status"))
    state = next(
        (
            _dict(_dict(s).get("state"))
            for s in _list(status.get("containerStatuses"))
            if _dict(s).get("name") == container
        ),
        {},
    )
    terminated = _terminated(pod, container)
    code = _dict(terminated).get("exitCode")
    return PodLog(
        pod=name,
        container=container,
        dispatch_id=ref.dispatch_id,
        capability=ref.capability,
        attempt=int(attempt),
        started="running" in state or terminated is not None,
        failed=status.get("phase") == "Failed" or (isinstance(code, int) and code != 0),
        finished_at=parse_timestamp(_dict(terminated).get("finishedAt")),
    )


def signal_name(reported: object, exit_code: int) -> str | None:
    """The signal that ended a container: the one the runtime reported, else what an exit code
    above 128 says (137: SIGKILL, 143: SIGTERM); None for a plain exit."""
    number = reported if isinstance(reported, int) and not isinstance(reported, bool) and reported > 0 else None
    if number is None and 128 < exit_code <= 128 + 64:
        number = exit_code - 128
    if number is None:
        return None
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _event(event: Mapping[str, Any]) -> dict[str, Any]:
    involved = _dict(event.get("involvedObject"))
    count = event.get("count")
    out = {
        "object": text(f"{involved.get('kind', '')}/{involved.get('name', '')}", 300),
        "reason": text(event.get("reason"), 128),
        "message": text(event.get("message"), 512),
        "count": count if isinstance(count, int) and not isinstance(count, bool) else None,
        "last_seen": text(event.get("lastTimestamp") or event.get("eventTime"), 64),
    }
    return {k: v for k, v in out.items() if v is not None}


def _failed_condition(job: Mapping[str, Any]) -> Mapping[str, Any] | None:
    for kind in ("Failed", "FailureTarget"):
        for condition in _list(_dict(job.get("status")).get("conditions")):
            condition = _dict(condition)
            if condition.get("type") == kind and condition.get("status") == "True":
                return condition
    return None


def _terminated(pod: Mapping[str, Any] | None, container: str) -> Mapping[str, Any] | None:
    return terminated_state(_list(_dict(_dict(pod).get("status")).get("containerStatuses")), container)


def _name(pod: Mapping[str, Any]) -> str:
    return str(_dict(pod.get("metadata")).get("name") or "")


def _dict(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []
