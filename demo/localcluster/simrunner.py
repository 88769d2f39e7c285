"""The simulate runner: containers without processes. Each one "runs" for the duration and ends
with the outcome its pod's annotations ask for; one timer per running pod (loop.call_later),
so tens of thousands of pods cost a dict entry and a timer handle each.

Annotations (on the Job's pod template): localcluster.k8s-dispatch.io/duration-ms (default 50),
/outcome succeed|fail|hang, /exit-code (default 1 on fail), /result (the termination message;
default {"simulated":true,"input":<parsed K8S_DISPATCH_INPUT or null>}), /result-base64 (the
termination message as the bytes a container wrote, read as the exec runner reads its file: the
first 4 KiB, invalid UTF-8 replaced, as the API server's JSON does), /log and /log-base64 (what
the container writes to its log, served by pods/log; a failed container with no result annotation
then ends with the log's last 2 KiB as its message, as FallbackToLogsOnError does), /oom "true"
(the container is OOMKilled at the end of its run: exit 137, reason OOMKilled), and, for the kubelet
of either runner, /evict-attempts K (the Job's first K Pods are evicted through the Eviction API
/evict-after-ms into their run, default half the duration).

An Indexed Job's Pods can differ by index: /by-index is a JSON object from index to the annotations
(short names: "outcome", "exit-code", "duration-ms", "result"...) that index's Pods take instead,
with "attempts": K applying them only to its first K Pods (as the Job controller counts them in
batch.kubernetes.io/job-index-failure-count and -ignored-failure-count, with backoffLimitPerIndex).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from dataclasses import dataclass
from typing import Any, Protocol

from k8s_dispatch.demo.localcluster.podstatus import ContainerResult
from k8s_dispatch.demo.localcluster.store import dumps, loads
from k8s_dispatch.demo.localcluster.timestamps import now

PREFIX = "localcluster.k8s-dispatch.io/"
DURATION = PREFIX + "duration-ms"
OUTCOME = PREFIX + "outcome"
EXIT_CODE = PREFIX + "exit-code"
RESULT = PREFIX + "result"
RESULT_BASE64 = PREFIX + "result-base64"
LOG = PREFIX + "log"
LOG_BASE64 = PREFIX + "log-base64"
OOM = PREFIX + "oom"
EVICT_ATTEMPTS = PREFIX + "evict-attempts"
EVICT_AFTER = PREFIX + "evict-after-ms"
BY_INDEX = PREFIX + "by-index"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
INDEX_FAILURES = ("batch.kubernetes.io/job-index-failure-count", "batch.kubernetes.io/job-index-ignored-failure-count")
OOM_EXIT_CODE = 137
FALLBACK_LOG_BYTES = 2048  # what FallbackToLogsOnError takes of the log
CONTROLLER_UID = "batch.kubernetes.io/controller-uid"
INPUT_ENV = "K8S_DISPATCH_INPUT"
MAX_MESSAGE = 4096  # the kubelet keeps a longer message's last 4 KiB


class Callbacks(Protocol):
    def started(self, uid: str, started_at: float, container_id: str) -> None: ...
    def finished(self, uid: str, result: ContainerResult) -> None: ...


@dataclass(frozen=True)
class Plan:
    duration: float
    outcome: str
    exit_code: int
    message: str
    reason: str | None = None  # the terminated state's reason, if not Completed/Error (OOMKilled)
    log: bytes | None = None  # what the container writes to its log; None: its message


@dataclass(frozen=True)
class Eviction:
    attempts: int  # the Job's first `attempts` Pods are evicted
    after: float  # seconds into the run


def _annotations(pod: dict[str, Any]) -> dict[str, str]:
    """The pod's annotations, with its index's `by-index` entry in force (pure)."""
    ann: dict[str, str] = (pod.get("metadata") or {}).get("annotations") or {}
    if BY_INDEX not in ann:
        return ann
    try:
        entry = loads(ann[BY_INDEX]).get(ann.get(COMPLETION_INDEX, ""))
    except (ValueError, AttributeError):
        return ann
    if not isinstance(entry, dict):
        return ann
    if "attempts" in entry:
        try:
            tried = sum(int(ann.get(key, "0")) for key in INDEX_FAILURES)
        except ValueError:
            tried = 0
        if tried >= int(entry["attempts"]):
            return ann
    over = {PREFIX + k: v if isinstance(v, str) else dumps(v).decode() for k, v in entry.items() if k != "attempts"}
    return {**ann, **over}


def eviction_plan(pod: dict[str, Any]) -> Eviction | None:
    """Whether the kubelet evicts this Job's Pods, from the `evict-attempts` annotation (pure)."""
    ann = _annotations(pod)
    try:
        attempts = int(ann.get(EVICT_ATTEMPTS, "0"))
    except ValueError:
        return None
    if attempts <= 0:
        return None
    try:
        after = float(ann[EVICT_AFTER]) / 1000.0 if EVICT_AFTER in ann else _duration(ann) / 2
    except ValueError:
        after = _duration(ann) / 2
    return Eviction(attempts, max(0.0, after))


def job_uid(pod: dict[str, Any]) -> str:
    """The uid of the Job that owns `pod` (its controller reference, or the label an orphan keeps)."""
    meta = pod.get("metadata") or {}
    for ref in meta.get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") == "Job":
            return str(ref.get("uid", ""))
    return str((meta.get("labels") or {}).get(CONTROLLER_UID, ""))


def _duration(ann: dict[str, str]) -> float:
    try:
        return max(0.0, float(ann.get(DURATION, "50")) / 1000.0)
    except ValueError:
        return 0.05


def _log(ann: dict[str, str]) -> bytes | None:
    if LOG_BASE64 in ann:
        try:
            return base64.b64decode(ann[LOG_BASE64], validate=True)
        except (binascii.Error, ValueError):
            return b""
    return ann[LOG].encode() if LOG in ann else None


def plan(pod: dict[str, Any]) -> Plan:
    """What a simulated container does, from its pod's annotations (pure)."""
    p = _plan(pod)
    ann = _annotations(pod)
    log = _log(ann)
    oom = ann.get(OOM) == "true"
    reason = "OOMKilled" if oom else None
    exit_code = OOM_EXIT_CODE if oom else p.exit_code
    outcome = "fail" if oom else p.outcome
    message = p.message
    if outcome == "fail" and log is not None and RESULT not in ann and RESULT_BASE64 not in ann:
        message = log[-FALLBACK_LOG_BYTES:].decode(errors="replace")  # FallbackToLogsOnError
    return Plan(p.duration, outcome, exit_code, message, reason, log)


def _plan(pod: dict[str, Any]) -> Plan:
    ann = _annotations(pod)
    try:
        duration = max(0.0, float(ann.get(DURATION, "50")) / 1000.0)
    except ValueError:
        duration = 0.05
    outcome = ann.get(OUTCOME, "succeed")
    if outcome not in ("succeed", "fail", "hang"):
        outcome = "succeed"
    try:
        exit_code = int(ann.get(EXIT_CODE, "1"))
    except ValueError:
        exit_code = 1
    if outcome == "succeed":
        exit_code = 0
    elif exit_code == 0:
        exit_code = 1
    if RESULT_BASE64 in ann:
        try:
            written = base64.b64decode(ann[RESULT_BASE64], validate=True)
        except (binascii.Error, ValueError):
            written = b""
        return Plan(duration, outcome, exit_code, written[-MAX_MESSAGE:].decode(errors="replace"))
    if RESULT in ann:
        message = ann[RESULT]
    else:
        raw = None
        for c in (pod.get("spec") or {}).get("containers") or []:
            for var in c.get("env") or []:
                if var.get("name") == INPUT_ENV and "value" in var:
                    raw = var["value"]
        try:
            parsed = loads(raw) if raw is not None else None
        except ValueError:
            parsed = raw
        message = dumps({"simulated": True, "input": parsed}).decode()
    return Plan(duration, outcome, exit_code, message.encode()[-MAX_MESSAGE:].decode(errors="ignore"))


class SimRunner:
    immediate = True

    def __init__(self, callbacks: Callbacks, *, loop: asyncio.AbstractEventLoop) -> None:
        self._callbacks = callbacks
        self._loop = loop
        self._timers: dict[str, asyncio.TimerHandle | None] = {}
        self._started: dict[str, float] = {}
        self._logs: dict[str, bytes] = {}

    def start(
        self, uid: str, pod: dict[str, Any], *, started_at: float | None = None, env: dict[str, str] | None = None
    ) -> float:
        """Start (or, after a restart, resume) a container; returns its start time. `env` (the
        resolved one) is not read: a default result echoes only an input given as a literal value,
        so no Secret's value reaches a Pod's status."""
        p = plan(pod)
        t0 = started_at if started_at is not None else now()
        self._started[uid] = t0
        if p.outcome == "hang":
            self._timers[uid] = None
        else:
            delay = max(0.0, t0 + p.duration - now())
            self._timers[uid] = self._loop.call_later(delay, self._finish, uid, p)
        return t0

    def container_id(self, uid: str) -> str:
        return f"localcluster://sim-{uid[:12]}"

    def _finish(self, uid: str, p: Plan) -> None:
        if uid not in self._timers:
            return
        del self._timers[uid]
        started = self._started.pop(uid, None)
        if p.log is not None:
            self._logs[uid] = p.log
        else:
            self._logs[uid] = (p.message + "\n").encode() if p.message else b""
        reason = p.reason or ("Completed" if p.exit_code == 0 else "Error")
        self._callbacks.finished(uid, ContainerResult(p.exit_code, reason, p.message, started, now()))

    def stop(self, uid: str, grace: float) -> None:
        if uid not in self._timers:
            return
        handle = self._timers.pop(uid)
        if handle is not None:
            handle.cancel()
        started = self._started.pop(uid, None)
        self._callbacks.finished(uid, ContainerResult(143, "Error", "", started, now()))

    def logs(self, uid: str) -> bytes:
        return self._logs.get(uid, b"")

    def running(self, uid: str) -> bool:
        return uid in self._timers

    def forget(self, uid: str) -> None:
        self._logs.pop(uid, None)

    async def close(self) -> None:
        for handle in self._timers.values():
            if handle is not None:
                handle.cancel()
        self._timers.clear()
