"""What a Job's status means for its dispatch (pure): running, succeeded or failed, and why.

Reads Jobs and Pods as dicts in the API's camelCase JSON shape. `job_state` maps the Job's
conditions to an `Outcome`; `pick_termination` finds the container exit that holds the
result; `parse_result` turns a termination message into output (only what the store can
keep: `core.payloads.canonical_json` is the one rule) or a failure reason, never an
exception; `completion` puts the three together into what the terminal event records.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from k8s_dispatch.container.contract import MAX_RESULT_BYTES
from k8s_dispatch.core.errors import InputNotSerialisable
from k8s_dispatch.core.payloads import canonical_json
from k8s_dispatch.workers.manifest import CONTAINER_NAME

MAX_DETAIL_CHARS = 2048  # failure details (log tails, messages) kept in the terminal event

# Failure reasons of our own, next to the Job controller's (BackoffLimitExceeded, ...).
RESULT_MISSING = "ResultMissing"  # the container exited 0 without writing a result
# The Job succeeded, but no Pod of it holds the result any more (removed before delivery): not a
# failure of the work, which is run again (`Completion.lost`); never a terminal event's reason.
RESULT_LOST = "ResultLost"
RESULT_NOT_JSON = "ResultNotJson"
RESULT_TOO_LARGE = "ResultTooLarge"
CONTAINER_FAILED = "ContainerFailed"
JOB_DELETED = "JobDeleted"
JOB_FAILED = "JobFailed"  # a Failed condition that gave no reason

_CONTROLLER_UID_LABELS = ("batch.kubernetes.io/controller-uid", "controller-uid")


class Outcome(enum.Enum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


@dataclass(frozen=True)
class JobState:
    outcome: Outcome
    reason: str | None = None
    message: str | None = None

    @property
    def terminal(self) -> bool:
        return self.outcome is not Outcome.RUNNING


# Final conditions first: when a Job carries both a final and an interim condition (1.31+
# sets SuccessCriteriaMet/FailureTarget first), the final one speaks.
_TERMINAL_CONDITIONS = (
    ("Failed", Outcome.FAILED),
    ("Complete", Outcome.SUCCEEDED),
    ("FailureTarget", Outcome.FAILED),
    ("SuccessCriteriaMet", Outcome.SUCCEEDED),
)


def job_state(job: Mapping[str, Any]) -> JobState:
    """The Job's outcome from its `status.conditions` (only those with status "True").

    Failed/FailureTarget give FAILED with the condition's reason (BackoffLimitExceeded,
    DeadlineExceeded, PodFailurePolicy, ...); Complete/SuccessCriteriaMet give SUCCEEDED.
    A Job being deleted before it finished is FAILED with reason JobDeleted: the Job
    controller stops working on it, so it would otherwise stay RUNNING for ever.
    """
    conditions = _list(_dict(job.get("status")).get("conditions"))
    true_conditions: dict[str, Mapping[str, Any]] = {}
    for condition in conditions:
        condition = _dict(condition)
        if condition.get("status") == "True" and isinstance(condition.get("type"), str):
            true_conditions.setdefault(condition["type"], condition)
    for kind, outcome in _TERMINAL_CONDITIONS:
        condition = true_conditions.get(kind)
        if condition is not None:
            reason = _str(condition.get("reason"))
            if outcome is Outcome.FAILED and not reason:
                reason = JOB_FAILED
            return JobState(outcome, reason, _str(condition.get("message")))
    if _dict(job.get("metadata")).get("deletionTimestamp"):
        return JobState(Outcome.FAILED, JOB_DELETED, "the Job was deleted before it finished")
    return JobState(Outcome.RUNNING)


@dataclass(frozen=True)
class Result:
    """A parsed termination message: `output` when `ok`, else a `reason` and `detail`."""

    output: Any = None
    reason: str | None = None
    detail: str | None = None

    @property
    def ok(self) -> bool:
        return self.reason is None


def parse_result(message: str | None, *, exit_ok: bool) -> Result:
    """Turn a container's termination message into the dispatch's output or a failure.

    `exit_ok` says the container exited 0. Then the message must be JSON of at most 4 KiB that
    the store can keep (`canonical_json`'s rule: no number out of a double's range such as
    1e400, no lone surrogate such as "\\ud800", nesting bounded): otherwise ResultMissing (none
    or blank), ResultTooLarge or ResultNotJson, the detail saying why. A container
    that failed gives ContainerFailed, its message (the log tail, with FallbackToLogsOnError)
    as the detail.
    """
    if not exit_ok:
        return Result(reason=CONTAINER_FAILED, detail=_trim(message) or None)
    if message is None or not message.strip():
        return Result(reason=RESULT_MISSING, detail="the container exited 0 without writing a result")
    size = len(message.encode("utf-8", "surrogatepass"))
    if size > MAX_RESULT_BYTES:
        return Result(reason=RESULT_TOO_LARGE, detail=f"the result is {size} bytes, more than {MAX_RESULT_BYTES}")
    try:
        output = json.loads(message, parse_constant=_refuse_constant)
        canonical_json(output, what="the result")
    except InputNotSerialisable as e:
        return Result(
            reason=RESULT_NOT_JSON,
            detail=f"{e}: the store keeps only canonical JSON; the message begins {message[:200]!r}",
        )
    except (ValueError, RecursionError) as e:
        cut = (
            f"the message is {MAX_RESULT_BYTES} bytes, where the kubelet cuts a longer one (keeping its end): "
            "the result was probably larger than that; "
            if size == MAX_RESULT_BYTES
            else ""
        )
        return Result(reason=RESULT_NOT_JSON, detail=f"{cut}{e}; the message begins {message[:200]!r}")
    return Result(output=output)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


@dataclass(frozen=True)
class Termination:
    """How the worker container of one of the Job's pods ended."""

    pod_name: str
    exit_code: int
    reason: str | None  # Completed, Error, OOMKilled, ...
    message: str | None
    finished_at: datetime | None
    pod_succeeded: bool

    @property
    def exit_ok(self) -> bool:
        return self.exit_code == 0


def pick_termination(
    pods: Iterable[Mapping[str, Any]],
    *,
    container: str = CONTAINER_NAME,
    job_uid: str | None = None,
) -> Termination | None:
    """The termination that speaks for the Job: a succeeded pod's if any, else the latest.

    Looks at `container`'s terminated state (else, if a pod has no container of that name,
    its only container). With `job_uid`, pods not owned by that Job (left from an earlier
    Job of the same name) are ignored. None when no container has terminated yet.
    """
    found = []
    for pod in pods:
        pod = _dict(pod)
        metadata = _dict(pod.get("metadata"))
        if job_uid is not None and not _may_belong_to(metadata, job_uid):
            continue
        status = _dict(pod.get("status"))
        terminated = terminated_state(_list(status.get("containerStatuses")), container)
        if terminated is None:
            continue
        exit_code = terminated.get("exitCode")
        if isinstance(exit_code, bool) or not isinstance(exit_code, int):
            continue  # the API always sets it; a state without one says nothing
        found.append(
            Termination(
                pod_name=_str(metadata.get("name")) or "",
                exit_code=exit_code,
                reason=_str(terminated.get("reason")),
                message=_str(terminated.get("message")),
                finished_at=parse_timestamp(terminated.get("finishedAt")),
                pod_succeeded=status.get("phase") == "Succeeded",
            )
        )
    if not found:
        return None
    epoch = datetime.min.replace(tzinfo=UTC)
    return max(found, key=lambda t: (t.pod_succeeded or t.exit_ok, t.finished_at or epoch, t.pod_name))


def _may_belong_to(metadata: Mapping[str, Any], job_uid: str) -> bool:
    """False if the pod names another Job as its controller (by ownerReference or label).

    An orphaned pod has lost its ownerReferences but keeps its controller-uid labels.
    """
    owners = [_dict(o) for o in _list(metadata.get("ownerReferences")) if _dict(o).get("controller") is True]
    labels = _dict(metadata.get("labels"))
    uids = {o.get("uid") for o in owners} | {labels.get(key) for key in _CONTROLLER_UID_LABELS if key in labels}
    return not uids or uids == {job_uid}


def terminated_state(statuses: list[Any], container: str) -> Mapping[str, Any] | None:
    """The `terminated` state among a Pod's container statuses: the named container's, or the
    only container's when none has the name (pure). None while it has not ended."""
    statuses = [_dict(s) for s in statuses]
    chosen = [s for s in statuses if s.get("name") == container] or (statuses if len(statuses) == 1 else [])
    for status in chosen:
        terminated = _dict(_dict(status.get("state")).get("terminated"))
        if terminated:
            return terminated
    return None


@dataclass(frozen=True)
class Completion:
    """What a finished Job's terminal event records: output, or a failure reason and detail."""

    succeeded: bool
    output: Any = None
    reason: str | None = None
    detail: str | None = None

    @property
    def lost(self) -> bool:
        """The work succeeded but its result is gone with its Pod: run it again, record nothing."""
        return self.reason == RESULT_LOST


def completion(
    job: Mapping[str, Any], pods: Iterable[Mapping[str, Any]], *, container: str = CONTAINER_NAME
) -> Completion | None:
    """The terminal event a Job calls for, or None while it runs.

    Succeeded Job: the chosen pod's result, or ResultMissing/ResultNotJson/ResultTooLarge; with
    no succeeded pod left (the one that succeeded was removed), ResultLost (`Completion.lost`).
    Failed Job: the condition's reason (BackoffLimitExceeded, DeadlineExceeded, ...), with the
    container's message (its log tail) or else the condition's message as the detail.
    """
    state = job_state(job)
    if not state.terminal:
        return None
    uid = _str(_dict(job.get("metadata")).get("uid"))
    termination = pick_termination(pods, container=container, job_uid=uid)
    if state.outcome is Outcome.SUCCEEDED:
        if termination is None or not termination.exit_ok:
            # Only a container that exited 0 holds a result (a failed one's message is a log
            # tail), and the one that did is gone: the result is lost, not missing.
            return Completion(succeeded=False, reason=RESULT_LOST, detail=_LOST_DETAIL)
        result = parse_result(termination.message, exit_ok=True)
        if result.ok:
            return Completion(succeeded=True, output=result.output)
        return Completion(succeeded=False, reason=result.reason, detail=result.detail)
    detail = _trim(termination.message) if termination and termination.message else None
    return Completion(succeeded=False, reason=state.reason, detail=detail or _trim(state.message) or None)


_LOST_DETAIL = "the Job succeeded but no Pod of it holds the result any more"


# --- tolerant readers: the API's JSON may lack any field -------------------------------


def _dict(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _trim(text: str | None) -> str:
    """The end of `text` (where a traceback's last line is), at most MAX_DETAIL_CHARS."""
    if not text:
        return ""
    return text if len(text) <= MAX_DETAIL_CHARS else "..." + text[-(MAX_DETAIL_CHARS - 3) :]


def parse_timestamp(value: object) -> datetime | None:
    """RFC 3339 as the API writes it ("...Z") or as `sanitize_for_serialization` does ("+00:00")."""
    if isinstance(value, datetime):
        parsed = value
    elif isinstance(value, str):
        try:
            parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
    else:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
