"""Deliver a map's items as their Pods finish, and the map itself when its Indexed Job ends.

A map's Job is handed to the completion path while it runs, not only once it has finished
(`delivery.jobwatch` keeps it among the Jobs to hand off), and `complete.complete_jobs` passes it
here; poll hands a running map off at every poll too, whether its Job changed or not. Per
hand-off of a running map, only the Pods that can change something are read: the succeeded Pods
we have not freed (`_fresh_successes`: one LIST by phase and by the label our release puts on a
Pod, so an item is recorded as its Pod ends, not once the Job controller counts it), those of the
indexes the Job's status counts completed or failed whose item has no end yet (`indexes_to_read`,
pure), selected by the Pod label `batch.kubernetes.io/job-completion-index` (`in`, chunked), and
those of indexes with a failed Pod the controller let go of since the last look (`retried_count`,
a counter kept in Redis: a Job change that retried nothing reads no failed Pod). So a map of n
items costs each item's Pods about once, not n Pods per change. The database is asked only about
the items such Pods may end (`store.maps.ended_items(among=...)`): those that a note in Redis
(`_Notes`, per Job) does not say ended already; each hand-off notes the items it saw ended. So a
hand-off of k newly finished indexes reads about k rows, not the map's. Each Pod's
item is decided (`decide`, pure): a succeeded Pod's result, or the failure of an index the Job
controller gave up on (`failedIndexes`); the ends are written in one transaction through
`terminal.record_items` (the primary key on (dispatch, item) is the arbiter); then the Pods whose
item is recorded, or whose index was retried, are freed of our finalizer. Once the Job has ended,
all its Pods are read once: the items still open end with the Job's reason, the map's own
terminal event is written in the same transaction, saying how many items succeeded and failed and
why the map passed or failed, every Pod still held is freed, and the Job is released, as any
delivered Job is. Pods are freed RELEASE_CONCURRENCY PATCHes at a time (`_release`).

Each hand-off holds the dispatch's guard claim while it decides and records. A running map's
lets it go before it frees its Pods, so the next look records the next items at once (it reads
other Pods: those of items not ended), once it has registered the items it frees among the map's
frees in flight (`_Freeing`, while it still holds the claim). An ended map's hand-off, and its
clean-up, keep the claim to their last release, renewed across a long one (`_Lease`), and leave
the Pods of items in flight to the looks freeing them. So no two looks free the same Pod; a look
that dies while it frees leaves its entry to expire, and its Pods to the Job's end or, once the
map has ended, to the sweep's pass over Pods.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import redis

from k8s_dispatch.core.errors import GuardUnavailable, Transient
from k8s_dispatch.delivery import handoff, terminal
from k8s_dispatch.delivery.cleanup import JOB_NAME_LABEL, controller_uids, pods_by_job, release_job, release_pods
from k8s_dispatch.delivery.guard import Claim
from k8s_dispatch.delivery.reconstruct import DeliveryContext
from k8s_dispatch.delivery.records import contexts_of
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.store import dispatches, maps
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import EventType, ItemEventType
from k8s_dispatch.workers import failure_detail
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.indexed import (
    COMPLETION_INDEX,
    failure_count,
    format_intervals,
    item_indexes,
    item_of,
    parse_intervals,
    pod_index,
    status_indexes,
)
from k8s_dispatch.workers.job_status import job_state, parse_result, pick_termination
from k8s_dispatch.workers.kube import REQUESTS_PER_THREAD
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
    dispatch_id: str, job: Mapping[str, Any], pods: Sequence[Mapping[str, Any]], ended: Collection[int], items: int
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
    dispatch_id: str, job: Mapping[str, Any], shape: maps.MapShape, ended: Collection[int]
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
    job: Mapping[str, Any], ended: Collection[int], items: int, *, retried: Iterable[int] = ()
) -> list[int]:
    """The completion indexes whose Pods a running map's hand-off reads, ascending (pure): those
    the Job's status counts completed or failed (`completedIndexes`, `failedIndexes`) whose item
    has no end yet, and `retried` (indexes of failed Pods still held) whose item has none either.
    An index the Job counts whose Pod is gone stays here until the Job ends (ITEM_RESULT_LOST).

    Raises:
        LabelMismatch: the Job's item indexes are unreadable (`workers.indexed.item_indexes`).
    """
    indexes = item_indexes(job)
    return sorted(i for i in _counted(job) | set(retried) if _open(item_of(indexes, i), items, ended))


def _counted(job: Mapping[str, Any]) -> set[int]:
    """The completion indexes the Job's status counts completed or failed (pure)."""
    status = job.get("status") or {}
    return parse_intervals(status.get("completedIndexes")) | parse_intervals(status.get("failedIndexes"))


def _open(item: int | None, items: int, ended: Collection[int] = ()) -> bool:
    """Whether `item` is one of the map's `items` with no end among `ended`."""
    return item is not None and 0 <= item < items and item not in ended


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
    finished = job_state(job).terminal
    if not finished and not context.record.terminal:
        # This change is being delivered: the next one is handed off again at once (poll's
        # marker is per Job, and would hold every change of a running map back for its TTL).
        _hand_off_again(rt, namespace, job)
    claim = rt.guard.claim_many([dispatch_id]).get(dispatch_id)
    if claim is None:
        if finished or context.record.terminal:
            # The holder may be a look of a moment ago, still freeing Pods: this one is handed
            # off again at the next poll, not once the marker's TTL is over.
            _hand_off_again(rt, namespace, job)
        return CLAIMED_ELSEWHERE
    lease = _Lease(rt, claim)
    try:
        # Read under the claim, before any Pod is listed: no look starts freeing while it is held.
        busy = _Freeing.in_flight(rt, dispatch_id)
        if context.record.terminal:  # ended already (cancelled, or delivered by another): clean up
            pods = pods_by_job(rt, namespace, [name])[name]
            if not _release(rt, namespace, _not_busy(job, pods, busy), lease.kept):
                return CLAIMED_ELSEWHERE
            release_job(rt, namespace, name, snapshot=job)
            return ALREADY_TERMINAL
        indexes = item_indexes(job)
        notes = _Notes() if finished else _Notes.read(rt, namespace, job)
        held = [] if finished else _held_failed_pods(rt, namespace, job, notes)
        fresh = [] if finished else _fresh_successes(rt, namespace, job)
        with transaction(rt.sessions) as session:
            shape = maps.map_shapes(session, [dispatch_id])[dispatch_id]
            if finished:  # every open item ends now: the whole map's ends are wanted
                ended: set[int] = set(maps.ended_items(session, dispatch_id))
            else:  # only the items this hand-off may end, less those noted ended already
                seen = {i for i in (pod_index(p) for p in held + fresh) if i is not None}
                asked = {item_of(indexes, i) for i in _counted(job) | seen}
                among = {i for i in asked if i is not None and _open(i, shape.items, notes.ended)}
                ended = set(notes.ended) | set(maps.ended_items(session, dispatch_id, among=among))
        read = _pods_to_read(
            rt, namespace, job, ended, shape.items, held=_not_busy(job, held, busy), fresh=_not_busy(job, fresh, busy)
        )
        ours = [p for p in read if controller_uids(p) <= {uid}]
        with transaction(rt.sessions) as session:
            decided = decide(dispatch_id, job, ours, ended, shape.items)
            terminal.record_items(session, decided.ends)
            now_ended = ended | {e.item_index for e in decided.ends}
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
        if not finished:
            # A retried Pod of an item still open may be read by the next look: freed under the claim.
            still_open = [p for p in free if item_of(indexes, pod_index(p)) not in now_ended]
            if not _release(rt, namespace, still_open, lease.kept):
                return CLAIMED_ELSEWHERE
            # Its ends are recorded: the next look may decide the next items while this one frees
            # the Pods of these (other Pods: a look reads only those of items not ended).
            after = [p for p in free if p not in still_open]
            freeing = _Freeing(rt, dispatch_id, {item_of(indexes, pod_index(p)) for p in after})
            freeing.begin()  # while the claim is held: the looks that follow see it
            rt.guard.release_many([lease.claim])
            try:
                _release(rt, namespace, after, freeing.kept)
            finally:
                freeing.end()
            notes.write(rt, namespace, job, ended=now_ended)
            return RUNNING
        if not _release(rt, namespace, _not_busy(job, free, busy), lease.kept):
            return CLAIMED_ELSEWHERE  # the claim's new holder frees the rest
        release_job(rt, namespace, name, snapshot=job)
        _Notes.forget(rt, namespace, job)
        return COMPLETED if won else ALREADY_TERMINAL
    finally:
        rt.guard.release_many([lease.claim])


def _hand_off_again(rt: Runtime, namespace: str, job: Mapping[str, Any]) -> None:
    """Delete poll's hand-off marker of the Job: its next poll hands the Job off again."""
    try:
        rt.redis.delete(handoff.key(rt.settings.key_prefix, namespace, job))
    except redis.RedisError as e:  # the marker expires by itself: only later
        log.info("the hand-off marker of %s/%s stays (%s)", namespace, (job.get("metadata") or {}).get("name"), e)


# Pods freed between two looks at the claim's (or the registered frees') age (`_release`).
RELEASE_CHUNK = 50
# Pod PATCHes one hand-off has in flight: each is a write the API server commits, tens of
# milliseconds on a busy control plane; the connection pool holds REQUESTS_PER_THREAD per thread.
RELEASE_CONCURRENCY = REQUESTS_PER_THREAD


def _renew_at_s(rt: Runtime) -> float:
    """How old a claim or a registered free gets before it is renewed: a third of the lease."""
    return rt.settings.guard_lease_ms / 3000


class _Lease:
    """A map's guard claim while its hand-off works. A map's end may free thousands of Pods, one
    PATCH each, for longer than the claim's lease: then another hand-off (poll hands a finished
    Job off again every marker TTL) or the sweep would take the claim, list the same Pods and
    PATCH each again (each answered 422: the finalizer moved under it). So, once a third of the
    lease has passed, the claim is renewed (`Guard.renew`, only while it is still ours); lost,
    the work stops and the claim's new holder does the rest."""

    def __init__(self, rt: Runtime, claim: Claim) -> None:
        self.rt, self.claim = rt, claim
        self._taken = time.monotonic()

    def kept(self) -> bool:
        """Whether the claim is still ours, renewed if it was old."""
        if time.monotonic() - self._taken < _renew_at_s(self.rt):
            return True
        if not self.rt.guard.renew(self.claim):
            log.info("the claim on map %s passed to another hand-off while it freed Pods", self.claim.dispatch_id)
            return False
        self._taken = time.monotonic()
        return True


# A map's frees in flight: a sorted set of "token:items" scored by when each expires, on Redis's
# own clock (hosts' clocks need not agree). ARGV: 'begin' | 'renew' | 'list', the member, the lease (ms).
_FREEING = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if ARGV[1] == 'list' then
    return redis.call('ZRANGE', KEYS[1], 0, -1)
end
if ARGV[1] == 'renew' and not redis.call('ZSCORE', KEYS[1], ARGV[2]) then
    return 0
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""


class _Freeing:
    """One running look's frees of its items' Pods, done after it let the map's claim go.
    Registered with those items while the claim is still held, so every look after it (which
    reads the entries under the claim, before it lists a Pod) leaves their Pods to it: no Pod is
    PATCHed by two. An entry lives a guard lease, renewed while the frees go on; a look that dies
    mid-way blocks nothing for longer, and the Pods it left are freed by a later look of the map
    (a held failed Pod), its end, or, once the map has ended, the sweep's pass over Pods."""

    def __init__(self, rt: Runtime, dispatch_id: str, items: Iterable[int | None]) -> None:
        self.rt, self.dispatch_id = rt, dispatch_id
        self.member = f"{uuid.uuid4().hex}:{format_intervals(sorted(i for i in set(items) if i is not None))}"
        self._since = time.monotonic()

    @staticmethod
    def _call(rt: Runtime, dispatch_id: str, mode: str, member: str = "") -> Any:
        key = f"{rt.settings.key_prefix}:map-freeing:{dispatch_id}"
        try:
            return rt.redis.register_script(_FREEING)(keys=[key], args=[mode, member, rt.settings.guard_lease_ms])
        except redis.RedisError as e:
            raise GuardUnavailable(f"{mode} the frees in flight of map {dispatch_id}: {e}") from e

    @classmethod
    def in_flight(cls, rt: Runtime, dispatch_id: str) -> frozenset[int]:
        """The items whose Pods running looks of the map are freeing now.

        Raises:
            GuardUnavailable: Redis cannot be reached.
        """
        members = cls._call(rt, dispatch_id, "list") or []
        return frozenset(i for m in members for i in parse_intervals((_text(m) or "").partition(":")[2]))

    def begin(self) -> None:
        """Register these frees (with the map's claim held).

        Raises:
            GuardUnavailable: Redis cannot be reached: nothing is freed; the Job's end frees them.
        """
        self._call(self.rt, self.dispatch_id, "begin", self.member)
        self._since = time.monotonic()

    def kept(self) -> bool:
        """Whether these frees are still registered, renewed if old; False once the entry expired
        (the look stalled for a lease): another look may be freeing the same Pods."""
        if time.monotonic() - self._since < _renew_at_s(self.rt):
            return True
        if not self._call(self.rt, self.dispatch_id, "renew", self.member):
            log.info("the frees of map %s outlived their entry; later looks free the rest", self.dispatch_id)
            return False
        self._since = time.monotonic()
        return True

    def end(self) -> None:
        """These frees are over (or stopped)."""
        key = f"{self.rt.settings.key_prefix}:map-freeing:{self.dispatch_id}"
        try:
            self.rt.redis.zrem(key, self.member)
        except redis.RedisError as e:  # the entry expires by itself
            log.info("the frees in flight of map %s stay registered until they expire (%s)", self.dispatch_id, e)


def _not_busy(job: Mapping[str, Any], pods: Sequence[dict[str, Any]], busy: Collection[int]) -> list[dict[str, Any]]:
    """The Pods whose item no other look is freeing now (`_Freeing.in_flight`)."""
    if not busy:
        return list(pods)
    indexes = item_indexes(job)
    return [p for p in pods if item_of(indexes, pod_index(p)) not in busy]


def _release(rt: Runtime, namespace: str, pods: Sequence[Mapping[str, Any]], kept: Callable[[], bool]) -> bool:
    """Free the Pods (`cleanup.release_pods`) RELEASE_CONCURRENCY PATCHes at a time, a chunk of
    RELEASE_CHUNK at a time while `kept()` says the right to is still ours; False if it passed
    first. The first failure is raised once the chunk's other PATCHes have ended."""
    pods = [p for p in pods if FINALIZER in ((p.get("metadata") or {}).get("finalizers") or [])]
    if not pods:
        return True
    with ThreadPoolExecutor(max_workers=min(RELEASE_CONCURRENCY, len(pods)), thread_name_prefix="map-release") as pool:
        for start in range(0, len(pods), RELEASE_CHUNK):
            if not kept():
                return False
            chunk = pods[start : start + RELEASE_CHUNK]
            slices = [chunk[i::RELEASE_CONCURRENCY] for i in range(min(RELEASE_CONCURRENCY, len(chunk)))]
            for future in [pool.submit(release_pods, rt, namespace, part) for part in slices]:
                future.result()
    return True


# Completion indexes per `job-completion-index in (...)` Pod selector: 250 of up to 6
# characters make ~1.7 KB, as `cleanup.SELECTOR_CHUNK` keeps a selector of Job names small.
INDEX_CHUNK = 250
_NOTES_TTL_S = 86_400  # a lost note costs one LIST of failed Pods, or some rows, nothing more
_FAILED_PODS = "status.phase=Failed"
_SUCCEEDED_PODS = "status.phase=Succeeded"


def _fresh_successes(rt: Runtime, namespace: str, job: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A running map's succeeded Pods that we have not freed (no `RELEASED_LABEL`), whatever the
    Job's status counts. The Job controller counts a finished index only at its next sync,
    seconds later on a busy control plane; a succeeded Pod's result is final once it has
    succeeded, so its item is decided from the Pod as soon as a look sees it."""
    return _held_pods(rt, namespace, job, field_selector=_SUCCEEDED_PODS, label=f"!{job_labels.RELEASED_LABEL}")


def _held_failed_pods(rt: Runtime, namespace: str, job: Mapping[str, Any], notes: _Notes) -> list[dict[str, Any]]:
    """A running map's failed Pods still held, if an index was retried since the last look
    (`retried_count` above the one noted); none otherwise, with no request."""
    if retried_count(job) <= notes.retries_read:
        return []
    return _held_pods(rt, namespace, job, field_selector=_FAILED_PODS)


def _held_pods(
    rt: Runtime, namespace: str, job: Mapping[str, Any], *, field_selector: str, label: str = ""
) -> list[dict[str, Any]]:
    """The Job's Pods of one phase (and `label`, a selector term) that hold our finalizer: one LIST."""
    selector = f"{JOB_NAME_LABEL}={(job.get('metadata') or {}).get('name', '')}" + (f",{label}" if label else "")
    return [
        pod
        for page in rt.kube.iter_pods(namespace, label_selector=selector, field_selector=field_selector)
        for pod in page
        if FINALIZER in ((pod.get("metadata") or {}).get("finalizers") or [])
    ]


def _pods_to_read(
    rt: Runtime,
    namespace: str,
    job: Mapping[str, Any],
    ended: Collection[int],
    items: int,
    *,
    held: Sequence[dict[str, Any]] = (),
    fresh: Sequence[dict[str, Any]] = (),
) -> list[dict[str, Any]]:
    """The Pods a hand-off needs. A Job that ended: all of them (one paginated LIST: every open
    item ends now, and no Pod may stay held). A running one: the `held` failed Pods
    (`_held_failed_pods`) whose item has ended (a look that died before it freed them left them)
    or has a `fresh` succeeded Pod (`_fresh_successes`: its retry succeeded), those, then the
    Pods of the other `indexes_to_read` by their completion index label."""
    name = str((job.get("metadata") or {}).get("name", ""))
    if job_state(job).terminal:
        return pods_by_job(rt, namespace, [name])[name]
    selector = f"{JOB_NAME_LABEL}={name}"
    indexes = item_indexes(job)
    retried = {i for i in (pod_index(p) for p in held) if i is not None}
    known = {pod_index(p) for p in fresh}  # indexes read already: no LIST of their own
    to_read = [i for i in indexes_to_read(job, ended, items, retried=retried) if i not in known]
    # Failed Pods whose item ended, or ends now from its retry's fresh success: freed now.
    pods = [p for p in held if item_of(indexes, pod_index(p)) in ended or pod_index(p) in known]
    pods += fresh
    for start in range(0, len(to_read), INDEX_CHUNK):
        values = ",".join(str(index) for index in to_read[start : start + INDEX_CHUNK])
        chunk = f"{selector},{COMPLETION_INDEX} in ({values})"
        pods += [pod for page in rt.kube.iter_pods(namespace, label_selector=chunk) for pod in page]
    return pods


_NOTE_KINDS = ("map-retries", "map-ended")


def _key(rt: Runtime, kind: str, namespace: str, job: Mapping[str, Any]) -> str:
    metadata = job.get("metadata") or {}
    return f"{rt.settings.key_prefix}:{kind}:{namespace}/{metadata.get('name')}/{metadata.get('uid')}"


@dataclass(frozen=True)
class _Notes:
    """What the hand-offs of one running map Job noted in Redis (both read with one MGET, per
    Job uid): the `retried_count` whose retried Pods were freed (`map-retries`), and the items
    seen ended (`map-ended`, in the interval format). Each only spares reads: a note lost, or
    Redis unavailable, costs one LIST of failed Pods or the items' rows, nothing more. An item
    noted ended has its end committed, and ends are never taken back."""

    retries_read: int = 0
    ended: frozenset[int] = frozenset()

    @classmethod
    def read(cls, rt: Runtime, namespace: str, job: Mapping[str, Any]) -> _Notes:
        keys = [_key(rt, kind, namespace, job) for kind in _NOTE_KINDS]
        try:
            retries, ended = rt.redis.mget(keys)
            return cls(int(retries) if retries is not None else 0, frozenset(parse_intervals(_text(ended))))
        except (redis.RedisError, ValueError) as e:
            log.info("the hand-off notes %s are not known (%s); reading without them", keys, e)
            return cls()

    def write(self, rt: Runtime, namespace: str, job: Mapping[str, Any], *, ended: Collection[int]) -> None:
        """Once this hand-off freed what it read: the Job's `retried_count`, and the items seen
        ended (counted by the Job or not yet), where they grew."""
        seen = set(ended)
        pipe = rt.redis.pipeline(transaction=False)
        if retried_count(job) > self.retries_read:
            pipe.set(_key(rt, "map-retries", namespace, job), str(retried_count(job)), ex=_NOTES_TTL_S)
        if not seen <= self.ended:
            pipe.set(_key(rt, "map-ended", namespace, job), format_intervals(sorted(seen)), ex=_NOTES_TTL_S)
        try:
            pipe.execute()
        except redis.RedisError as e:
            log.info("the hand-off notes of %s are not written (%s)", _key(rt, "map-*", namespace, job), e)

    @staticmethod
    def forget(rt: Runtime, namespace: str, job: Mapping[str, Any]) -> None:
        try:
            rt.redis.delete(*(_key(rt, kind, namespace, job) for kind in _NOTE_KINDS))
        except redis.RedisError as e:  # they expire by themselves
            log.info("the hand-off notes of %s stay (%s)", _key(rt, "map-*", namespace, job), e)


def _text(value: object) -> str | None:
    if isinstance(value, bytes):
        return value.decode("ascii", "replace")
    return value if isinstance(value, str) else None
