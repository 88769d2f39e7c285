"""Container logs kept after their Pod is gone (a capability's `archiveLogs`: `onFailure`, the
default, for a Pod that failed; `always`; `never`): copied to the object store before our finalizer
leaves the Pod, since once it is off the Pod, and its log, may go at any moment.

One key per Pod under its attempt (`keys.log_key`): a crash between the upload and the release
uploads the same key again. The copy never stands in a result's way: the terminal event is
recorded before any release; a store that cannot take the log raises ObjectStoreUnavailable, a log
that cannot be read for now (pods/log answered 5xx or 429, or nothing) PodLogUnavailable (both
Transient), so the release, and the copy, are tried again later while the Pod is held. A log is
given up on when it cannot be read for good (404: its container is gone) or still not
UNREADABLE_GRACE_S after its container ended (its node gone): the Pod is freed, and its key gets a
one-line note saying why (UNREADABLE_NOTE), so that every key a failure's detail names exists.

Requests, per archived Pod: one pods/log GET and one PUT; a log longer than `log_max_bytes` a few
more GETs (at most TAIL_READS) to find the end, which pods/log cuts only by lines; a log given up
on one HEAD (an upload made before, by a release that crashed, is kept) and one PUT.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import Protocol

from k8s_dispatch.artifacts import keys
from k8s_dispatch.artifacts.service import Artifacts
from k8s_dispatch.core.errors import DispatchError, PodLogUnavailable, Transient

log = logging.getLogger(__name__)

TAIL_READS = 4  # reads after the first, each asking for half the lines of the one before
ALL_LINES = 2**31 - 1  # tailLines for every line: pods/log's limitBytes then keeps the first bytes
CUT_NOTE = "[k8s-dispatch: this log was longer than {max_bytes} bytes (K8S_DISPATCH_ARCHIVE_LOG_MAX_BYTES): {what}]\n"
UNREADABLE_NOTE = "[k8s-dispatch: the log of pod {pod} could not be read: {why}]\n"
MAX_WHY = 1024  # characters of the note's reason
# How long after its container ended a log that cannot be read for now is still waited for, its
# Pod held: as long as the node lifecycle controller waits for an unreachable node before it
# evicts the node's Pods (the default `unreachable` toleration, 300 s). An API or kubelet restart
# is over well within it (ten sweeps at the default interval); a node not back by then is lost.
UNREADABLE_GRACE_S = 300.0


class LogReader(Protocol):
    """pods/log as `workers.kube.KubeClient` reads it (artifacts and workers import neither the other)."""

    def read_pod_log(
        self, namespace: str, name: str, *, container: str, tail_lines: int, limit_bytes: int
    ) -> bytes: ...


class ArchiveSpec(Protocol):
    def archives_log(self, *, failed: bool) -> bool: ...


class Specs(Protocol):
    """The capability table (`workers.resolver.CapabilityResolver`)."""

    def __contains__(self, capability: object) -> bool: ...
    def spec(self, capability: str) -> ArchiveSpec: ...


class PodLog(Protocol):
    """A Pod whose log may be archived, as `workers.failure_detail.pod_log` reads it."""

    @property
    def pod(self) -> str: ...
    @property
    def container(self) -> str: ...
    @property
    def dispatch_id(self) -> str: ...
    @property
    def capability(self) -> str: ...
    @property
    def attempt(self) -> int: ...
    @property
    def started(self) -> bool: ...
    @property
    def failed(self) -> bool: ...
    @property
    def finished_at(self) -> datetime | None: ...  # when its container ended; None while it runs


@dataclass(frozen=True)
class ArchivedLog:
    key: str
    attempt: int
    pod: str
    size: int
    modified: datetime  # the store's clock


def log_key(artifacts: Artifacts | None, specs: Specs, pod: PodLog | None) -> str | None:
    """The key `pod`'s log is archived to when it is released, if it will be: what a failure's
    detail names (`workers.failure_detail.detail(log_key=...)`)."""
    if artifacts is None or pod is None or not _wanted(specs, pod):
        return None
    return keys.log_key(artifacts.prefix, pod.dispatch_id, pod.attempt, pod.pod)


def archive_logs(
    artifacts: Artifacts | None,
    reader: LogReader,
    specs: Specs,
    namespace: str,
    pods: Iterable[PodLog | None],
    *,
    now: datetime | None = None,
) -> int:
    """Copy to the store the log of each of `pods` (of `namespace`, about to be released) whose
    capability asks for it, or, for a log given up on, the note saying why; how many objects were
    written. Without an object store, none (the resolver said so at start-up). `None` stands for
    a Pod that is not ours. `now`: this process's clock, against the containers' `finished_at`.

    Raises:
        PodLogUnavailable: a log cannot be read for now and its container ended less than
            UNREADABLE_GRACE_S ago: release nothing now, try again later.
        ObjectStoreUnavailable: the store did not take a log: release nothing now, try again later.
    """
    if artifacts is None:
        return 0
    now = now or datetime.now(UTC)
    written = 0
    for pod in pods:
        if pod is None or not _wanted(specs, pod):
            continue
        key = keys.log_key(artifacts.prefix, pod.dispatch_id, pod.attempt, pod.pod)
        read = partial(reader.read_pod_log, namespace, pod.pod, container=pod.container)
        try:
            data = read_tail(read, artifacts.log_max_bytes)
        except Transient as e:
            ended = _ended_for(pod, now)
            if ended is not None and ended < UNREADABLE_GRACE_S:
                raise PodLogUnavailable(
                    f"dispatch {pod.dispatch_id}: the log of pod {namespace}/{pod.pod} cannot be read now: {e}"
                ) from e
            when = "its container has no known end" if ended is None else f"still so {ended:.0f} s after it ended"
            written += _give_up(artifacts, key, namespace, pod, f"{e.reason}: {e} ({when})")
            continue
        except DispatchError as e:  # for good: NotFound (the container is gone), a refusal
            written += _give_up(artifacts, key, namespace, pod, f"{e.reason}: {e}")
            continue
        artifacts.store.put(key, data)
        written += 1
    return written


def unreadable_note(pod: str, why: str) -> bytes:
    """The one line kept at a log's key when the log is given up on."""
    why = " ".join(why.split())  # one line
    if len(why) > MAX_WHY:
        why = why[: MAX_WHY - 3] + "..."
    return UNREADABLE_NOTE.format(pod=pod, why=why).encode("utf-8", "replace")


def read_tail(read: Callable[..., bytes], max_bytes: int) -> bytes:
    """A log through `read(tail_lines=, limit_bytes=)` (pods/log's cuts): the whole of it if it
    has at most `max_bytes`, else its last lines within `max_bytes` under a line saying so (a
    last line longer than that alone: its start). `limitBytes` keeps the first bytes of the lines
    asked for, so the end is found by asking for fewer lines: first as many as the log's first
    `max_bytes` hold (less a tenth), then half as many each time.

    Raises:
        DispatchError: the log cannot be read.
    """
    data = read(tail_lines=ALL_LINES, limit_bytes=max_bytes + 1)
    if len(data) <= max_bytes:
        return data
    lines = max(1, data.count(b"\n") * 9 // 10)
    for _ in range(TAIL_READS):
        data = read(tail_lines=lines, limit_bytes=max_bytes + 1)
        if len(data) <= max_bytes:
            what = f"only its last {lines} line(s) follow"
            return CUT_NOTE.format(max_bytes=max_bytes, what=what).encode() + data
        if lines == 1:
            break
        lines = max(1, lines // 2)
    what = f"only the first {max_bytes} bytes of its last {lines} line(s) follow"
    return CUT_NOTE.format(max_bytes=max_bytes, what=what).encode() + data[:max_bytes]


def archived_logs(artifacts: Artifacts, dispatch_id: str) -> list[ArchivedLog]:
    """The dispatch's archived logs, oldest attempt first (one LIST of its objects).

    Raises:
        ObjectStoreUnavailable: the store cannot be listed.
    """
    found = []
    for item in artifacts.store.list(keys.dispatch_prefix(artifacts.prefix, dispatch_id)):
        parsed = keys.parse_log_key(artifacts.prefix, item.key)
        if parsed is not None and parsed[0] == dispatch_id:
            found.append(ArchivedLog(item.key, parsed[1], parsed[2], item.size, item.modified))
    return sorted(found, key=lambda a: (a.attempt, a.modified, a.pod))


def read_log(artifacts: Artifacts, archived: ArchivedLog) -> Iterator[bytes]:
    """An archived log's bytes, streamed. Raises: ResultObjectMissing, ObjectStoreUnavailable."""
    return artifacts.store.read(archived.key)


def _ended_for(pod: PodLog, now: datetime) -> float | None:
    """Seconds since `pod`'s container ended; None when that is not known, and its unreadable log
    is not waited for: it still runs (the release stops it: what could be read is all there is)
    or its node was lost before it said."""
    return None if pod.finished_at is None else (now - pod.finished_at).total_seconds()


def _give_up(artifacts: Artifacts, key: str, namespace: str, pod: PodLog, why: str) -> int:
    """Leave the note at `key` unless an upload is there already (a release that crashed after
    it, the log since gone): objects written, 0 or 1. Raises: ObjectStoreUnavailable."""
    log.warning(
        "dispatch %s: the log of pod %s/%s could not be read (%s); it is released without it",
        pod.dispatch_id, namespace, pod.pod, why,
    )  # fmt: skip
    if artifacts.store.size(key) is not None:
        return 0
    artifacts.store.put(key, unreadable_note(pod.pod, why))
    return 1


def _wanted(specs: Specs, pod: PodLog) -> bool:
    """A capability no longer in the file has no say: its Pods' logs are not kept."""
    return pod.started and pod.capability in specs and specs.spec(pod.capability).archives_log(failed=pod.failed)
