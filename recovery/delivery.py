"""The single delivery path: create a dispatch's Job, complete it, cancel it, clean up after it.

Plain functions of a `Runtime` and ids, called by the Celery tasks and, inline, by the
recovery sweep: a completion after a restart takes exactly the path a normal one does. Each
step is idempotent (deterministic Job names, a guarded completion, a unique terminal event),
so any of them may run twice, concurrently, or again after a crash at any line.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from engine import store
from engine.db import transaction
from engine.errors import (
    AlreadyExists,
    ApiRejected,
    Conflict,
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
from engine.models import STATE_FOR_TERMINAL_EVENT, DispatchState, EventType
from recovery import statelog, stats
from recovery.crashpoints import Point, crashpoint
from recovery.metrics import METRICS
from recovery.reconstruct import DeliveryContext, DispatchRecord, context_from_job
from recovery.runtime import Runtime
from workers import labels as job_labels
from workers.job_status import Completion, completion, job_state
from workers.manifest import FINALIZER, build_job, job_name

log = logging.getLogger(__name__)

JOB_NAME_LABEL = "batch.kubernetes.io/job-name"  # set by the Job controller on the Job's Pods
CANCELLED_REASON = "Cancelled"


class CreateOutcome(StrEnum):
    CREATED = "created"  # this call created the Job
    ADOPTED = "adopted"  # the Job existed (a retry, a duplicate message) and its labels agree
    SKIPPED = "skipped"  # the dispatch is terminal already: no Job is needed
    FAILED = "failed"  # refused for good (API 4xx, invalid manifest, foreign Job): WORKER_FAILED


class CompleteOutcome(StrEnum):
    COMPLETED = "completed"  # this call wrote the terminal event
    ALREADY_TERMINAL = "already_terminal"  # recorded before or by a racing writer; cleaned up
    RUNNING = "running"  # the Job has not finished
    CLAIMED_ELSEWHERE = "claimed_elsewhere"  # another replica holds the guard for it
    REFUSED = "refused"  # labels unreadable or disagreeing with the DB: never delivered
    GONE = "gone"  # no such Job


# --- reading ----------------------------------------------------------------------------


def load_record(rt: Runtime, dispatch_id: str) -> DispatchRecord | None:
    """The dispatch's row as a snapshot, or None if there is no such dispatch."""
    with transaction(rt.sessions) as session:
        row = store.get_dispatch(session, dispatch_id)
        return DispatchRecord.from_row(row) if row is not None else None


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
    """Create the dispatch's Job (attempt = the row's `attempts`), or adopt the one there.

    Raises:
        InvalidId: `dispatch_id` is not a UUID.
        UnknownDispatch: no such dispatch.
        Transient: the API, database or broker is unavailable; the same call may be retried.
    """
    store.check_dispatch_id(dispatch_id)
    record = load_record(rt, dispatch_id)
    if record is None:
        raise UnknownDispatch(f"dispatch {dispatch_id} does not exist")
    if record.terminal:
        return CreateOutcome.SKIPPED
    try:
        spec = rt.resolver.spec(record.capability)
        body = build_job(record.ref, input=record.input, spec=spec, namespace=rt.settings.namespace, attempt=record.attempts)
    except (UnknownCapability, InvalidManifest, InvalidInput) as e:
        # The config changed since scheduling, or the row holds what no Job can carry.
        return _fail(rt, record, e)
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]

    crashpoint(Point.BEFORE_JOB_CREATE)
    outcome = CreateOutcome.CREATED
    try:
        rt.kube.create_job(namespace, body)
    except AlreadyExists:
        outcome = _adopt(rt, record, namespace=namespace, name=name)
        if outcome is CreateOutcome.FAILED:
            return outcome
    except (ApiRejected, InvalidManifest, NotFound) as e:
        # 400/403/422 (and 404: the namespace does not exist): the API's reason and message.
        return _fail(rt, record, e)
    crashpoint(Point.AFTER_JOB_CREATE)

    with transaction(rt.sessions) as session:
        marked = store.mark_created(session, dispatch_id, job_name=name, namespace=namespace, attempt=record.attempts)
    if marked and (record.state is DispatchState.SCHEDULED or outcome is CreateOutcome.CREATED):
        statelog.dispatch_changed(record, DispatchState.CREATED, job=f"{namespace}/{name}", attempt=record.attempts)
    if not marked:
        # Ended (cancelled) while we were creating: the Job is not wanted, and nothing else
        # would delete a Job that is still running.
        cleanup_job(rt, namespace, name)
    return outcome


def _adopt(rt: Runtime, record: DispatchRecord, *, namespace: str, name: str) -> CreateOutcome:
    """A Job with the dispatch's name exists: adopt it if its labels say it is this dispatch's."""
    try:
        job = rt.kube.get_job(namespace, name)
    except NotFound as e:
        # Deleted between our create and our read (a clean-up racing us): create again.
        raise Conflict(f"job {namespace}/{name} existed, then vanished; creating it again") from e
    try:
        context_from_job(job, record, expected_namespace=namespace)
    except (LabelMismatch, TenancyMismatch, UnknownDispatch) as e:
        _refuse(rt, job, e)
        return _fail(rt, record, LabelMismatch(f"a Job named {name} exists but is not this dispatch's: {e}"))
    log.info("adopted existing job %s/%s for dispatch %s", namespace, name, record.dispatch_id)
    return CreateOutcome.ADOPTED


def _fail(rt: Runtime, record: DispatchRecord, error: Permanent) -> CreateOutcome:
    log.warning("dispatch %s failed before its job ran: %s: %s", record.dispatch_id, error.reason, error)
    fail_dispatch(rt, record.dispatch_id, reason=error.reason, message=str(error))
    return CreateOutcome.FAILED


# --- complete ---------------------------------------------------------------------------


def complete_job(rt: Runtime, namespace: str, name: str) -> CompleteOutcome:
    """Deliver a finished Job's result: the one completion path, normal or after a restart.

    Rebuilds the context from the Job's labels and the DB (refusing any disagreement), claims
    the guard, reads the result from the Job's Pods, writes the terminal event in its own
    transaction, notifies the engine if this call won, then removes our finalizer and deletes
    the Job.

    Raises:
        Transient: the API, database or Redis is unavailable; the same call may be retried.
    """
    try:
        job = rt.kube.get_job(namespace, name)
    except NotFound:
        return CompleteOutcome.GONE
    context = _context(rt, job)
    if context is None:
        return CompleteOutcome.REFUSED
    if context.record.terminal:
        cleanup_job(rt, namespace, name)
        return CompleteOutcome.ALREADY_TERMINAL
    if not job_state(job).terminal:
        return CompleteOutcome.RUNNING

    claim = rt.guard.claim(context.dispatch_id)
    if claim is None:
        return CompleteOutcome.CLAIMED_ELSEWHERE
    try:
        pods = rt.kube.list_pods(namespace, label_selector=f"{JOB_NAME_LABEL}={name}")
        done = completion(job, pods)
        if done is None:  # not terminal after all (the same rule as job_state): poll again later
            return CompleteOutcome.RUNNING
        event, payload = terminal_event(done)
        crashpoint(Point.BEFORE_COMPLETE_WRITE)
        with transaction(rt.sessions) as session:
            won = store.record_terminal(session, context.dispatch_id, event, payload)
        crashpoint(Point.AFTER_COMPLETE_WRITE)
        if won:
            rt.stats.incr(stats.COMPLETIONS_WRITTEN)
            statelog.dispatch_changed(context.record, STATE_FOR_TERMINAL_EVENT[event], reason=payload.get("reason"))
            notify_engine(rt, context.dispatch_id)
        else:
            METRICS.duplicate_prevented(by="database")
        cleanup_job(rt, namespace, name)
    finally:
        rt.guard.release(claim)
    return CompleteOutcome.COMPLETED if won else CompleteOutcome.ALREADY_TERMINAL


def terminal_event(done: Completion) -> tuple[EventType, dict[str, Any]]:
    """The event type and payload a Job's completion records."""
    if done.succeeded:
        return EventType.WORKER_COMPLETED, {"output": done.output}
    payload: dict[str, Any] = {"reason": done.reason}
    if done.detail:
        payload["message"] = done.detail
    return EventType.WORKER_FAILED, payload


def _context(rt: Runtime, job: Mapping[str, Any]) -> DeliveryContext | None:
    """The Job matched to its dispatch, or None (logged and counted) when it must not be delivered."""
    metadata = job.get("metadata") or {}
    try:
        ref = job_labels.decode(metadata.get("labels"), metadata.get("annotations"))
        record = load_record(rt, ref.dispatch_id)
        expected = None
        if record is not None and record.job_namespace is None:
            expected = job_location(rt, record)[0]
        return context_from_job(job, record, expected_namespace=expected)
    except (LabelMismatch, TenancyMismatch, UnknownDispatch) as e:
        _refuse(rt, job, e)
        return None


def _refuse(rt: Runtime, job: Mapping[str, Any], error: Permanent) -> None:
    metadata = job.get("metadata") or {}
    log.warning(
        "never delivering job %s/%s: %s: %s", metadata.get("namespace"), metadata.get("name"), error.reason, error
    )
    rt.stats.incr(stats.JOBS_REFUSED)


# --- notify, cancel, clean up -----------------------------------------------------------


def notify_engine(rt: Runtime, dispatch_id: str) -> bool:
    """Tell the engine a dispatch ended, then record that it was told; False if not sent.

    Called after the terminal event committed. A send that fails (or a process with no
    notifier) leaves the dispatch unnotified, and the sweep notifies it later: at least once.
    """
    if rt.notifier is None:
        return False
    try:
        rt.notifier(dispatch_id)
    except Transient as e:
        log.warning("could not notify the engine of dispatch %s (%s); the sweep will retry", dispatch_id, e)
        return False
    with transaction(rt.sessions) as session:
        store.mark_notified(session, dispatch_id)
    rt.stats.incr(stats.NOTIFICATIONS_SENT)
    return True


def fail_dispatch(rt: Runtime, dispatch_id: str, *, reason: str, message: str | None = None) -> bool:
    """Record WORKER_FAILED with `reason` (e.g. JobLost) and notify the engine; False if the
    dispatch had ended already.

    Raises:
        UnknownDispatch: no such dispatch.
    """
    payload = {"reason": reason} if message is None else {"reason": reason, "message": message}
    with transaction(rt.sessions) as session:
        won = store.record_terminal(session, dispatch_id, EventType.WORKER_FAILED, payload)
        row = store.get_dispatch(session, dispatch_id)
    if won:
        statelog.dispatch_changed(row, DispatchState.FAILED, reason=reason)
        notify_engine(rt, dispatch_id)
    return won


def cancel_dispatch(rt: Runtime, dispatch_id: str, *, reason: str = CANCELLED_REASON) -> bool:
    """Record WORKER_CANCELLED and remove the Job; False if the dispatch had ended already.

    A completion racing the cancel leaves exactly one terminal event: whichever commits first.

    Raises:
        InvalidId: `dispatch_id` is not a UUID.
        UnknownDispatch: no such dispatch.
    """
    store.check_dispatch_id(dispatch_id)
    with transaction(rt.sessions) as session:
        row = store.get_dispatch(session, dispatch_id)
        if row is None:
            raise UnknownDispatch(f"dispatch {dispatch_id} does not exist")
        record = DispatchRecord.from_row(row)
        won = store.record_terminal(session, dispatch_id, EventType.WORKER_CANCELLED, {"reason": reason})
    if won:
        statelog.dispatch_changed(record, DispatchState.CANCELLED, reason=reason)
        notify_engine(rt, dispatch_id)
    cleanup_job(rt, *job_location(rt, record))
    return won


def cleanup_job(rt: Runtime, namespace: str, name: str) -> None:
    """Remove our finalizer and delete the Job (its Pods in the background); idempotent."""
    rt.kube.remove_finalizer(namespace, name, FINALIZER)
    rt.kube.delete_job(namespace, name, propagation="Background")
