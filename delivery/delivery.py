"""The single delivery path: create a dispatch's Job, complete it, cancel it, clean up after it.

Plain functions of a `Runtime` and ids, called by the Celery tasks and, inline, by the
recovery sweep: a completion after a restart takes exactly the path a normal one does. Each
step is idempotent (deterministic Job names, a guarded completion, a unique terminal event),
so any of them may run twice, concurrently, or again after a crash at any line.

Completions come in batches of Jobs as poll's LIST read them: per Job, one patch of its Pod
and one of the Job (our finalizer off each, the delivered label on the Job); per batch, one Pod
LIST, one transaction for the terminal events, a Redis round trip for the guard's claims and one
bulk delete (for poll's batches, one per poll interval). A Job that succeeded but whose Pod (and
result) is gone is run again, never failed. A failure keeps why (exit code, signal, reasons, log
tail, Warning Events: `workers.failure_detail`), read only for failed Jobs; the disruptions a
batch's Pods show are recorded first (`delivery.disruptions`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

import redis
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from k8s_dispatch.core.errors import (
    AlreadyExists,
    ApiRejected,
    Conflict,
    DispatchError,
    InvalidInput,
    InvalidManifest,
    LabelMismatch,
    NotFound,
    Permanent,
    TenancyMismatch,
    Transient,
    UnknownCapability,
    UnknownDispatch,
)
from k8s_dispatch.core.ids import check_dispatch_id
from k8s_dispatch.core.payloads import canonical_json
from k8s_dispatch.delivery import disruptions, queue_clock, statelog, stats
from k8s_dispatch.delivery.attempts import JOB_LOST_REASON, out_of_attempts
from k8s_dispatch.delivery.crashpoints import Point, crashpoint
from k8s_dispatch.delivery.guard import Claim
from k8s_dispatch.delivery.metrics import METRICS
from k8s_dispatch.delivery.reconstruct import DeliveryContext, DispatchRecord, context_from_job
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.store import dispatches
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import STATE_FOR_TERMINAL_EVENT, DispatchState, EventType
from k8s_dispatch.workers import failure_detail
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.job_status import RESULT_NOT_JSON, Completion, completion, job_state
from k8s_dispatch.workers.kube import REQUESTS_PER_THREAD
from k8s_dispatch.workers.manifest import CONTAINER_NAME, FINALIZER, build_job, job_name
from k8s_dispatch.workers.pod_health import QUEUE_TIMEOUT, Verdict

log = logging.getLogger(__name__)

JOB_NAME_LABEL = "batch.kubernetes.io/job-name"  # set by the Job controller on the Job's Pods
# Job names per `job-name in (...)` Pod selector: 100 names of 39 characters make ~4 KB.
SELECTOR_CHUNK = 100
# A batch's releases (a Job's Pods, then the Job: one or two patches each) run this many Jobs at
# a time: each patch is a write the API server commits to etcd, 20-35 ms each on a busy control
# plane, which one after the other made a batch of 6 wait 0.4 s for them.
RELEASE_CONCURRENCY = REQUESTS_PER_THREAD
CANCELLED_REASON = "Cancelled"


class CreateOutcome(StrEnum):
    CREATED = "created"  # this call created the Job
    ADOPTED = "adopted"  # the Job existed (a retry, a duplicate message) and its labels agree
    SKIPPED = "skipped"  # the dispatch is terminal already: no Job is needed
    QUEUED = "queued"  # the dispatch waits for a slot (store/admission.py): no Job yet
    FAILED = "failed"  # refused for good (API 4xx, invalid manifest, foreign Job): WORKER_FAILED


class CompleteOutcome(StrEnum):
    COMPLETED = "completed"  # this call wrote the terminal event
    ALREADY_TERMINAL = "already_terminal"  # recorded before or by a racing writer; cleaned up
    RUNNING = "running"  # the Job has not finished
    CLAIMED_ELSEWHERE = "claimed_elsewhere"  # another replica holds the guard for it
    REFUSED = "refused"  # labels unreadable or disagreeing with the DB: never delivered
    GONE = "gone"  # no such Job
    RERUN = "rerun"  # it succeeded but its result went with its Pod: deleted, created again (next attempt)


# --- reading ----------------------------------------------------------------------------


def load_record(rt: Runtime, dispatch_id: str) -> DispatchRecord | None:
    """The dispatch's row as a snapshot, or None if there is no such dispatch."""
    return load_records(rt, [dispatch_id]).get(dispatch_id)


def load_records(rt: Runtime, dispatch_ids: Sequence[str]) -> dict[str, DispatchRecord]:
    """Snapshots of the dispatches among `dispatch_ids` that exist, by id: one query (per
    QUERY_BATCH ids) of plain rows, no ORM objects."""
    with transaction(rt.sessions) as session:
        return {d: DispatchRecord.from_row(row) for d, row in dispatches.dispatch_rows(session, dispatch_ids).items()}


def job_location(rt: Runtime, record: DispatchRecord) -> tuple[str, str]:
    """(namespace, name) of the dispatch's Job: recorded, else where it would be created."""
    if record.job_namespace is not None:
        return record.job_namespace, record.job_name or job_name(record.dispatch_id)
    try:
        namespace = rt.namespace_for(record.capability)
    except UnknownCapability:
        namespace = rt.settings.namespace
    return namespace, job_name(record.dispatch_id)


# --- create -----------------------------------------------------------------------------


def create_job_for(rt: Runtime, dispatch_id: str) -> CreateOutcome:
    """Create the dispatch's Job (attempt = the row's `attempts`), or adopt the one there:
    `create_jobs_for` for one dispatch.

    Raises:
        InvalidId: `dispatch_id` is not a UUID.
        UnknownDispatch: no such dispatch.
        Transient: the API, database or broker is unavailable; the same call may be retried.
    """
    outcome = create_jobs_for(rt, [dispatch_id]).get(dispatch_id)
    if outcome is None:
        raise UnknownDispatch(f"dispatch {dispatch_id} does not exist")
    return outcome


@dataclass(frozen=True)
class Rerun:
    """Create attempt `attempt` of a dispatch's Job only if its row still counts `counted`
    attempts: a Job lost, or a result lost with its Pod, is run again once, however many sweeps
    or batches decide it, and the attempt is counted only by the Job it made (or adopted)."""

    counted: int
    attempt: int


@dataclass(frozen=True)
class _Made:
    """A dispatch's Job that exists now (created or adopted): marked created with its attempt."""

    record: DispatchRecord
    outcome: CreateOutcome
    namespace: str
    name: str
    attempt: int


@dataclass(frozen=True)
class _Step:
    """What one create came to: its outcome, the Job to mark, or the failure to record."""

    outcome: CreateOutcome
    made: _Made | None = None
    failure: tuple[str, str] | None = None  # the reason and message of a WORKER_FAILED


def _failed(error: Permanent) -> _Step:
    return _Step(CreateOutcome.FAILED, failure=(error.reason, str(error)))


def create_jobs_for(
    rt: Runtime, dispatch_ids: Sequence[str], *, reruns: Mapping[str, Rerun] | None = None
) -> dict[str, CreateOutcome]:
    """Create the dispatches' Jobs (or adopt those there), one after the other, in ONE
    transaction that holds their rows locked (`dispatches.lock_dispatch_rows`) from the read that
    decides each create until what was made is marked. An outcome per dispatch, by id; an id
    with no dispatch is logged and left out.

    One Job per attempt, by construction: a terminal event is written only with its dispatch's
    row lock (`dispatches.record_terminals` updates the row), so no dispatch read here can end, and
    have its Job delivered and bulk-deleted, before the POST that follows the read: the create
    sees an ended dispatch and makes nothing, or it makes (or adopts, on 409) the Job before the
    end can be recorded. Whatever slows a POST (429 pauses, retries) widens no window.

    Per Job: a terminal dispatch is skipped, a queued one waits for admission, a Job that exists
    is adopted (if its labels say it is this dispatch's), a permanent refusal fails that dispatch
    only (WORKER_FAILED, in the same transaction; the engine told after commit). `reruns` names
    the dispatches to create as a later attempt (`Rerun`): skipped if their count moved since. A
    Transient error (a 403 "exceeded quota" is one: `QuotaExceeded`) stops the batch; so does
    any other error. Either way the Jobs made before it are marked first (the retry adopts them,
    409), a Transient is recorded on the row it stopped at (`status` shows it), and nothing is
    counted for a Job that was not made.

    Raises:
        InvalidId: one of `dispatch_ids` is not a UUID (before anything is done).
        Transient: the API, database or broker is unavailable; the same call may be retried.
    """
    ids = [check_dispatch_id(d) for d in dict.fromkeys(dispatch_ids)]
    reruns = reruns or {}
    outcomes: dict[str, CreateOutcome] = {}
    made: list[_Made] = []
    failed: dict[str, tuple[DispatchRecord, tuple[str, str]]] = {}
    stopped: Exception | None = None
    with transaction(rt.sessions) as session:
        rows = dispatches.lock_dispatch_rows(session, ids)
        records = _with_namespaces(rt, session, {d: DispatchRecord.from_row(row) for d, row in rows.items()})
        for dispatch_id in ids:
            record = records.get(dispatch_id)
            if record is None:
                log.warning("no dispatch %s: no Job to create", dispatch_id)
                continue
            try:
                step = _create(rt, record, reruns.get(dispatch_id))
            except queue_clock.QUEUE_WAITS as e:
                if not _queue_timed_out(rt, session, record):
                    _note_create_error(session, record, e)
                    stopped = e
                    break
                step = _Step(CreateOutcome.FAILED, failure=(QUEUE_TIMEOUT, _queue_message(rt, record, e)))
            except Transient as e:
                _note_create_error(session, record, e)
                stopped = e
                break
            except Exception as e:  # a bug or an unforeseen error: what was made is still marked
                log.exception("dispatch %s: creating its job failed unexpectedly", dispatch_id)
                stopped = e
                break
            outcomes[dispatch_id] = step.outcome
            if step.made is not None:
                made.append(step.made)
            if step.failure is not None:
                failed[dispatch_id] = (record, step.failure)
        marked = dispatches.mark_created_many(
            session, [dispatches.CreatedJob(m.record.dispatch_id, m.name, m.namespace, m.attempt) for m in made]
        )
        ended = dispatches.record_terminals(
            session,
            [
                dispatches.TerminalEvent(d, EventType.WORKER_FAILED, {"reason": reason, "message": message})
                for d, (_, (reason, message)) in sorted(failed.items())
            ],
        )
    _after_creates(rt, made, marked, {d: failed[d] for d in ended})
    if stopped is not None:
        raise stopped
    return outcomes


def _after_creates(
    rt: Runtime, made: list[_Made], marked: set[str], ended: Mapping[str, tuple[DispatchRecord, tuple[str, str]]]
) -> None:
    """After the create transaction committed: log the state changes, tell the engine of the
    dispatches it failed. A made Job whose row was not marked (it cannot end while locked, so
    only a row gone meanwhile) is deleted: nothing would deliver it."""
    for m in made:
        if m.record.dispatch_id not in marked:
            cleanup_job(rt, m.namespace, m.name)
        elif m.record.state is DispatchState.SCHEDULED or m.outcome is CreateOutcome.CREATED:
            statelog.dispatch_changed(m.record, DispatchState.CREATED, job=f"{m.namespace}/{m.name}", attempt=m.attempt)
    for record, (reason, message) in ended.values():
        log.warning("dispatch %s failed before its job ran: %s: %s", record.dispatch_id, reason, message)
        statelog.dispatch_changed(record, DispatchState.FAILED, reason=reason)
    if ended:
        notify_engines(rt, sorted(ended))


def _queue_timed_out(rt: Runtime, session: Session, record: DispatchRecord) -> bool:
    """The queue clock: a dispatch whose first Job still cannot be made longer than its
    capability's `queueTimeoutSeconds` after its scheduling fails `QueueTimeout`."""
    if record.state is not DispatchState.SCHEDULED or record.capability not in rt.resolver:
        return False
    timeout_s = rt.resolver.spec(record.capability).queue_timeout_seconds
    return timeout_s is not None and queue_clock.queue_expired_in(session, record.dispatch_id, timeout_s=timeout_s)


def _queue_message(rt: Runtime, record: DispatchRecord, error: Transient) -> str:
    timeout_s = rt.resolver.spec(record.capability).queue_timeout_seconds
    assert timeout_s is not None  # `_queue_timed_out` said it expired
    return queue_clock.queue_message(timeout_s, error)


def _note_create_error(session: Session, record: DispatchRecord, error: Transient) -> None:
    """Record on the row why its create must wait (403 exceeded quota, ...), for `status`; the
    dispatch stays as it is and the create is retried."""
    log.warning("dispatch %s: its job cannot be created yet (%s): %s", record.dispatch_id, error.reason, error)
    dispatches.record_create_error(session, record.dispatch_id, message=f"{error.reason}: {error}")


def _with_namespaces(rt: Runtime, session: Session, records: dict[str, DispatchRecord]) -> dict[str, DispatchRecord]:
    """`records`, each with its Job namespace fixed: a row an engine wrote itself records none,
    and gets its capability's now, by compare-and-set in the caller's transaction, so that
    every worker creating it, now or later, under any config, uses the same one."""
    wanted: dict[str, str] = {}
    for dispatch_id, record in records.items():
        if record.job_namespace is None and not record.terminal:
            try:
                wanted[dispatch_id] = rt.namespace_for(record.capability)
            except UnknownCapability:
                continue  # `_create` fails it, with that reason
    if not wanted:
        return records
    fixed = dispatches.fix_job_namespaces(session, wanted)
    return {
        d: replace(record, job_namespace=fixed[d]) if d in fixed and fixed[d] is not None else record
        for d, record in records.items()
    }


def _create(rt: Runtime, record: DispatchRecord, rerun: Rerun | None = None) -> _Step:
    """Create (or adopt) one dispatch's Job, in the namespace its row records; called with its
    row locked, writes nothing to the database (the caller records what it returns)."""
    if record.terminal:
        return _Step(CreateOutcome.SKIPPED)
    if record.state is DispatchState.QUEUED:  # a create sent before admission would exceed its limit
        return _Step(CreateOutcome.QUEUED)
    attempt = record.attempts
    if rerun is not None:
        if record.attempts != rerun.counted:
            return _Step(CreateOutcome.SKIPPED)  # run again (or given up) by another caller already
        attempt = rerun.attempt
    try:
        spec = rt.resolver.spec(record.capability)
        if record.job_namespace is not None:  # fixed when scheduled: the config may have moved since
            spec = replace(spec, namespace=record.job_namespace)
        body = build_job(
            record.ref,
            input=record.input,
            spec=spec,
            namespace=rt.settings.namespace,
            deployment=rt.settings.effective_deployment,
            attempt=attempt,
        )
    except UnknownCapability as e:
        # Removed from the config since scheduling: a Job made before still runs and is
        # delivered; with none, the dispatch fails with that reason.
        return _adopt_or_fail(rt, record, e)
    except (InvalidManifest, InvalidInput) as e:
        # The config changed since scheduling, or the row holds what no Job can carry.
        return _failed(e)
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]

    crashpoint(Point.BEFORE_JOB_CREATE)
    try:
        rt.kube.create_job(namespace, body)
    except AlreadyExists:
        return _adopt(rt, record, namespace=namespace, name=name, attempt=attempt)
    except (ApiRejected, InvalidManifest, NotFound) as e:
        # 400/403/422 (and 404: the namespace does not exist): the API's reason and message.
        return _failed(e)
    crashpoint(Point.AFTER_JOB_CREATE)
    return _Step(CreateOutcome.CREATED, _Made(record, CreateOutcome.CREATED, namespace, name, attempt))


def _adopt_or_fail(rt: Runtime, record: DispatchRecord, error: UnknownCapability) -> _Step:
    """The capability is gone from the config: adopt the dispatch's Job if one was made where
    its row records, else fail the dispatch with `error`'s reason."""
    if record.job_namespace is None:
        return _failed(error)
    try:
        return _adopt(
            rt, record, namespace=record.job_namespace, name=job_name(record.dispatch_id), attempt=record.attempts
        )
    except Conflict:  # no such Job: nothing runs it, and no config says how to
        return _failed(error)


def _adopt(rt: Runtime, record: DispatchRecord, *, namespace: str, name: str, attempt: int) -> _Step:
    """A Job with the dispatch's name exists: adopt it if its labels say it is this dispatch's
    (one made before the deployment label existed gets ours: it is this deployment's Job), at
    the attempt its labels say (a re-run that found its Job there counts nothing more)."""
    try:
        job = rt.kube.get_job(namespace, name)
    except NotFound as e:
        # Deleted between our create and our read (a clean-up racing us): create again.
        raise Conflict(f"job {namespace}/{name} existed, then vanished; creating it again") from e
    try:
        context = context_from_job(job, record, expected_namespace=namespace)
    except (LabelMismatch, TenancyMismatch, UnknownDispatch) as e:
        _refuse(rt, job, e)
        return _failed(LabelMismatch(f"a Job named {name} exists but is not this dispatch's: {e}"))
    if job_labels.deployment_of((job.get("metadata") or {}).get("labels")) is None:
        label_deployment(rt, namespace, name, snapshot=job)
    if context.deleting and context.attempt < attempt:
        # An earlier attempt's Job on its way out (a lost result's re-run deleted it): adopting
        # it would count an attempt that never ran. Create this one once that one is gone.
        raise Conflict(f"job {namespace}/{name} of attempt {context.attempt} is being deleted; "
                       f"attempt {attempt} is created once it is gone")  # fmt: skip
    log.info("adopted existing job %s/%s for dispatch %s", namespace, name, record.dispatch_id)
    return _Step(CreateOutcome.ADOPTED, _Made(record, CreateOutcome.ADOPTED, namespace, name, context.attempt))


# --- complete ---------------------------------------------------------------------------


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
    batch = _Batch(rt, namespace, jobs)
    try:
        batch.deliver()
    except Transient as e:
        left = len(jobs) - len(batch.outcomes)
        log.warning("completing jobs in %s stopped (%s); %d left to retry", namespace, e, left)
        done = Completed(batch.outcomes, unavailable=list(jobs[len(batch.outcomes) :]), error=e)
    else:
        done = Completed(batch.outcomes)
    if delete and done.released:
        try:
            delete_delivered(rt, namespace)
        except Transient as e:
            log.warning("bulk delete of delivered jobs in %s failed (%s); the next one removes them", namespace, e)
    return done


class _Batch:
    """One `complete_jobs` call. Per Job: rebuild the context from its labels and the DB
    (refusing any disagreement), claim the guard, compute the result from its Pods, write the
    terminal event, notify the engine if this call won it, then release the Job (`release_job`).
    Each step runs for every Job before the next, so the batch costs a few round trips to
    PostgreSQL and Redis in all, and one patch per Job (a few Jobs' at a time); the crash points
    fire once per batch. `outcomes` grows, in the Jobs' order, as each Job's patch is done."""

    def __init__(self, rt: Runtime, namespace: str, jobs: Sequence[Mapping[str, Any]]) -> None:
        self.rt, self.jobs = rt, jobs
        self.outcomes: list[CompleteOutcome] = []
        self._pods = _PodsOf(rt, namespace, [_name(job) for job in jobs if job_state(job).terminal])
        self._lost: dict[int, DeliveryContext] = {}  # the Jobs whose result went with their Pods: run again
        self._namespace = namespace
        self._events: list[dict[str, Any]] | None = None  # the namespace's Warning Events, read on need

    def deliver(self) -> None:
        rt = self.rt
        contexts = _contexts(rt, self.jobs)
        # What each Job needs, decided before any side effect: None = claim and complete it.
        decided: list[CompleteOutcome | None] = []
        for job, context in zip(self.jobs, contexts, strict=True):
            if context is None:
                decided.append(CompleteOutcome.REFUSED)
            elif context.record.terminal:
                decided.append(CompleteOutcome.ALREADY_TERMINAL)
            elif not job_state(job).terminal:
                decided.append(CompleteOutcome.RUNNING)
            else:
                decided.append(None)
        wanted = [c.dispatch_id for c, d in zip(contexts, decided, strict=True) if c is not None and d is None]
        claims = rt.guard.claim_many(wanted) if wanted else {}
        try:
            won = self._record(contexts, decided, claims)
            if won:
                notify_engines(rt, sorted(won))
            self._rerun(decided)
            outcomes: list[CompleteOutcome] = []
            for outcome in decided:
                assert outcome is not None  # `_record` decided every one
                outcomes.append(outcome)
            self._release(contexts, outcomes)
        finally:
            rt.guard.release_many([c for c in claims.values() if c is not None])

    def _release(self, contexts: Sequence[DeliveryContext | None], decided: Sequence[CompleteOutcome]) -> None:
        """Release the recorded Jobs, RELEASE_CONCURRENCY at a time, each Job's Pods before it:
        while the Job keeps our finalizer, the sweep frees what a crash here leaves (category 4),
        and the bulk delete takes the Pods at once. `outcomes` gets the Jobs' outcomes in order up
        to the first whose release failed, whose error is raised once every release has ended:
        the Jobs from there on are retried, and a release done twice changes nothing."""
        rt = self.rt
        released = (CompleteOutcome.COMPLETED, CompleteOutcome.ALREADY_TERMINAL)

        def release(context: DeliveryContext, job: Mapping[str, Any], pods: list[dict[str, Any]]) -> None:
            release_pods(rt, context.namespace, pods)
            release_job(rt, context.namespace, context.job_name, snapshot=job)

        with ThreadPoolExecutor(max_workers=max(1, min(RELEASE_CONCURRENCY, len(self.jobs)))) as pool:
            pending = [
                # the Pod LIST here, once, not in the threads
                pool.submit(release, context, job, self._pods.of(context.job_name))
                if context is not None and outcome in released
                else None
                for job, context, outcome in zip(self.jobs, contexts, decided, strict=True)
            ]
            for future, outcome in zip(pending, decided, strict=True):
                if future is not None:
                    future.result()  # raises the first failure, in the Jobs' order
                self.outcomes.append(outcome)

    def _record(
        self,
        contexts: Sequence[DeliveryContext | None],
        decided: list[CompleteOutcome | None],
        claims: Mapping[str, Claim | None],
    ) -> set[str]:
        """Write the terminal events of the claimed Jobs in one transaction and settle every
        undecided outcome in `decided` but those of lost results (`_lost`, for `_rerun`); the
        dispatch ids this call recorded."""
        rt = self.rt
        events: dict[int, dispatches.TerminalEvent | None] = {}
        writing: set[str] = set()
        repeats: list[int] = []  # a Job listed twice in the batch: its first entry delivers it
        for i, (job, context) in enumerate(zip(self.jobs, contexts, strict=True)):
            if decided[i] is not None or context is None:
                continue
            if context.dispatch_id in writing:
                repeats.append(i)
                continue
            if claims.get(context.dispatch_id) is None:
                decided[i] = CompleteOutcome.CLAIMED_ELSEWHERE
                continue
            done = completion(job, self._pods.of(context.job_name))
            if done is None:  # not terminal after all (the same rule as job_state): poll again later
                decided[i] = CompleteOutcome.RUNNING
                continue
            if done.lost:  # succeeded, but no Pod holds the result any more: `_rerun` runs it again
                self._lost[i] = context
                writing.add(context.dispatch_id)
                continue
            event_type, payload = terminal_event(done)
            if event_type is EventType.WORKER_FAILED:
                payload = self._why(job, context, payload)
            # A payload the store cannot keep fails its own dispatch here, never the batch.
            events[i] = dispatches.storable_terminal(
                dispatches.TerminalEvent(context.dispatch_id, event_type, payload), reason=RESULT_NOT_JSON
            )
            writing.add(context.dispatch_id)
        lost = {lost_context.dispatch_id for lost_context in self._lost.values()}
        for i in repeats:  # a repeat of a lost result is run again once, by its first entry
            context = contexts[i]
            assert context is not None
            decided[i] = CompleteOutcome.RERUN if context.dispatch_id in lost else CompleteOutcome.ALREADY_TERMINAL
        if not events:
            return set()
        # The disruptions these Jobs met, each recorded once, before their end (the same Pod LIST).
        disruptions.record_pods(
            rt, self._namespace, [p for i in events for p in self._pods.of(_name(self.jobs[i]))], enforce=False
        )
        crashpoint(Point.BEFORE_COMPLETE_WRITE)
        won = self._write(events)
        crashpoint(Point.AFTER_COMPLETE_WRITE)
        for i, event in events.items():
            context = contexts[i]
            assert context is not None
            if event is None:  # refused, even as a failure (`_write`)
                decided[i] = CompleteOutcome.REFUSED
            elif event.dispatch_id in won:
                decided[i] = CompleteOutcome.COMPLETED
                METRICS.completion_recorded(self.jobs[i])
                statelog.dispatch_changed(
                    context.record, STATE_FOR_TERMINAL_EVENT[event.type], reason=event.payload.get("reason")
                )
            else:
                decided[i] = CompleteOutcome.ALREADY_TERMINAL
                METRICS.duplicate_prevented(by="database")
        if won:
            rt.stats.incr(stats.COMPLETIONS_WRITTEN, len(won))
        return won

    def _why(self, job: Mapping[str, Any], context: DeliveryContext, payload: dict[str, Any]) -> dict[str, Any]:
        """A failure's payload with its structured detail (`workers.failure_detail`): exit code,
        signal, reasons, the failing container's log tail (one pods/log read), the Job's and its
        Pods' Warning Events (one LIST per batch) and its disruptions; OOMKilled as the reason
        when the container was. Best effort: what cannot be read is left out."""
        uid = (job.get("metadata") or {}).get("uid")
        pods = [p for p in self._pods.of(context.job_name) if _controller_uids(p) <= {uid}]
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
        detail = failure_detail.detail(
            job, pod, events=events, log=log_bytes, disrupted=failure_detail.disruptions(pods)
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

    def _write(self, events: dict[int, dispatches.TerminalEvent | None]) -> set[str]:
        """Write the events in ONE transaction; the ids won. Should the store or the database
        refuse the batch (what `storable_terminal` did not foresee, a row deleted meanwhile),
        each event is written alone, so only the one refused fails: it is recorded as
        WORKER_FAILED ResultNotJson instead, or, if even that is refused, set to None in
        `events` (its Job is then never delivered: logged and counted as refused)."""
        try:
            with transaction(self.rt.sessions) as session:
                return dispatches.record_terminals(session, [e for e in events.values() if e is not None])
        except (Permanent, DBAPIError) as e:  # DatabaseUnavailable (Transient) stops the batch
            log.warning("the batch's terminal events were refused (%s); writing each alone", _why(e))
        won: set[str] = set()
        for i, event in events.items():
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
                events[i] = failure
            except (Permanent, DBAPIError) as e:
                log.warning(
                    "dispatch %s: its failure was refused too (%s); its job is not delivered",
                    event.dispatch_id,
                    _why(e),
                )
                events[i] = None
                self.rt.stats.incr(stats.JOBS_REFUSED)
        return won

    def _write_alone(self, event: dispatches.TerminalEvent) -> set[str]:
        with transaction(self.rt.sessions) as session:
            return dispatches.record_terminals(session, [event])

    def _rerun(self, decided: list[CompleteOutcome | None]) -> None:
        """Settle the Jobs whose result was lost (`_record` left them undecided): each run again
        as a lost Job is (`rerun_lost`), under the claim this batch holds; rows read again now."""
        if not self._lost:
            return
        records = load_records(self.rt, [context.dispatch_id for context in self._lost.values()])
        for i, context in self._lost.items():
            record = records.get(context.dispatch_id)
            if record is None or record.terminal:
                decided[i] = CompleteOutcome.ALREADY_TERMINAL
                continue
            try:
                decided[i] = rerun_lost(
                    self.rt,
                    record,
                    snapshot=self.jobs[i],
                    attempt=context.attempt,
                    pods=self._pods.of(context.job_name),
                )
            except Transient as e:
                # Left as it is: the old Job, while it exists, comes back to poll; once gone, the
                # sweep re-creates it as a lost Job (category 5).
                log.warning(
                    "dispatch %s: running its lost result again stopped (%s); retried later", record.dispatch_id, e
                )
                decided[i] = CompleteOutcome.RERUN


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


def pods_by_job(rt: Runtime, namespace: str, names: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
    """The Pods of the named Jobs of one namespace, by Job name: one `job-name in (...)` LIST
    per chunk of names."""
    names = sorted(set(names))
    by_job: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for start in range(0, len(names), SELECTOR_CHUNK):
        chunk = names[start : start + SELECTOR_CHUNK]
        selector = f"{JOB_NAME_LABEL} in ({','.join(chunk)})" if len(chunk) > 1 else f"{JOB_NAME_LABEL}={chunk[0]}"
        for pod in rt.kube.list_pods(namespace, label_selector=selector):
            owner = ((pod.get("metadata") or {}).get("labels") or {}).get(JOB_NAME_LABEL)
            if owner in by_job:
                by_job[owner].append(pod)
    return by_job


def _controller_uids(pod: Mapping[str, Any]) -> set[str]:
    """The uids of the Jobs a Pod names as its controller (ownerReference, or the label an orphan keeps)."""
    metadata = pod.get("metadata") or {}
    owners = {o.get("uid") for o in metadata.get("ownerReferences") or [] if o.get("controller")}
    return owners | {v for k, v in (metadata.get("labels") or {}).items() if k == "batch.kubernetes.io/controller-uid"}


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


def _contexts(rt: Runtime, jobs: Sequence[Mapping[str, Any]]) -> list[DeliveryContext | None]:
    """Each Job matched to its dispatch (the rows read with one query), or None (logged and
    counted) where it must not be delivered."""
    refs: list[Any] = []
    for job in jobs:
        metadata = job.get("metadata") or {}
        try:
            refs.append(job_labels.decode(metadata.get("labels"), metadata.get("annotations")))
        except LabelMismatch as e:
            refs.append(e)
    records = load_records(rt, [ref.dispatch_id for ref in refs if not isinstance(ref, LabelMismatch)])
    contexts: list[DeliveryContext | None] = []
    for job, ref in zip(jobs, refs, strict=True):
        try:
            if isinstance(ref, LabelMismatch):
                raise ref
            record = records.get(ref.dispatch_id)
            expected = None
            if record is not None and record.job_namespace is None:
                expected = job_location(rt, record)[0]
            contexts.append(context_from_job(job, record, expected_namespace=expected))
        except (LabelMismatch, TenancyMismatch, UnknownDispatch) as e:
            _refuse(rt, job, e)
            contexts.append(None)
    return contexts


def _why(error: BaseException) -> str:
    """The first line of an error's text (a driver's error: its own message, not the statement)."""
    text = str(getattr(error, "orig", None) or error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _refuse(rt: Runtime, job: Mapping[str, Any], error: Permanent) -> None:
    metadata = job.get("metadata") or {}
    log.warning(
        "never delivering job %s/%s: %s: %s", metadata.get("namespace"), metadata.get("name"), error.reason, error
    )
    rt.stats.incr(stats.JOBS_REFUSED)


# --- a lost result ---------------------------------------------------------------------


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
        won = fail_dispatch(rt, record.dispatch_id, reason=JOB_LOST_REASON, message=message)
        return CompleteOutcome.COMPLETED if won else CompleteOutcome.ALREADY_TERMINAL
    again = replace(record, attempts=attempt + 1) if latest else record
    log.warning(
        "dispatch %s: job %s/%s succeeded but its result was lost with its Pod; creating it again (attempt %d)",
        record.dispatch_id, namespace, name, again.attempts,
    )  # fmt: skip
    uid = metadata.get("uid")
    release_pods(rt, namespace, [pod for pod in pods if _controller_uids(pod) <= {uid}])  # not a newer attempt's
    release_job(rt, namespace, name, snapshot=snapshot, delivered=False)
    rt.kube.delete_job(namespace, name, propagation="Background", uid=uid)
    create_jobs_for(rt, [record.dispatch_id], reruns={record.dispatch_id: Rerun(record.attempts, again.attempts)})
    return CompleteOutcome.RERUN


# --- a Job whose container never starts ---------------------------------------------------


def pending_pods(rt: Runtime, namespace: str, dispatch_ids: Sequence[str]) -> list[dict[str, Any]]:
    """Our Pending Pods of these dispatches in one namespace: ONE LIST per SELECTOR_CHUNK ids (a
    label selector on our deployment and the dispatch ids, a field selector on the phase), so a
    sweep's page of unstarted Jobs costs one request."""
    ids = sorted(set(dispatch_ids))
    base = job_labels.selector(rt.settings.effective_deployment)
    pods: list[dict[str, Any]] = []
    for start in range(0, len(ids), SELECTOR_CHUNK):
        selector = f"{base},{job_labels.DISPATCH_ID_KEY} in ({','.join(ids[start : start + SELECTOR_CHUNK])})"
        for page in rt.kube.iter_pods(
            namespace, label_selector=selector, field_selector=PENDING_PODS, page_size=rt.settings.poll_page_size
        ):
            pods.extend(page)
    return pods


PENDING_PODS = "status.phase=Pending"


def fail_unstarted(
    rt: Runtime,
    namespace: str,
    name: str,
    *,
    dispatch_id: str,
    attempts: int,
    snapshot: Mapping[str, Any],
    decide: Callable[[list[dict[str, Any]], list[dict[str, Any]]], Verdict],
) -> Verdict | None:
    """Give up on a Job whose container never started: WORKER_FAILED with the cause `decide`
    names (the one terminal-event path: `fail_dispatch`), with the failure's structured detail
    (the Pod's state, the Job's and its Pods' Warning Events), then the Job released and deleted,
    which stops its Pods; the verdict if this call recorded it, else None.

    `decide(pods, events)` judges the Job; the Warning Events are read (one LIST for the Job and
    one per Pod, with field selectors) only once it says to give up, and it is asked again with
    them, so a Job whose Pods were refused ends with the controller's FailedCreate.

    Under the dispatch's guard claim, the row must still be CREATED with the `attempts` counted
    when planned; the Job's Pods are read again, every phase (a Pod that started since the
    Pending LIST, or whose start the Job's status had not counted yet, says wait), and `decide`
    judges them. A crash after the event leaves the Job to the sweep's clean-up (category 4).

    Raises:
        Transient: the API, database or Redis is unavailable; the next sweep tries again.
    """
    claim = rt.guard.claim(dispatch_id)
    if claim is None:
        return None  # another replica is delivering it
    try:
        record = load_record(rt, dispatch_id)
        if record is None or record.state is not DispatchState.CREATED or record.attempts != attempts:
            return None
        pods = pods_by_job(rt, namespace, [name])[name]
        if not decide(pods, []).fail:
            return None
        events = _warnings_about(rt, namespace, [name, *(_pod_name(pod) for pod in pods)])
        verdict = decide(pods, events)
        if not verdict.fail:
            return None
        log.warning(
            "dispatch %s: job %s/%s never started its container: %s: %s",
            dispatch_id, namespace, name, verdict.reason, verdict.message,
        )  # fmt: skip
        detail = failure_detail.detail(snapshot, pods[0] if pods else None, events=events)
        reason = verdict.reason or "StartTimeout"
        if not fail_dispatch(rt, dispatch_id, reason=reason, message=verdict.message, detail=detail):
            return None
    finally:
        rt.guard.release(claim)
    release_pods(rt, namespace, pods)
    release_job(rt, namespace, name, snapshot=snapshot)
    rt.kube.delete_job(namespace, name, propagation="Background", uid=(snapshot.get("metadata") or {}).get("uid"))
    return verdict


def _warnings_about(rt: Runtime, namespace: str, names: Sequence[str]) -> list[dict[str, Any]]:
    """The Warning Events whose object is one of `names` (a Job, its Pods); none if unreadable."""
    events: list[dict[str, Any]] = []
    try:
        for name in dict.fromkeys(n for n in names if n):
            selector = f"involvedObject.name={name},type={failure_detail.WARNING}"
            for page in rt.kube.iter_events(namespace, field_selector=selector):
                events += page
    except DispatchError as e:
        log.info("the warning events of %s/%s could not be read (%s)", namespace, names[0], e.reason)
    return events


def _pod_name(pod: Mapping[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("name") or "")


# --- notify, cancel, clean up -----------------------------------------------------------


def notify_engine(rt: Runtime, dispatch_id: str) -> bool:
    """Tell the engine a dispatch ended, then record that it was told; False if not sent."""
    return dispatch_id in notify_engines(rt, [dispatch_id])


def notify_engines(rt: Runtime, dispatch_ids: Sequence[str]) -> set[str]:
    """Tell the engine these dispatches ended, then record (in one transaction) that it was
    told; the ids sent.

    Called after the terminal events committed. A send that fails (or a process with no
    notifier) leaves the dispatch unnotified, and the sweep notifies it later: at least once.
    """
    if rt.on_ended is not None and dispatch_ids:
        rt.on_ended(dispatch_ids)  # their slots are free: admission may run
    if rt.notifier is None:
        return set()
    sent: list[str] = []
    for dispatch_id in dispatch_ids:
        try:
            rt.notifier(dispatch_id)
        except Transient as e:
            log.warning("could not notify the engine of dispatch %s (%s); the sweep will retry", dispatch_id, e)
            continue
        sent.append(dispatch_id)
    if sent:
        with transaction(rt.sessions) as session:
            dispatches.mark_notified_many(session, sent)
        rt.stats.incr(stats.NOTIFICATIONS_SENT, len(sent))
    return set(sent)


def fail_dispatch(
    rt: Runtime, dispatch_id: str, *, reason: str, message: str | None = None, detail: Mapping[str, Any] | None = None
) -> bool:
    """Record WORKER_FAILED with `reason` (e.g. JobLost), and `detail` if given, and notify the
    engine; False if the dispatch had ended already.

    Raises:
        UnknownDispatch: no such dispatch.
    """
    payload: dict[str, Any] = {"reason": reason} if message is None else {"reason": reason, "message": message}
    if detail is not None:
        payload["detail"] = dict(detail)
    with transaction(rt.sessions) as session:
        won = dispatches.record_terminal(session, dispatch_id, EventType.WORKER_FAILED, payload)
        row = dispatches.get_dispatch(session, dispatch_id)
    if won:
        assert row is not None  # record_terminal found and updated it in this transaction
        statelog.dispatch_changed(row, DispatchState.FAILED, reason=reason)
        notify_engine(rt, dispatch_id)
    return won


def cancel_dispatch(rt: Runtime, dispatch_id: str, *, reason: str = CANCELLED_REASON, recorded: bool = False) -> bool:
    """Record WORKER_CANCELLED and remove the Job; False if the dispatch had ended already.

    A completion racing the cancel leaves exactly one terminal event: whichever commits first.
    `recorded`: the cancel was written already (`tasks.scheduling.cancel_in_session`, whose
    message this is): only notify the engine, unless it was, and remove the Job.

    Raises:
        InvalidId: `dispatch_id` is not a UUID.
        UnknownDispatch: no such dispatch.
    """
    check_dispatch_id(dispatch_id)
    with transaction(rt.sessions) as session:
        row = dispatches.get_dispatch(session, dispatch_id)
        if row is None:
            raise UnknownDispatch(f"dispatch {dispatch_id} does not exist")
        record = DispatchRecord.from_row(row)
        won = not recorded and dispatches.record_terminal(
            session, dispatch_id, EventType.WORKER_CANCELLED, {"reason": reason}
        )
    if won:
        statelog.dispatch_changed(record, DispatchState.CANCELLED, reason=reason)
    if won or (recorded and record.state is DispatchState.CANCELLED and not record.notified):
        notify_engine(rt, dispatch_id)
    cleanup_job(rt, *job_location(rt, record))
    return won


def cleanup_job(
    rt: Runtime, namespace: str, name: str, *, snapshot: Mapping[str, Any] | None = None, delivered: bool = True
) -> None:
    """Release a Job that may still run (a cancelled dispatch's, an orphan) and its Pods, and
    delete it now, which stops it; idempotent. Released first, so that if the DELETE fails, a
    delivered Job is left to the next bulk delete (an orphan, `delivered=False`, to the next
    sweep). A Pod the Job controller creates after the Pods' LIST is freed by the sweep.
    """
    release_pods(rt, namespace, pods_by_job(rt, namespace, [name])[name])
    release_job(rt, namespace, name, snapshot=snapshot, delivered=delivered)
    rt.kube.delete_job(namespace, name, propagation="Background")


def release_job(
    rt: Runtime, namespace: str, name: str, *, snapshot: Mapping[str, Any] | None = None, delivered: bool = True
) -> bool:
    """The clean-up after a recorded end, in ONE patch: our finalizer off, the delivered label on
    (`KubeClient.release_job`, exact by uid); the bulk delete (`delete_delivered`) then removes it.

    `snapshot` is the Job as last read, so no GET is needed; without it the Job is read first.
    `delivered=False` (an orphan: no dispatch of its own ended) only takes the finalizer off.
    """
    label = (job_labels.DELIVERED_LABEL, job_labels.DELIVERED) if delivered else None
    return rt.kube.release_job(namespace, name, finalizer=FINALIZER, label=label, snapshot=snapshot)


def release_pods(rt: Runtime, namespace: str, pods: Iterable[Mapping[str, Any]]) -> int:
    """Take our finalizer off Pods as a LIST read them, one patch per Pod that has it (none for
    the rest); how many this call freed. Called once their result is recorded, or not wanted."""
    return sum(
        rt.kube.release_pod(namespace, pod, finalizer=FINALIZER)
        for pod in pods
        if FINALIZER in ((pod.get("metadata") or {}).get("finalizers") or [])
    )


def delete_delivered(rt: Runtime, namespace: str) -> int:
    """Delete every delivered Job of this deployment in the namespace, their Pods in the
    background: ONE request (another deployment's Jobs are never selected).

    A failure here loses nothing: the next batch's bulk delete, or the sweep's, removes them.
    """
    selector = job_labels.delivered_selector(rt.settings.effective_deployment)
    return rt.kube.delete_jobs(namespace, label_selector=selector, propagation="Background")


def label_deployment(rt: Runtime, namespace: str, name: str, *, snapshot: Mapping[str, Any]) -> bool:
    """Put this deployment's label on a Job of its own made before the label existed (one
    patch, exact by the snapshot's uid): from then on poll, sweep and bulk delete select it."""
    label = (job_labels.DEPLOYMENT_LABEL, rt.settings.effective_deployment)
    return rt.kube.label_job(namespace, name, label=label, snapshot=snapshot)


def delete_delivered_later(rt: Runtime, namespace: str) -> None:
    """Leave the bulk delete of the Jobs just released in `namespace` to the next cleanup
    (`delete_noted`, beat's `cleanup` task), with a note in Redis: one bulk delete per cleanup
    interval, not one per batch. Where Redis cannot take the note, the bulk delete is made now (a failure of it only
    logged: the sweep's removes those Jobs)."""
    try:
        rt.redis.set(_noted_key(rt, namespace), "1")
        return
    except redis.RedisError as e:
        log.info("could not note delivered jobs in %s for the next cleanup (%s); deleting them now", namespace, e)
    try:
        delete_delivered(rt, namespace)
    except Transient as e:
        log.warning("bulk delete of delivered jobs in %s failed (%s); the sweep's removes them", namespace, e)


def delete_noted(rt: Runtime, namespace: str) -> int:
    """Cleanup's bulk delete: the delivered Jobs of `namespace`, if any were noted since the last
    one (`delete_delivered_later`); how many. A failure is logged and the note put back.

    Raises:
        redis.RedisError: Redis is unavailable (cleanup stops, as on any Redis error).
    """
    if not rt.redis.getdel(_noted_key(rt, namespace)):
        return 0
    try:
        return delete_delivered(rt, namespace)
    except Transient as e:
        log.warning("bulk delete of delivered jobs in %s failed (%s); the next cleanup tries again", namespace, e)
        rt.redis.set(_noted_key(rt, namespace), "1")
        return 0


def _noted_key(rt: Runtime, namespace: str) -> str:
    return f"{rt.settings.key_prefix}:delivered:{namespace}"
