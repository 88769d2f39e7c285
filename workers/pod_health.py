"""Why a Job's container has not started, and whether to keep waiting (pure).

A Pod that will never run (a bad image, a missing Secret, no node that fits) would otherwise
hold its dispatch until `activeDeadlineSeconds` and end with a misleading `DeadlineExceeded`.
`assess` reads a Job's Pods (API dicts, camelCase) against the capability's clocks
(`StartPolicy`) and answers wait, or fail now with the real cause as reason (the kubelet's
waiting reason, `Unschedulable`, `StartTimeout`) and its message, e.g.
`Back-off pulling image "foo:1"`. Ages are durations: the Job's age by the database's clock,
and offsets between the Job's and its Pod's own timestamps (one server's clock), so no two
hosts' clocks are ever compared.

A suspended Job (created so for a Kueue queue, or suspended by an operator) is queued: its
start clock has not started. Resumed, the Job controller starts it again (`status.startTime`)
and the clock counts from there, so the time spent waiting in the queue never fails it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from k8s_dispatch.workers.capability import StartPolicy
from k8s_dispatch.workers.job_status import job_state, parse_timestamp
from k8s_dispatch.workers.manifest import QUEUE_NAME_LABEL

# The waiting reasons a kubelet reports for a container that cannot start.
INVALID_IMAGE_NAME = "InvalidImageName"  # the reference cannot be parsed: no retry will help
IMAGE_PULL_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff"})  # may be a registry's hiccup
CONFIG_REASONS = frozenset({"CreateContainerConfigError", "CreateContainerError", "RunContainerError"})
UNSCHEDULABLE = "Unschedulable"  # PodScheduled=False: an autoscaler may be adding a node
START_TIMEOUT = "StartTimeout"  # the start clock ran out with no sharper cause to name
FAILED_CREATE = "FailedCreate"  # the Job controller could not create a Pod (quota, admission)
QUEUE_TIMEOUT = "QueueTimeout"  # the queue clock: the Job itself could not be created in time
NEVER_RUN_REASONS = frozenset({INVALID_IMAGE_NAME, *IMAGE_PULL_REASONS, *CONFIG_REASONS})

# A Job younger than this with no started container is normal (binding, pulling, starting take
# seconds): its Pods are not read at all. Kept short, so that InvalidImageName fails "at once".
CHECK_GRACE = timedelta(seconds=5)

_JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
_CONTROLLER_UID_LABEL = "batch.kubernetes.io/controller-uid"


@dataclass(frozen=True)
class Verdict:
    """Wait (`fail` False), or give up with `reason` and `message` (naming `pod` if one spoke)."""

    fail: bool
    reason: str | None = None
    message: str | None = None
    pod: str | None = None


WAIT = Verdict(fail=False)


@dataclass(frozen=True)
class PodView:
    """What `assess` needs of one Pod."""

    name: str
    started: bool  # a container ran (or runs): the start clock is met
    waiting_reason: str | None
    waiting_message: str | None
    unschedulable: str | None  # the scheduler's message while PodScheduled=False Unschedulable
    since: datetime | None  # when it was scheduled (else created): where its own waits begin


def is_suspended(job: Mapping[str, Any]) -> bool:
    """Whether the Job is queued, waiting for admission (Kueue's, or an operator's): its spec
    says suspend, or the Job controller has not yet acted on its resume (its `Suspended`
    condition is still True). Such a Job has no Pod to wait for: it counts as queued, not running."""
    if _dict(job.get("spec")).get("suspend") is True:
        return True
    return any(_dict(c).get("type") == "Suspended" and _dict(c).get("status") == "True" for c in _conditions(job))


def start_age(job: Mapping[str, Any], *, age: timedelta) -> timedelta | None:
    """How long the Job's start clock has run, `age` being the Job's age by the database's
    clock; None while it has not started (a queued Job).

    A Job that was ever suspended (it has a `Suspended` condition, or Kueue's queue label: it
    was created suspended) starts its clock when the Job controller resumes it, at
    `status.startTime` (None until then): its age less the offset from its creation, both
    timestamps the control plane's. Any other Job's clock runs from its creation."""
    if is_suspended(job):
        return None
    queued = QUEUE_NAME_LABEL in _dict(_dict(job.get("metadata")).get("labels")) or any(
        _dict(c).get("type") == "Suspended" for c in _conditions(job)
    )
    if not queued:
        return age
    started = parse_timestamp(_dict(job.get("status")).get("startTime"))
    if started is None:
        return None
    return age - _offset(started, parse_timestamp(_dict(job.get("metadata")).get("creationTimestamp")))


def unstarted(job: Mapping[str, Any]) -> bool:
    """Whether the Job runs with no container started yet, by its own status (no Pod read):
    not finished, not being deleted, not suspended, no ready, succeeded or failed Pod.

    A suspended Job waits for admission (`is_suspended`): its Pods are not meant to start, so
    its start clock has not started either."""
    if job_state(job).terminal or _dict(job.get("metadata")).get("deletionTimestamp"):
        return False
    if is_suspended(job):
        return False
    status = _dict(job.get("status"))
    return not any(_count(status.get(key)) for key in ("ready", "succeeded", "failed"))


def due_for_check(job: Mapping[str, Any], *, age: timedelta) -> bool:
    """Whether to read this Job's Pods: unstarted, its start clock (`start_age`) past CHECK_GRACE."""
    started = start_age(job, age=age)
    return started is not None and started >= CHECK_GRACE and unstarted(job)


def pods_of(job: Mapping[str, Any], pods: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The Pods (from a LIST of many Jobs') that this Job controls: its name's label, and not
    another Job's uid (a Pod left by an earlier Job of the same name)."""
    metadata = _dict(job.get("metadata"))
    name, uid = metadata.get("name"), metadata.get("uid")
    mine = []
    for pod in pods:
        meta = _dict(pod.get("metadata"))
        labels = _dict(meta.get("labels"))
        if labels.get(_JOB_NAME_LABEL) != name:
            continue
        owners = {_dict(o).get("uid") for o in _list(meta.get("ownerReferences")) if _dict(o).get("controller")}
        owners |= {labels[_CONTROLLER_UID_LABEL]} if _CONTROLLER_UID_LABEL in labels else set()
        if uid is None or not owners or owners == {uid}:
            mine.append(pod)
    return mine


def read_pod(pod: Mapping[str, Any]) -> PodView:
    """A Pod's start as its status tells it (tolerant of any missing field)."""
    metadata, status = _dict(pod.get("metadata")), _dict(pod.get("status"))
    started = status.get("phase") in ("Running", "Succeeded", "Failed")
    waiting_reason = waiting_message = None
    for container in [_dict(c) for c in _list(status.get("containerStatuses"))]:
        state = _dict(container.get("state"))
        if container.get("started") is True or "running" in state or "terminated" in state:
            started = True
        if _dict(container.get("lastState")).get("terminated"):
            started = True
        waiting = _dict(state.get("waiting"))
        if waiting and waiting_reason is None:
            waiting_reason, waiting_message = _str(waiting.get("reason")), _str(waiting.get("message"))
    unschedulable = scheduled_at = None
    for condition in [_dict(c) for c in _list(status.get("conditions"))]:
        if condition.get("type") != "PodScheduled":
            continue
        if condition.get("status") == "False" and condition.get("reason") == UNSCHEDULABLE:
            unschedulable = _str(condition.get("message")) or "the Pod cannot be scheduled"
        elif condition.get("status") == "True":
            scheduled_at = parse_timestamp(condition.get("lastTransitionTime"))
    return PodView(
        name=_str(metadata.get("name")) or "",
        started=started,
        waiting_reason=waiting_reason,
        waiting_message=waiting_message,
        unschedulable=unschedulable,
        since=scheduled_at or parse_timestamp(metadata.get("creationTimestamp")),
    )


def assess(
    job: Mapping[str, Any],
    pods: Iterable[Mapping[str, Any]],
    *,
    age: timedelta,
    policy: StartPolicy,
    events: Iterable[Mapping[str, Any]] = (),
) -> Verdict:
    """Wait, or give up on a Job none of whose containers has started.

    `age` is the Job's age by the database's clock (now - when its dispatch recorded the Job
    created), the start clock counting from its resume if it was queued (`start_age`); `pods` may be a LIST of many Jobs' Pods (this Job's are picked); `events` any
    core/v1 Events read for the Job (a Warning FailedCreate names why no Pod exists).

    In order: a Pod started, wait (the Job's own conditions speak from now on); a Pod waiting
    with InvalidImageName, fail at once; an image pull or a config error waiting longer than its
    timeout, counted from the Pod's scheduling, fail with that reason; past the start clock,
    fail with the sharpest cause seen: a never-run waiting reason, Unschedulable with the
    scheduler's message, FailedCreate with the controller's, else StartTimeout.
    """
    views = [read_pod(pod) for pod in pods_of(job, pods)]
    started = start_age(job, age=age)
    if started is None or any(view.started for view in views):
        return WAIT
    created = parse_timestamp(_dict(job.get("metadata")).get("creationTimestamp"))
    for view in views:
        if view.waiting_reason == INVALID_IMAGE_NAME:
            return _fail(view.waiting_reason, view.waiting_message, view)
    for view in views:
        waited = age - _offset(view.since, created)
        if view.waiting_reason in IMAGE_PULL_REASONS and waited >= timedelta(seconds=policy.image_pull_timeout_s):
            return _fail(view.waiting_reason, view.waiting_message, view)
        if view.waiting_reason in CONFIG_REASONS and waited >= timedelta(seconds=policy.config_error_timeout_s):
            return _fail(view.waiting_reason, view.waiting_message, view)
    if started < timedelta(seconds=policy.start_timeout_s):
        return WAIT
    within = f"within startTimeoutSeconds ({policy.start_timeout_s} s)"
    for view in views:
        if view.waiting_reason in NEVER_RUN_REASONS:
            return _fail(view.waiting_reason, view.waiting_message, view)
    for view in views:
        if view.unschedulable is not None:
            return _fail(UNSCHEDULABLE, view.unschedulable, view)
    if not views:
        refused = _failed_create(events)
        if refused is not None:
            return Verdict(fail=True, reason=FAILED_CREATE, message=refused)
        return Verdict(fail=True, reason=START_TIMEOUT, message=f"no Pod of the Job was created {within}")
    view = views[0]
    doing = view.waiting_reason or "Pending"
    detail = f": {view.waiting_message}" if view.waiting_message else ""
    return Verdict(
        fail=True,
        reason=START_TIMEOUT,
        message=f"no container of the Job started {within}; pod {view.name}: {doing}{detail}",
        pod=view.name,
    )


def _fail(reason: str | None, message: str | None, view: PodView) -> Verdict:
    return Verdict(fail=True, reason=reason, message=message or f"pod {view.name}: {reason}", pod=view.name)


def _failed_create(events: Iterable[Mapping[str, Any]]) -> str | None:
    """The latest Warning FailedCreate event's message, if any."""
    found = [_dict(e) for e in events if _dict(e).get("reason") == FAILED_CREATE and _dict(e).get("type") == "Warning"]
    if not found:
        return None
    latest = max(found, key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or ""))
    return _str(latest.get("message")) or "the Job controller could not create a Pod"


def _offset(since: datetime | None, created: datetime | None) -> timedelta:
    """How long after the Job's creation its Pod began waiting (both the API server's clock);
    zero when either is unknown, never negative."""
    if since is None or created is None:
        return timedelta(0)
    return max(since - created, timedelta(0))


def _conditions(job: Mapping[str, Any]) -> list[Any]:
    return _list(_dict(job.get("status")).get("conditions"))


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _dict(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []


def _str(value: object) -> str | None:
    return value if isinstance(value, str) and value else None
