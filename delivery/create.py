"""Create a dispatch's Job, or adopt the one there: one Job per attempt, by construction.

Creates run under their dispatches' row locks, from the read that decides until what was made
is marked (`create_jobs_for`): a terminal event takes that lock too, so no dispatch can end, and
have its Job delivered and deleted, between a create's read and its POST. The Job's name is
derived from the dispatch id, so a retried or duplicated create meets a 409 and adopts the Job
after checking its labels.

A secret input's Job gets its input from a Secret made right after the Job (its ownerReference
needs the Job's uid): the kubelet holds the container back until the Secret exists, and a create
that stopped between the two (a crash, a 5xx) is completed by the retry that adopts the Job.
An input too large for the env is written to the object store first (`artifacts.inputs`), as
are a map's inputs beyond a few KiB.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from sqlalchemy.orm import Session

from k8s_dispatch import artifacts
from k8s_dispatch.artifacts.inputs import input_download, items_download
from k8s_dispatch.core.errors import (
    AlreadyExists,
    ApiRejected,
    ConfigError,
    Conflict,
    InvalidInput,
    InvalidManifest,
    LabelMismatch,
    NotFound,
    Permanent,
    SecretInputUnreadable,
    TenancyMismatch,
    Transient,
    UnknownCapability,
    UnknownDispatch,
)
from k8s_dispatch.core.ids import check_dispatch_id
from k8s_dispatch.core.payloads import canonical_json
from k8s_dispatch.delivery import items, queue_clock, statelog, terminal
from k8s_dispatch.delivery.cleanup import cleanup_job, label_deployment
from k8s_dispatch.delivery.crashpoints import Point, crashpoint
from k8s_dispatch.delivery.reconstruct import DispatchRecord, context_from_job
from k8s_dispatch.delivery.records import refuse_job
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.store import dispatches, maps
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import DispatchState, EventType
from k8s_dispatch.store.secret_inputs import unseal
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.indexed import indexed_job
from k8s_dispatch.workers.manifest import build_job, input_secret, job_name
from k8s_dispatch.workers.pod_health import QUEUE_TIMEOUT

log = logging.getLogger(__name__)


class CreateOutcome(StrEnum):
    CREATED = "created"  # this call created the Job
    ADOPTED = "adopted"  # the Job existed (a retry, a duplicate message) and its labels agree
    SKIPPED = "skipped"  # the dispatch is terminal already: no Job is needed
    QUEUED = "queued"  # the dispatch waits for a slot (store/admission.py): no Job yet
    FAILED = "failed"  # refused for good (API 4xx, invalid manifest, foreign Job): WORKER_FAILED
    ENDED = "ended"  # a map whose every item has ended, its Job gone: its terminal event, no Job


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
    # Adopted out of our selectors (`delivered=true` put on by hand before the row was marked):
    # no LIST or watch event of ours will show it, so the row notes it as hand-edited.
    hidden: bool = False


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
    ends: dict[str, tuple[DispatchRecord, dispatches.TerminalEvent]] = {}
    stopped: Exception | None = None
    with transaction(rt.sessions) as session:
        rows = dispatches.lock_dispatch_rows(session, ids)
        records = _with_namespaces(rt, session, {d: DispatchRecord.from_row(row) for d, row in rows.items()})
        # Map dispatches (store/maps.py) among them, with their items: each one Indexed Job.
        shapes = maps.map_shapes(session, [d for d, r in records.items() if not r.terminal], inputs=True)
        for dispatch_id in ids:
            record = records.get(dispatch_id)
            if record is None:
                log.warning("no dispatch %s: no Job to create", dispatch_id)
                continue
            shape = shapes.get(dispatch_id)
            if shape is not None and not shape.open_items and record.state is not DispatchState.QUEUED:
                # Its Job lost after its last item was recorded: the map ends as its Job would have.
                counts = maps.item_counts(session, dispatch_id)
                outcomes[dispatch_id] = CreateOutcome.ENDED
                ends[dispatch_id] = (record, items.map_event(dispatch_id, {}, shape, counts))
                continue
            try:
                step = _create(rt, record, reruns.get(dispatch_id), shape, sealed=rows[dispatch_id].secret_input)
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
                reason, message = step.failure
                payload = {"reason": reason, "message": message}
                ends[dispatch_id] = (record, dispatches.TerminalEvent(dispatch_id, EventType.WORKER_FAILED, payload))
        marked = dispatches.mark_created_many(
            session, [dispatches.CreatedJob(m.record.dispatch_id, m.name, m.namespace, m.attempt) for m in made]
        )
        for m in made:
            if m.hidden and m.record.dispatch_id in marked:  # with its mark: the sweep reads it by name
                dispatches.note_job_tampered(session, m.record.dispatch_id)
        ended = terminal.record(session, [event for _, event in ends.values()])
    _after_creates(rt, made, marked, [ends[d] for d in sorted(ended)])
    if stopped is not None:
        raise stopped
    return outcomes


def _after_creates(
    rt: Runtime, made: list[_Made], marked: set[str], ended: list[tuple[DispatchRecord, dispatches.TerminalEvent]]
) -> None:
    """After the create transaction committed: log the state changes, tell the engine of the
    dispatches it failed. A made Job whose row was not marked (it cannot end while locked, so
    only a row gone meanwhile) is deleted: nothing would deliver it."""
    for m in made:
        if m.record.dispatch_id not in marked:
            cleanup_job(rt, m.namespace, m.name)
        elif m.record.state is DispatchState.SCHEDULED or m.outcome is CreateOutcome.CREATED:
            statelog.dispatch_changed(m.record, DispatchState.CREATED, job=f"{m.namespace}/{m.name}", attempt=m.attempt)
    for record, event in ended:
        log.warning("dispatch %s ended %s with no job of it running: %s", record.dispatch_id, event.type, event.payload)
    terminal.announce(rt, ended)


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


def _create(
    rt: Runtime,
    record: DispatchRecord,
    rerun: Rerun | None = None,
    shape: maps.MapShape | None = None,
    *,
    sealed: str | None = None,
) -> _Step:
    """Create (or adopt) one dispatch's Job, in the namespace its row records; called with its
    row locked, writes nothing to the database (the caller records what it returns). `sealed`:
    the row's secret input (a Fernet token), opened here for the Job's Secret alone."""
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
        secret_text = unseal(sealed, rt.settings.input_key) if sealed is not None else None
        # An input too large for the env: written to the object store (again, by a later attempt:
        # the same bytes), the Job given a URL that reads it and its reference.
        download = (
            None
            if secret_text is not None
            else input_download(
                artifacts.for_settings(rt.settings),
                spec,
                dispatch_id=record.dispatch_id,
                text=canonical_json(record.input),
                max_inline_bytes=rt.settings.max_input_bytes,
            )
        )
        body = build_job(
            record.ref,
            input=record.input,
            spec=spec,
            namespace=rt.settings.namespace,
            deployment=rt.settings.effective_deployment,
            attempt=attempt,
            # This attempt's key and presigned PUT URL (signed locally, no request), for a
            # capability whose results go to the object store; None for the others.
            result_upload=artifacts.result_upload(
                artifacts.for_settings(rt.settings), spec, dispatch_id=record.dispatch_id, attempt=attempt
            ),
            input_download=download,
            secret_input=secret_text is not None,
        )
        if shape is not None:  # a map: its Job made Indexed, one Pod per item (workers/indexed.py)
            # Its open items only: a lost Job made again never runs an item that has ended.
            body = indexed_job(
                body,
                inputs=shape.inputs,
                item_indexes=shape.open_items,
                parallelism=shape.parallelism,
                max_failed_items=None if shape.failures_left is None else min(shape.failures_left, len(shape.inputs)),
                # More than a few KiB of inputs and an object store: packed in one object there
                # (written once per set of items), each Pod reading its own item only.
                items_download=items_download(
                    artifacts.for_settings(rt.settings), spec, dispatch_id=record.dispatch_id, inputs=shape.inputs
                ),
            )
    except UnknownCapability as e:
        # Removed from the config since scheduling: a Job made before still runs and is
        # delivered; with none, the dispatch fails with that reason.
        return _adopt_or_fail(rt, record, e)
    except (InvalidManifest, InvalidInput, ConfigError, SecretInputUnreadable) as e:
        # The config changed since scheduling, or the row holds what no Job can carry (a secret
        # input no configured key opens, a large input and no object store now).
        return _failed(e)
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]

    crashpoint(Point.BEFORE_JOB_CREATE)
    try:
        created = rt.kube.create_job(namespace, body)
    except AlreadyExists:
        return _adopt(rt, record, namespace=namespace, name=name, attempt=attempt, secret_text=secret_text)
    except (ApiRejected, InvalidManifest, NotFound) as e:
        # 400/403/422 (and 404: the namespace does not exist): the API's reason and message.
        return _failed(e)
    if secret_text is not None:
        failure = _ensure_secret(rt, created, secret_text)
        if failure is not None:
            return failure
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


def _ensure_secret(rt: Runtime, job: dict[str, Any], text: str) -> _Step | None:
    """Make the Job's secret-input Secret, owned by `job`; None once it is there. A Secret of
    that name owned by another Job (an earlier attempt's, which the garbage collector has not
    removed yet) is waited out: Conflict, and the retry adopts the Job and makes it then.

    Raises:
        Conflict: an earlier Job's Secret is still there.
        Transient: the API is unavailable.
    """
    body = input_secret(job, text=text)
    meta = body["metadata"]
    try:
        rt.kube.create_secret(meta["namespace"], body)
        return None
    except AlreadyExists:
        pass
    except (ApiRejected, InvalidManifest, NotFound) as e:
        # Refused for good (no RBAC right on Secrets, a cluster that serves none): the dispatch
        # fails; its Job, whose container waits for the Secret, is stopped as any failed one's.
        return _failed(e)
    try:
        owners = rt.kube.get_secret_owners(meta["namespace"], meta["name"])
    except NotFound as e:  # deleted between the two: make it on the retry
        raise Conflict(f"secret {meta['namespace']}/{meta['name']} vanished; making it again") from e
    if meta["ownerReferences"][0]["uid"] not in owners:
        raise Conflict(
            f"secret {meta['namespace']}/{meta['name']} belongs to an earlier Job; made once the garbage collector removed it"
        )
    return None


def _adopt(
    rt: Runtime,
    record: DispatchRecord,
    *,
    namespace: str,
    name: str,
    attempt: int,
    secret_text: str | None = None,
) -> _Step:
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
        refuse_job(rt, job, e)
        return _failed(LabelMismatch(f"a Job named {name} exists but is not this dispatch's: {e}"))
    labels = (job.get("metadata") or {}).get("labels") or {}
    if job_labels.deployment_of(labels) is None:
        label_deployment(rt, namespace, name, snapshot=job)
        labels = {**labels, job_labels.DEPLOYMENT_LABEL: rt.settings.effective_deployment}
    if context.deleting and context.attempt < attempt:
        # An earlier attempt's Job on its way out (a lost result's re-run deleted it): adopting
        # it would count an attempt that never ran. Create this one once that one is gone.
        raise Conflict(f"job {namespace}/{name} of attempt {context.attempt} is being deleted; "
                       f"attempt {attempt} is created once it is gone")  # fmt: skip
    if secret_text is not None and not context.deleting:  # a create stopped before its Secret
        failure = _ensure_secret(rt, job, secret_text)
        if failure is not None:
            return failure
    hidden = job_labels.is_hidden(labels, rt.settings.effective_deployment)
    if hidden:
        log.warning("adopted job %s/%s for dispatch %s, out of our selectors (edited by hand): noted for the "
                    "sweep, which delivers it by name once it finishes", namespace, name, record.dispatch_id)  # fmt: skip
    else:
        log.info("adopted existing job %s/%s for dispatch %s", namespace, name, record.dispatch_id)
    made = _Made(record, CreateOutcome.ADOPTED, namespace, name, context.attempt, hidden=hidden)
    return _Step(CreateOutcome.ADOPTED, made)
