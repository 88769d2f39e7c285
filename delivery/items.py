"""Deliver a map's items as their Pods finish, and the map itself when its Indexed Job ends.

A map's Job is handed to the completion path while it runs, not only once it has finished
(`delivery.jobwatch` keeps it among the Jobs to hand off), and `complete.complete_jobs` passes it
here. Per hand-off of a running map, only the Pods that can change something are read
(`indexes_to_read`, pure): those of the indexes the Job's status counts completed or failed whose
item has no end yet, selected by the Pod label `batch.kubernetes.io/job-completion-index` (`in`,
chunked), and those of indexes with a failed Pod the controller let go of since the last look
(`retried_count`, a counter kept in Redis: a Job change that retried nothing reads no failed
Pod). So a map of n items costs each item's Pods about once, not n Pods per change. Each Pod's
item is decided (`decide`, pure): a succeeded Pod's result, or the failure of an index the Job
controller gave up on (`failedIndexes`); the ends are written in one transaction through
`terminal.record_items` (the primary key on (dispatch, item) is the arbiter); then the Pods whose
item is recorded, or whose index was retried, are freed of our finalizer. Once the Job has ended,
all its Pods are read once: the items still open end with the Job's reason, the map's own
terminal event is written in the same transaction, saying how many items succeeded and failed and
why the map passed or failed, every Pod still held is freed, and the Job is released, as any
delivered Job is.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from k8s_dispatch.core.errors import Transient
from k8s_dispatch.delivery import handoff, terminal
from k8s_dispatch.delivery.cleanup import JOB_NAME_LABEL, controller_uids, pods_by_job, release_job, release_pods
from k8s_dispatch.delivery.reconstruct import DeliveryContext
from k8s_dispatch.delivery.records import contexts_of
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.store import dispatches, maps
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import EventType, ItemEventType
from k8s_dispatch.workers import failure_detail
from k8s_dispatch.workers.indexed import (
    COMPLETION_INDEX,
    failure_count,
    item_indexes,
    item_of,
    parse_intervals,
    pod_index,
    status_indexes,
)
from k8s_dispatch.workers.job_status import job_state, parse_result, pick_termination
from k8s_dispatch.workers.manifest import FINALIZER

log = logging.getLogger(__name__)

ITEMS_FAILED = "ItemsFailed"  # the map's reason when too few items succeeded
ITEM_RESULT_LOST = "ItemResultLost"  # an index the Job counts succeeded, with no Pod holding its result
_IGNORED_FAILURE_COUNT = "batch.kubernetes.io/job-index-ignored-failure-count"
# The Job's own reasons that only say "some items failed": the map's reason is then ITEMS_FAILED.
_ITEM_REASONS = frozenset({"FailedIndexes", None})

# What one map Job came to, as `complete.CompleteOutcome` values.
COMPLETED, ALREADY_TERMINAL, RUNNING, CLAIMED_ELSEWHERE, REFUSED = (
    "completed", "already_terminal", "running", "claimed_elsewhere", "refused",
)  # fmt: skip


@dataclass
class Decided:
    """What a map Job's Pods say now (pure result of `decide`)."""

    ends: list[maps.ItemEnd] = field(default_factory=list)  # items ending now
    retried: list[Mapping[str, Any]] = field(default_factory=list)  # failed Pods whose index ran again


@dataclass
class Delivered:
    """What `deliver_maps` did: an outcome per Job (in order), and the Jobs a Transient error left."""

    outcomes: list[str] = field(default_factory=list)
    unavailable: list[Mapping[str, Any]] = field(default_factory=list)
    error: Transient | None = None


def _attempt(pod: Mapping[str, Any]) -> int:
    """Which run of its index a Pod is: failures counted, and disruptions (ignored) too."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    try:
        ignored = max(0, int(str(annotations.get(_IGNORED_FAILURE_COUNT, "0"))))
    except ValueError:
        ignored = 0
    return failure_count(pod) + ignored


def _phase(pod: Mapping[str, Any]) -> str:
    return str((pod.get("status") or {}).get("phase", ""))


def item_end(dispatch_id: str, index: int, pod: Mapping[str, Any]) -> maps.ItemEnd:
    """The end a finished Pod gives its item (pure): its result, or why it failed."""
    termination = pick_termination([pod])
    if _phase(pod) == "Succeeded":
        result = parse_result(termination.message if termination else None, exit_ok=True)
        if result.ok:
            return maps.ItemEnd(dispatch_id, index, ItemEventType.ITEM_COMPLETED, {"output": result.output})
        return maps.ItemEnd(
            dispatch_id, index, ItemEventType.ITEM_FAILED, {"reason": result.reason, "message": result.detail}
        )
    if termination is None:
        reason = str((pod.get("status") or {}).get("reason") or "PodFailed")
        message = (pod.get("status") or {}).get("message")
        return maps.ItemEnd(dispatch_id, index, ItemEventType.ITEM_FAILED, {"reason": reason, "message": message})
    result = parse_result(termination.message, exit_ok=False)
    payload: dict[str, Any] = {
        "reason": failure_detail.OOM_KILLED if termination.reason == failure_detail.OOM_KILLED else result.reason,
        "exit_code": termination.exit_code,
    }
    if result.detail:
        payload["message"] = result.detail
    return maps.ItemEnd(dispatch_id, index, ItemEventType.ITEM_FAILED, payload)


def decide(
    dispatch_id: str, job: Mapping[str, Any], pods: Sequence[Mapping[str, Any]], ended: Mapping[int, str], items: int
) -> Decided:
    """The items a map Job's finished Pods end now, and the Pods that were retried (pure).

    A succeeded Pod ends its item. A failed one ends its item only once the Job controller gave
    its index up (`failedIndexes`) or the Job ended; while a later Pod of its index exists it
    was retried (freed, no end); otherwise it waits for the next look. Items already `ended`
    are skipped (their Pods are freed by the caller). Indexes are the items' (a Job made for
    some items only maps its completion indexes through its `item_indexes`).

    Raises:
        LabelMismatch: the Job's item indexes are unreadable (`workers.indexed.item_indexes`).
    """
    indexes = item_indexes(job)
    _, failed_indexes = status_indexes(job, indexes)
    job_ended = job_state(job).terminal
    latest: dict[int, int] = {}
    for pod in pods:
        index = item_of(indexes, pod_index(pod))
        if index is not None:
            latest[index] = max(latest.get(index, 0), _attempt(pod))
    out = Decided()
    chosen: dict[int, Mapping[str, Any]] = {}
    for pod in pods:
        index = item_of(indexes, pod_index(pod))
        phase = _phase(pod)
        if index is None or not 0 <= index < items or phase not in ("Succeeded", "Failed") or index in ended:
            continue
        if phase == "Succeeded":
            chosen[index] = pod  # a success speaks for its index, whatever failed before it
        elif _attempt(pod) < latest[index]:
            out.retried.append(pod)
        elif (index in failed_indexes or job_ended) and _phase(chosen.get(index, {})) != "Succeeded":
            chosen[index] = pod
    out.ends = [item_end(dispatch_id, index, pod) for index, pod in sorted(chosen.items())]
    return out


def map_event(
    dispatch_id: str, job: Mapping[str, Any], shape: maps.MapShape, counts: Mapping[str, int]
) -> dispatches.TerminalEvent:
    """The map's one terminal event once every item has ended (pure): how many succeeded and
    failed, and why the map passed or failed."""
    succeeded = counts.get(ItemEventType.ITEM_COMPLETED.value, 0)
    failed = counts.get(ItemEventType.ITEM_FAILED.value, 0) + counts.get(ItemEventType.ITEM_CANCELLED.value, 0)
    needed = shape.items if shape.min_succeeded is None else shape.min_succeeded
    summary = {"items": shape.items, "succeeded": succeeded, "failed": failed, "needed": needed}
    if shape.passed(succeeded):
        return dispatches.TerminalEvent(dispatch_id, EventType.WORKER_COMPLETED, {"output": summary})
    job_reason = job_state(job).reason
    reason = ITEMS_FAILED if job_reason in _ITEM_REASONS else job_reason
    message = f"{succeeded} of {shape.items} items succeeded, {needed} needed"
    if job_reason not in _ITEM_REASONS:
        message += f"; the Job ended {job_reason}"
    return dispatches.TerminalEvent(
        dispatch_id, EventType.WORKER_FAILED, {"reason": reason, "message": message, "detail": summary}
    )


def open_item_ends(
    dispatch_id: str, job: Mapping[str, Any], shape: maps.MapShape, ended: Mapping[int, str]
) -> list[maps.ItemEnd]:
    """Once the Job has ended: an end for each item no Pod ended (pure). An index the Job counts
    succeeded whose result no Pod holds any more is ITEM_RESULT_LOST; any other ends with the
    Job's reason (it never ran, or ran when the Job stopped)."""
    completed, _ = status_indexes(job, item_indexes(job))
    reason = job_state(job).reason or "JobEnded"
    ends = []
    for index in range(shape.items):
        if index in ended:
            continue
        if index in completed:
            payload = {
                "reason": ITEM_RESULT_LOST,
                "message": "the Job counts this item succeeded; no Pod holds its result",
            }
        else:
            payload = {"reason": reason, "message": "the Job ended before this item did"}
        ends.append(maps.ItemEnd(dispatch_id, index, ItemEventType.ITEM_FAILED, payload))
    return ends


def deliver_maps(rt: Runtime, namespace: str, jobs: Sequence[Mapping[str, Any]]) -> Delivered:
    """Deliver map Jobs of one namespace as a LIST or a watch read them, running or finished.
    A Transient error stops the batch: the Jobs not yet dealt with are returned to retry."""
    done = Delivered()
    contexts = contexts_of(rt, jobs)
    for position, (job, context) in enumerate(zip(jobs, contexts, strict=True)):
        try:
            done.outcomes.append(_deliver(rt, namespace, job, context))
        except Transient as e:
            log.warning("delivering map jobs in %s stopped (%s); %d left to retry", namespace, e, len(jobs) - position)
            done.unavailable = list(jobs[position:])
            done.error = e
            break
    return done


def indexes_to_read(
    job: Mapping[str, Any], ended: Mapping[int, str], items: int, *, retried: Iterable[int] = ()
) -> list[int]:
    """The completion indexes whose Pods a running map's hand-off reads, ascending (pure): those
    the Job's status counts completed or failed (`completedIndexes`, `failedIndexes`) whose item
    has no end yet, and `retried` (indexes of failed Pods still held) whose item has none either.
    An index the Job counts whose Pod is gone stays here until the Job ends (ITEM_RESULT_LOST).

    Raises:
        LabelMismatch: the Job's item indexes are unreadable (`workers.indexed.item_indexes`).
    """
    indexes = item_indexes(job)
    status = job.get("status") or {}
    counted = parse_intervals(status.get("completedIndexes")) | parse_intervals(status.get("failedIndexes"))
    wanted = set()
    for index in counted | set(retried):
        item = item_of(indexes, index)
        if item is not None and 0 <= item < items and item not in ended:
            wanted.add(index)
    return sorted(wanted)


def retried_count(job: Mapping[str, Any]) -> int:
    """How many failed Pods of a map's Job the controller let go of other than the last of each
    index it gave up (pure): its `failed` counter (with the failures not counted yet) less its
    `failedIndexes`. The controller lets a failed Pod go once its index runs again (per-index
    backoff keeps it until its replacement exists), so this grows exactly when an index was
    retried: only then does a hand-off look for held failed Pods. A Pod failed by a disruption
    that a podFailurePolicy `Ignore` rule does not count is freed when its index ends instead."""
    status = job.get("status") or {}
    uncounted = (status.get("uncountedTerminatedPods") or {}).get("failed") or []
    failed = status.get("failed")
    counted = failed if isinstance(failed, int) and not isinstance(failed, bool) else 0
    return max(0, counted + len(uncounted) - len(parse_intervals(status.get("failedIndexes"))))


def _deliver(rt: Runtime, namespace: str, job: Mapping[str, Any], context: DeliveryContext | None) -> str:
    if context is None:
        return REFUSED
    dispatch_id, name = context.dispatch_id, context.job_name
    uid = (job.get("metadata") or {}).get("uid")
    if context.record.terminal:  # ended already (cancelled, or delivered by another): clean up
        release_pods(rt, namespace, pods_by_job(rt, namespace, [name])[name])
        release_job(rt, namespace, name, snapshot=job)
        return ALREADY_TERMINAL
    finished = job_state(job).terminal
    if not finished:
        # This change is being delivered: the next one is handed off again at once (poll's
        # marker is per Job, and would hold every change of a running map back for its TTL).
        try:
            rt.redis.delete(handoff.key(rt.settings.key_prefix, namespace, job))
        except redis.RedisError as e:  # the marker expires by itself: only later
            log.info("the hand-off marker of %s/%s stays (%s)", namespace, context.job_name, e)
    claim = rt.guard.claim_many([dispatch_id]).get(dispatch_id)
    if claim is None:
        return CLAIMED_ELSEWHERE
    try:
        indexes = item_indexes(job)
        with transaction(rt.sessions) as session:
            shape = maps.map_shapes(session, [dispatch_id])[dispatch_id]
            ended = maps.ended_items(session, dispatch_id)
        ours = [p for p in _pods_to_read(rt, namespace, job, ended, shape.items) if controller_uids(p) <= {uid}]
        with transaction(rt.sessions) as session:
            decided = decide(dispatch_id, job, ours, ended, shape.items)
            terminal.record_items(session, decided.ends)
            now_ended = {**ended, **{e.item_index: e.type.value for e in decided.ends}}
            won: set[str] = set()
            event, row = None, None
            if finished:
                terminal.record_items(session, open_item_ends(dispatch_id, job, shape, now_ended))
                event = map_event(dispatch_id, job, shape, maps.item_counts(session, dispatch_id))
                won = terminal.record(session, [event])
                row = dispatches.get_dispatch(session, dispatch_id)
        if event is not None and won:
            assert row is not None
            terminal.announce(rt, [(row, event)])
        free = [
            p
            for p in ours
            if finished
            or (item_of(indexes, pod_index(p)) in now_ended and _phase(p) in ("Succeeded", "Failed"))
            or p in decided.retried
        ]
        release_pods(rt, namespace, free)
        if not finished:
            _note_retries_read(rt, namespace, job)
            return RUNNING
        release_job(rt, namespace, name, snapshot=job)
        _forget_retries(rt, namespace, job)
        return COMPLETED if won else ALREADY_TERMINAL
    finally:
        rt.guard.release_many([claim])


# Completion indexes per `job-completion-index in (...)` Pod selector: 250 of up to 6
# characters make ~1.7 KB, as `cleanup.SELECTOR_CHUNK` keeps a selector of Job names small.
INDEX_CHUNK = 250
_RETRIES_TTL_S = 86_400  # a lost note costs one LIST of failed Pods, nothing more
_FAILED_PODS = "status.phase=Failed"


def _pods_to_read(
    rt: Runtime, namespace: str, job: Mapping[str, Any], ended: Mapping[int, str], items: int
) -> list[dict[str, Any]]:
    """The Pods a hand-off needs. A Job that ended: all of them (one paginated LIST: every open
    item ends now, and no Pod may stay held). A running one: the failed Pods still held, if an
    index was retried since the last look (`retried_count` above the note in Redis), then the
    Pods of `indexes_to_read` by their completion index label."""
    name = str((job.get("metadata") or {}).get("name", ""))
    if job_state(job).terminal:
        return pods_by_job(rt, namespace, [name])[name]
    selector = f"{JOB_NAME_LABEL}={name}"
    held: list[dict[str, Any]] = []
    if retried_count(job) > _retries_read(rt, namespace, job):
        held = [
            pod
            for page in rt.kube.iter_pods(namespace, label_selector=selector, field_selector=_FAILED_PODS)
            for pod in page
            if FINALIZER in ((pod.get("metadata") or {}).get("finalizers") or [])
        ]
    indexes = item_indexes(job)
    retried = {i for i in (pod_index(p) for p in held) if i is not None}
    to_read = indexes_to_read(job, ended, items, retried=retried)
    pods = [p for p in held if item_of(indexes, pod_index(p)) in ended]  # their item ended: freed now
    for start in range(0, len(to_read), INDEX_CHUNK):
        values = ",".join(str(index) for index in to_read[start : start + INDEX_CHUNK])
        chunk = f"{selector},{COMPLETION_INDEX} in ({values})"
        pods += [pod for page in rt.kube.iter_pods(namespace, label_selector=chunk) for pod in page]
    return pods


def _retries_key(rt: Runtime, namespace: str, job: Mapping[str, Any]) -> str:
    metadata = job.get("metadata") or {}
    return f"{rt.settings.key_prefix}:map-retries:{namespace}/{metadata.get('name')}/{metadata.get('uid')}"


def _retries_read(rt: Runtime, namespace: str, job: Mapping[str, Any]) -> int:
    """The `retried_count` a hand-off of this Job last freed the retried Pods of (0: none noted,
    or Redis unavailable: the failed Pods are read again, which is only a LIST more)."""
    try:
        text = rt.redis.get(_retries_key(rt, namespace, job))
        return int(text) if text is not None else 0
    except (redis.RedisError, ValueError) as e:
        log.info("the retried Pods read of %s are not known (%s); reading them", _retries_key(rt, namespace, job), e)
        return 0


def _note_retries_read(rt: Runtime, namespace: str, job: Mapping[str, Any]) -> None:
    """Once this hand-off freed what it read: its Job's `retried_count` is read (if it is new)."""
    count = retried_count(job)
    if count <= 0:
        return
    try:
        rt.redis.set(_retries_key(rt, namespace, job), str(count), ex=_RETRIES_TTL_S)
    except redis.RedisError as e:
        log.info("the retried Pods read of %s are not noted (%s)", _retries_key(rt, namespace, job), e)


def _forget_retries(rt: Runtime, namespace: str, job: Mapping[str, Any]) -> None:
    if retried_count(job) <= 0:
        return
    try:
        rt.redis.delete(_retries_key(rt, namespace, job))
    except redis.RedisError as e:  # it expires by itself
        log.info("the note %s stays (%s)", _retries_key(rt, namespace, job), e)
