"""Complete finished Jobs: the one completion path, for poll's batches and the sweep alike.

Completions come in batches of Jobs as poll's LIST read them: per Job, one patch of its Pod
and one of the Job (our finalizer off each, the delivered label on the Job); per batch, one Pod
LIST, one transaction for the terminal events (`delivery.terminal`), a Redis round trip for the
guard's claims and one bulk delete (for poll's batches, one per poll interval). A Job that
succeeded but whose Pod (and result) is gone is run again, never failed. A failure keeps why
(exit code, signal, reasons, log tail, Warning Events: `workers.failure_detail`), read only for
failed Jobs; the disruptions a batch's Pods show are recorded first (`delivery.disruptions`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from sqlalchemy.exc import DBAPIError

from k8s_dispatch import artifacts
from k8s_dispatch.artifacts import logs
from k8s_dispatch.artifacts.errors import ObjectStoreUnavailable
from k8s_dispatch.core.errors import (
    DispatchError,
    InvalidInput,
    NotFound,
    Permanent,
    Transient,
)
from k8s_dispatch.core.payloads import canonical_json
from k8s_dispatch.delivery import disruptions, items, stats, terminal
from k8s_dispatch.delivery.attempts import JOB_LOST_REASON, out_of_attempts
from k8s_dispatch.delivery.cleanup import (
    controller_uids,
    delete_delivered,
    pods_by_job,
    release_job,
    release_pods,
)
from k8s_dispatch.delivery.crashpoints import Point, crashpoint
from k8s_dispatch.delivery.create import Rerun, create_jobs_for
from k8s_dispatch.delivery.guard import Claim
from k8s_dispatch.delivery.metrics import METRICS
from k8s_dispatch.delivery.reconstruct import DeliveryContext, DispatchRecord
from k8s_dispatch.delivery.records import contexts_of, load_records
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.store import dispatches
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import EventType
from k8s_dispatch.workers import failure_detail
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.indexed import is_map_job
from k8s_dispatch.workers.job_status import RESULT_NOT_JSON, Completion, completion, job_state
from k8s_dispatch.workers.kube import REQUESTS_PER_THREAD
from k8s_dispatch.workers.manifest import CONTAINER_NAME

log = logging.getLogger(__name__)

# A batch's releases (a Job's Pods, then the Job: one or two patches each) run this many Jobs at
# a time: each patch is a write the API server commits to etcd, tens of milliseconds on a busy
# control plane, which one after the other would add up for every batch.
RELEASE_CONCURRENCY = REQUESTS_PER_THREAD


class CompleteOutcome(StrEnum):
    COMPLETED = "completed"  # this call wrote the terminal event
    ALREADY_TERMINAL = "already_terminal"  # recorded before or by a racing writer; cleaned up
    RUNNING = "running"  # the Job has not finished
    CLAIMED_ELSEWHERE = "claimed_elsewhere"  # another replica holds the guard for it
    REFUSED = "refused"  # labels unreadable or disagreeing with the DB: never delivered
    GONE = "gone"  # no such Job
    RERUN = "rerun"  # it succeeded but its result went with its Pod: deleted, created again (next attempt)


def complete_job(
    rt: Runtime, namespace: str, name: str, *, snapshot: Mapping[str, Any] | None = None, delete: bool = True
) -> CompleteOutcome:
    """Deliver one finished Job's result: `complete_jobs` for the Job as `snapshot` shows it,
    or else as a GET reads it now. The path of single calls and of the sweep.

    Raises:
        Transient: the API, database or Redis is unavailable; the same call may be retried.
    """
    if snapshot is None:
        try:
            snapshot = rt.kube.get_job(namespace, name)
        except NotFound:
            return CompleteOutcome.GONE
    done = complete_jobs(rt, namespace, [snapshot], delete=delete)
    if done.error is not None:
        raise done.error
    return done.outcomes[0]


@dataclass(frozen=True)
class Completed:
    """What `complete_jobs` did: an outcome per Job dealt with (in order), and the Jobs left
    because a Transient error stopped the batch (`error`), to be tried again."""

    outcomes: list[CompleteOutcome]
    unavailable: list[Mapping[str, Any]] = field(default_factory=list)
    error: Transient | None = None

    @property
    def released(self) -> bool:
        """Whether a Job was released (labelled delivered): a bulk delete has something to remove."""
        return any(o in (CompleteOutcome.COMPLETED, CompleteOutcome.ALREADY_TERMINAL) for o in self.outcomes)


def complete_jobs(rt: Runtime, namespace: str, jobs: Sequence[Mapping[str, Any]], *, delete: bool = True) -> Completed:
    """Deliver finished Jobs of one namespace as a LIST (or a GET) read them: the one completion path.

    A LIST's snapshot is as good as a fresh read here: a finished Job's status is final
    (Complete and Failed never revert, a deletion is never undone), and the clean-up patch
    `test`s the snapshot's uid, so a Job re-created under the same name since is never
    touched. The batch is delivered in steps, each one round trip for all its Jobs where it
    can be (`_Batch`): their rows read, their guards claimed, their Pods listed, their terminal
    events written in ONE transaction, then one patch per Job. A Transient error stops the
    batch: the Jobs not yet dealt with are returned as `unavailable`, to be tried again. With
    `delete`, ONE bulk delete (deletecollection) then removes every delivered Job of the
    namespace; a caller that makes many calls passes False and calls `delete_delivered` once.
    A bulk delete that fails is only logged: the next one, or the sweep's, removes those Jobs.
    """
    # Map dispatches' Indexed Jobs, running or finished: item by item (`delivery.items`).
    mapped = items.deliver_maps(rt, namespace, [job for job in jobs if is_map_job(job)])
    outcomes = [CompleteOutcome(o) for o in mapped.outcomes]
    jobs = [job for job in jobs if not is_map_job(job)]
    batch = _Batch(rt, namespace, jobs if mapped.error is None else [])
    try:
        batch.deliver()
    except Transient as e:
        left = len(jobs) - len(batch.outcomes)
        log.warning("completing jobs in %s stopped (%s); %d left to retry", namespace, e, left)
        done = Completed(outcomes + batch.outcomes, unavailable=list(jobs[len(batch.outcomes) :]), error=e)
    else:
        done = Completed(outcomes + batch.outcomes)
    if mapped.error is not None:
        done = Completed(outcomes, unavailable=[*mapped.unavailable, *jobs], error=mapped.error)
    if delete and done.released:
        try:
            delete_delivered(rt, namespace)
        except Transient as e:
            log.warning("bulk delete of delivered jobs in %s failed (%s); the next one removes them", namespace, e)
    return done


@dataclass
class _Item:
    """One Job of a batch on its way through the steps: what was read of it, then what was decided."""

    job: Mapping[str, Any]
    context: DeliveryContext | None  # None: never delivered (`first_look` says REFUSED)
    outcome: CompleteOutcome | None = None  # None until a step settles it
    event: dispatches.TerminalEvent | None = None  # the terminal event `_record` writes
    lost: bool = False  # succeeded, but its result went with its Pods: `_rerun` runs it again

    @property
    def delivered(self) -> DeliveryContext:
        assert self.context is not None  # only items `first_look` let through reach the steps
        return self.context

    @property
    def dispatch_id(self) -> str:
        return self.delivered.dispatch_id

    @property
    def record(self) -> DispatchRecord:
        return self.delivered.record

    @property
    def job_name(self) -> str:
        return self.delivered.job_name

    @property
    def namespace(self) -> str:
        return self.delivered.namespace

    @property
    def attempt(self) -> int:
        return self.delivered.attempt

    @property
    def released(self) -> bool:
        """Whether the Job is released (finalizers off, labelled delivered) at the end of the batch."""
        return self.context is not None and self.outcome in _RELEASED

    def won(self, won: set[str]) -> bool:
        return self.event is not None and self.event.dispatch_id in won


_RELEASED = (CompleteOutcome.COMPLETED, CompleteOutcome.ALREADY_TERMINAL)


def first_look(job: Mapping[str, Any], context: DeliveryContext | None) -> CompleteOutcome | None:
    """What a Job of the batch comes to before any side effect (pure); None: claim and complete it."""
    if context is None:
        return CompleteOutcome.REFUSED
    if context.record.terminal:
        return CompleteOutcome.ALREADY_TERMINAL
    if not job_state(job).terminal:
        return CompleteOutcome.RUNNING
    return None


class _Batch:
    """One `complete_jobs` call: each Job of the batch is one `_Item` that flows through the steps,
    each step run for every Job before the next, so the batch costs a few round trips to
    PostgreSQL and Redis in all, and one patch per Job (a few Jobs' at a time); the crash points
    fire once per batch. Per Job: its context rebuilt from its labels and the DB (refusing any
    disagreement: `first_look`), the guard claimed, its completion read from its Pods and
    decided (`_decide`), the terminal events written in ONE transaction (`_record`), the engine
    told of those this call won, a lost result run again (`_rerun`), then the Job released
    (`_release`). `outcomes` grows, in the Jobs' order, as each Job's release is done."""

    def __init__(self, rt: Runtime, namespace: str, jobs: Sequence[Mapping[str, Any]]) -> None:
        self.rt, self.jobs = rt, jobs
        self.outcomes: list[CompleteOutcome] = []
        self._pods = _PodsOf(rt, namespace, [_name(job) for job in jobs if job_state(job).terminal])
        self._namespace = namespace
        self._events: list[dict[str, Any]] | None = None  # the namespace's Warning Events, read on need

    def deliver(self) -> None:
        rt = self.rt
        items = [
            _Item(job, context, first_look(job, context))
            for job, context in zip(self.jobs, contexts_of(rt, self.jobs), strict=True)
        ]
        wanted = [item.dispatch_id for item in items if item.outcome is None]
        claims = rt.guard.claim_many(wanted) if wanted else {}
        try:
            self._decide(items, claims)
            won = self._record(items)
            if won:
                terminal.announce(rt, [(item.record, item.event) for item in items if item.event and item.won(won)])
            self._rerun(items)
            self._release(items)
        finally:
            rt.guard.release_many([c for c in claims.values() if c is not None])

    def _decide(self, items: Sequence[_Item], claims: Mapping[str, Claim | None]) -> None:
        """Settle what each claimed Job comes to before anything is written: the event to record
        (`event`), a lost result to run again (`lost`), or an outcome now. A Job listed twice in
        the batch is delivered by its first entry."""
        first: dict[str, _Item] = {}  # the entry that delivers each dispatch of the batch
        repeats: list[_Item] = []
        for item in items:
            if item.outcome is not None:
                continue
            if item.dispatch_id in first:
                repeats.append(item)
                continue
            if claims.get(item.dispatch_id) is None:
                item.outcome = CompleteOutcome.CLAIMED_ELSEWHERE
                continue
            done = completion(item.job, self._pods.of(item.job_name))
            if done is None:  # not terminal after all (the same rule as job_state): poll again later
                item.outcome = CompleteOutcome.RUNNING
                continue
            try:
                verified = self._verified(item, done)
            except ObjectStoreUnavailable as e:  # nothing recorded, nothing released: the next poll or sweep
                log.warning("dispatch %s: its result cannot be verified now: %s", item.dispatch_id, e)
                item.outcome = CompleteOutcome.RUNNING
                continue
            first[item.dispatch_id] = item
            if done.lost:  # succeeded, but no Pod holds the result any more: `_rerun` runs it again
                item.lost = True
                continue
            event_type, payload = verified or terminal_event(done)
            if event_type is EventType.WORKER_FAILED:
                payload = self._why(item, payload)
            # A payload the store cannot keep fails its own dispatch here, never the batch.
            item.event = dispatches.storable_terminal(
                dispatches.TerminalEvent(item.dispatch_id, event_type, payload), reason=RESULT_NOT_JSON
            )
        for item in repeats:  # a repeat of a lost result is run again once, by its first entry
            item.outcome = CompleteOutcome.RERUN if first[item.dispatch_id].lost else CompleteOutcome.ALREADY_TERMINAL

    def _verified(self, item: _Item, done: Completion) -> tuple[EventType, dict[str, Any]] | None:
        """For a succeeded Job whose capability stores its results: the event its verified
        reference records (or the failure verification found); None for every other Job.

        Raises:
            ObjectStoreUnavailable: the store cannot say now.
        """
        if not done.succeeded or done.lost or item.record.capability not in self.rt.resolver:
            return None
        spec = self.rt.resolver.spec(item.record.capability)
        if not spec.results_in_object_store:
            return None
        return artifacts.verify_for_delivery(
            artifacts.for_settings(self.rt.settings),
            spec,
            dispatch_id=item.dispatch_id,
            attempt=item.attempt,
            output=done.output,
        )

    def _record(self, items: Sequence[_Item]) -> set[str]:
        """Write the decided events in ONE transaction and settle their Jobs' outcomes; the
        dispatch ids this call recorded."""
        writing = [item for item in items if item.event is not None]
        if not writing:
            return set()
        # The disruptions these Jobs met, each recorded once, before their end (the same Pod LIST).
        disruptions.record_pods(
            self.rt, self._namespace, [p for item in writing for p in self._pods.of(item.job_name)], enforce=False
        )
        crashpoint(Point.BEFORE_COMPLETE_WRITE)
        won = self._write(writing)
        crashpoint(Point.AFTER_COMPLETE_WRITE)
        for item in writing:
            if item.event is None:  # refused, even as a failure (`_write`)
                item.outcome = CompleteOutcome.REFUSED
            elif item.won(won):
                item.outcome = CompleteOutcome.COMPLETED
                METRICS.completion_recorded(item.job)
            else:
                item.outcome = CompleteOutcome.ALREADY_TERMINAL
                METRICS.duplicate_prevented(by="database")
        if won:
            self.rt.stats.incr(stats.COMPLETIONS_WRITTEN, len(won))
        return won

    def _write(self, writing: Sequence[_Item]) -> set[str]:
        """Write the items' events in ONE transaction; the ids won. Should the store or the
        database refuse the batch (what `storable_terminal` did not foresee, a row deleted
        meanwhile), each event is written alone, so only the one refused fails: it is recorded as
        WORKER_FAILED ResultNotJson instead, or, if even that is refused, the item's event is set
        to None (its Job is then never delivered: logged and counted as refused)."""
        try:
            with transaction(self.rt.sessions) as session:
                # No map among them (`complete_jobs` hands maps to `delivery.items`): no look for one.
                events = [item.event for item in writing if item.event is not None]
                return terminal.record(session, events, maps_among=False)
        except (Permanent, DBAPIError) as e:  # DatabaseUnavailable (Transient) stops the batch
            log.warning("the batch's terminal events were refused (%s); writing each alone", _why(e))
        won: set[str] = set()
        for item in writing:
            event = item.event
            assert event is not None
            try:
                won |= self._write_alone(event)
                continue
            except (Permanent, DBAPIError) as e:
                why = _why(e)
            log.warning(
                "the terminal event of dispatch %s was refused (%s); failing it instead", event.dispatch_id, why
            )
            failure = dispatches.TerminalEvent(
                event.dispatch_id, EventType.WORKER_FAILED,
                {"reason": RESULT_NOT_JSON, "message": f"the database refused the result: {why}"},
            )  # fmt: skip
            try:
                won |= self._write_alone(failure)
                item.event = failure
            except (Permanent, DBAPIError) as e:
                log.warning(
                    "dispatch %s: its failure was refused too (%s); its job is not delivered",
                    event.dispatch_id,
                    _why(e),
                )
                item.event = None
                self.rt.stats.incr(stats.JOBS_REFUSED)
        return won

    def _write_alone(self, event: dispatches.TerminalEvent) -> set[str]:
        with transaction(self.rt.sessions) as session:
            return terminal.record(session, [event], maps_among=False)

    def _rerun(self, items: Sequence[_Item]) -> None:
        """Settle the Jobs whose result was lost: each run again as a lost Job is (`rerun_lost`),
        under the claim this batch holds; rows read again now."""
        lost = [item for item in items if item.lost and item.outcome is None]
        if not lost:
            return
        records = load_records(self.rt, [item.dispatch_id for item in lost])
        for item in lost:
            record = records.get(item.dispatch_id)
            if record is None or record.terminal:
                item.outcome = CompleteOutcome.ALREADY_TERMINAL
                continue
            try:
                item.outcome = rerun_lost(
                    self.rt, record, snapshot=item.job, attempt=item.attempt, pods=self._pods.of(item.job_name)
                )
            except Transient as e:
                # Left as it is: the old Job, while it exists, comes back to poll; once gone, the
                # sweep re-creates it as a lost Job (category 5).
                log.warning(
                    "dispatch %s: running its lost result again stopped (%s); retried later", record.dispatch_id, e
                )
                item.outcome = CompleteOutcome.RERUN

    def _release(self, items: Sequence[_Item]) -> None:
        """Release the recorded Jobs, RELEASE_CONCURRENCY at a time, each Job's Pods before it:
        while the Job keeps our finalizer, the sweep frees what a crash here leaves (category 4),
        and the bulk delete takes the Pods at once. `outcomes` gets the Jobs' outcomes in order up
        to the first whose release failed, whose error is raised once every release has ended:
        the Jobs from there on are retried, and a release done twice changes nothing."""
        rt = self.rt

        def release(item: _Item, pods: list[dict[str, Any]]) -> None:
            release_pods(rt, item.namespace, pods)
            release_job(rt, item.namespace, item.job_name, snapshot=item.job)

        with ThreadPoolExecutor(max_workers=max(1, min(RELEASE_CONCURRENCY, len(items)))) as pool:
            # the Pod LIST here, once, not in the threads
            pending = [
                pool.submit(release, item, self._pods.of(item.job_name)) if item.released else None for item in items
            ]
            for future, item in zip(pending, items, strict=True):
                if future is not None:
                    future.result()  # raises the first failure, in the Jobs' order
                assert item.outcome is not None  # every step above settled it
                self.outcomes.append(item.outcome)

    def _why(self, item: _Item, payload: dict[str, Any]) -> dict[str, Any]:
        """A failure's payload with its structured detail (`workers.failure_detail`): exit code,
        signal, reasons, the failing container's log tail (one pods/log read), the Job's and its
        Pods' Warning Events (one LIST per batch) and its disruptions; OOMKilled as the reason
        when the container was. Best effort: what cannot be read is left out."""
        job, context = item.job, item.context
        assert context is not None  # only delivered Jobs have their failure explained
        uid = (job.get("metadata") or {}).get("uid")
        pods = [p for p in self._pods.of(context.job_name) if controller_uids(p) <= {uid}]
        pod = failure_detail.failed_pod(pods)
        log_bytes = None
        if pod is not None:
            try:
                log_bytes = self.rt.kube.read_pod_log(
                    context.namespace,
                    str((pod.get("metadata") or {}).get("name", "")),
                    container=CONTAINER_NAME,
                    tail_lines=failure_detail.LOG_TAIL_LINES,
                    limit_bytes=failure_detail.LOG_LIMIT_BYTES,
                )
            except DispatchError as e:
                log.info("dispatch %s: its log could not be read (%s)", context.dispatch_id, e.reason)
        uids = {uid} | {(p.get("metadata") or {}).get("uid") for p in pods}
        events = [e for e in self._warnings() if (e.get("involvedObject") or {}).get("uid") in uids]
        archived = logs.log_key(  # where release_pods archives the failing Pod's whole log
            artifacts.for_settings(self.rt.settings),
            self.rt.resolver,
            None if pod is None else failure_detail.pod_log(pod),
        )
        detail = failure_detail.detail(
            job, pod, events=events, log=log_bytes, disrupted=failure_detail.disruptions(pods), log_key=archived
        )
        reason = failure_detail.failure_reason(payload.get("reason"), pod)
        try:
            canonical_json(detail, what="the failure's detail")
        except InvalidInput:  # never the case by construction; the failure is recorded all the same
            return {**payload, "reason": reason}
        return {**payload, "reason": reason, "detail": detail}

    def _warnings(self) -> list[dict[str, Any]]:
        """The namespace's Warning Events, read once per batch (one LIST per page), on first need."""
        if self._events is None:
            self._events = []
            try:
                for page in self.rt.kube.iter_events(self._namespace, field_selector=f"type={failure_detail.WARNING}"):
                    self._events += page
            except DispatchError as e:
                log.info("the warning events of %s could not be read (%s)", self._namespace, e.reason)
        return self._events


class _PodsOf:
    """The Pods of some Jobs of one namespace, listed on first need with one
    `job-name in (...)` LIST per chunk of names, then handed out by Job name."""

    def __init__(self, rt: Runtime, namespace: str, names: Sequence[str]) -> None:
        self._rt, self._namespace, self._names = rt, namespace, sorted(set(names))
        self._by_job: dict[str, list[dict[str, Any]]] | None = None

    def of(self, name: str) -> list[dict[str, Any]]:
        if self._by_job is None:
            self._by_job = pods_by_job(self._rt, self._namespace, self._names)
        return self._by_job.get(name, [])


def _name(job: Mapping[str, Any]) -> str:
    return str((job.get("metadata") or {}).get("name", ""))


def job_snapshot(job: Mapping[str, Any]) -> dict[str, Any]:
    """What the completion path reads of a Job (pure), small enough to travel in a task message:
    identity, labels, our own annotations, finalizers, deletion mark, and the whole status."""
    metadata = job.get("metadata") or {}
    kept = {key: metadata[key] for key in _SNAPSHOT_METADATA if key in metadata}
    annotations = {k: v for k, v in (metadata.get("annotations") or {}).items() if k.startswith(job_labels.PREFIX)}
    if annotations:
        kept["annotations"] = annotations
    return {"metadata": kept, "status": job.get("status") or {}}


_SNAPSHOT_METADATA = ("name", "namespace", "uid", "resourceVersion", "labels", "finalizers", "deletionTimestamp")


def terminal_event(done: Completion) -> tuple[EventType, dict[str, Any]]:
    """The event type and payload a Job's completion records."""
    if done.succeeded:
        return EventType.WORKER_COMPLETED, {"output": done.output}
    payload: dict[str, Any] = {"reason": done.reason}
    if done.detail:
        payload["message"] = done.detail
    return EventType.WORKER_FAILED, payload


def _why(error: BaseException) -> str:
    """The first line of an error's text (a driver's error: its own message, not the statement)."""
    text = str(getattr(error, "orig", None) or error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def rerun_lost(
    rt: Runtime,
    record: DispatchRecord,
    *,
    snapshot: Mapping[str, Any],
    attempt: int,
    pods: Iterable[Mapping[str, Any]] = (),
) -> CompleteOutcome:
    """A Job (`snapshot`, of `attempt`) succeeded but no Pod holds its result any more (removed
    before our finalizer was on Pods, or stripped of it): run the work again as a lost Job is,
    never record a failure of work that succeeded. The caller holds the dispatch's guard claim
    and has just read `record`, which is not terminal.

    The Job's attempts used up (`MAX_JOB_ATTEMPTS`): WORKER_FAILED `JobLost`, and COMPLETED (the
    caller releases the Job as after any end). Else the Job is released and deleted (exact by
    its uid, with any `pods` of it freed) and created again as the next attempt, counted when
    it is marked created (`mark_created_many`), so a repeat of this call counts nothing twice.
    A snapshot of an earlier attempt than the row's is only removed, and the row's attempt
    created if it is missing. RERUN.

    Raises:
        Transient: the API or database is unavailable (an AlreadyExists of the old Job still
            going away, as Conflict): nothing is counted; the old Job, or the sweep, brings it back.
    """
    metadata = snapshot.get("metadata") or {}
    namespace, name = str(metadata.get("namespace", "")), str(metadata.get("name", ""))
    latest = attempt >= record.attempts
    if latest and out_of_attempts(attempt, rt.settings.max_job_attempts):
        message = (
            f"job {namespace}/{name} succeeded but its result was lost with its Pod, after {attempt + 1} attempt(s)"
        )
        log.warning("dispatch %s: %s", record.dispatch_id, message)
        won = terminal.fail_dispatch(rt, record.dispatch_id, reason=JOB_LOST_REASON, message=message)
        return CompleteOutcome.COMPLETED if won else CompleteOutcome.ALREADY_TERMINAL
    again = replace(record, attempts=attempt + 1) if latest else record
    log.warning(
        "dispatch %s: job %s/%s succeeded but its result was lost with its Pod; creating it again (attempt %d)",
        record.dispatch_id, namespace, name, again.attempts,
    )  # fmt: skip
    uid = metadata.get("uid")
    release_pods(rt, namespace, [pod for pod in pods if controller_uids(pod) <= {uid}])  # not a newer attempt's
    release_job(rt, namespace, name, snapshot=snapshot, delivered=False)
    rt.kube.delete_job(namespace, name, propagation="Background", uid=uid)
    create_jobs_for(rt, [record.dispatch_id], reruns={record.dispatch_id: Rerun(record.attempts, again.attempts)})
    return CompleteOutcome.RERUN
