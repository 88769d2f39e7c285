"""The engine's entries: schedule and cancel dispatches inside the caller's own transaction.

`schedule_in_session` / `schedule_many_in_session` write the dispatches with
`store.dispatches.schedule_many` and send `create_jobs` only once that transaction commits (nothing
if it rolls back): every dispatch the transaction wrote, by any number of calls, in messages of
up to CREATE_BATCH ids, so a worker pays its per-message and per-transaction costs once per
batch; the commits of several threads share messages too (`tasks/outbox.py`).
`cancel_in_session` records the cancel itself in the transaction (durable: the sweep honours it
if its message is lost) and sends `cancel` after commit to delete the Job at once.
`send_schedule_until_recorded` is the task-call path made safe against a broker that loses
messages. Light on purpose: an engine process or the CLI imports it without the Kubernetes
client or the delivery machinery.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from celery import Celery
from kombu.exceptions import OperationalError
from pydantic import SecretStr
from sqlalchemy import event
from sqlalchemy.orm import Session, SessionTransaction, sessionmaker

from k8s_dispatch import celeryconfig as names
from k8s_dispatch.core.errors import DatabaseUnavailable, ScheduleNotRecorded
from k8s_dispatch.core.ids import check_dispatch_id
from k8s_dispatch.core.payloads import canonical_json
from k8s_dispatch.delivery import statelog, terminal
from k8s_dispatch.delivery.crashpoints import Point, crashpoint
from k8s_dispatch.store import dispatches, scheduling
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import DispatchState, EventType
from k8s_dispatch.store.secret_inputs import seal
from k8s_dispatch.tasks.app import app
from k8s_dispatch.tasks.outbox import Outbox

log = logging.getLogger(__name__)

_PENDING_KEY = "k8s_dispatch.pending_create_job"
# Dispatch ids per `create_jobs` message. A worker's thread creates a message's Jobs one after
# the other, so a batch is also the unit of parallelism: 50 keeps a fan-out of hundreds spread
# over the worker's threads while the per-message costs (broker round trips, the records' read,
# the one marking transaction) are paid once per 50 Jobs (the `dispatch_throughput` benchmark
# compares batch sizes side by side: docs/benchmarks/).
CREATE_BATCH = 50
CANCELLED_REASON = "Cancelled"  # as delivery.cancel's, the reason a cancel records by default


def schedule_in_session(
    session: Session,
    *,
    case_id: str,
    tenancy_id: str,
    capability: str,
    input: Any,
    idempotency_key: str,
    router: scheduling.CapabilityRouter,
    max_input_bytes: int,
    dispatch_id: str | None = None,
    priority: int = 0,
    secret: bool = False,
    input_key: SecretStr | None = None,
    max_stored_input_bytes: int | None = None,
    via: Celery | None = None,
    now: Any = None,
) -> scheduling.ScheduleResult:
    """`store.dispatches.schedule` inside the caller's transaction; `create_jobs` is sent after commit.

    Takes `scheduling.schedule`'s keyword arguments: `schedule_many_in_session` for one request.
    `secret=True` keeps the input sealed under `input_key` (`Settings.input_key`), out of the
    event log, the Job and every message; `max_stored_input_bytes`
    (`Settings.max_stored_input_bytes`) admits inputs larger than the env, kept in the object store.
    """
    request = scheduling.ScheduleRequest(
        case_id=case_id,
        tenancy_id=tenancy_id,
        capability=capability,
        input=input,
        idempotency_key=idempotency_key,
        dispatch_id=dispatch_id,
        priority=priority,
        secret=secret,
    )
    (result,) = schedule_many_in_session(
        session,
        [request],
        router=router,
        max_input_bytes=max_input_bytes,
        input_key=input_key,
        max_stored_input_bytes=max_stored_input_bytes,
        via=via,
        now=now,
    )
    return result


def schedule_many_in_session(
    session: Session,
    requests: Sequence[scheduling.ScheduleRequest],
    *,
    router: scheduling.CapabilityRouter,
    max_input_bytes: int,
    input_key: SecretStr | None = None,
    max_stored_input_bytes: int | None = None,
    via: Celery | None = None,
    now: Any = None,
) -> list[scheduling.ScheduleResult]:
    """`store.dispatches.schedule_many` inside the caller's transaction (all or nothing); the Jobs'
    creation is sent after the outermost commit, CREATE_BATCH dispatches per message.

    `via` is the Celery app to send with (default: this package's, configured from
    K8S_DISPATCH_*). Nothing is sent if the transaction rolls back (or the SAVEPOINT the
    dispatches were written in); if the broker is down at commit the dispatches are safe in the
    database and the recovery sweep creates their Jobs after the grace period. A repeated
    request is sent again (create_jobs is idempotent; a lost first message is covered).
    """
    results = scheduling.schedule_many(
        session,
        requests,
        router=router,
        max_input_bytes=max_input_bytes,
        input_key=input_key,
        max_stored_input_bytes=max_stored_input_bytes,
        now=now,
    )
    sender = via if via is not None else app
    # Each new dispatch's state-change line travels with its pending id (logged after the
    # commit, dropped with a rolled-back SAVEPOINT), so no per-transaction hook of statelog's.
    logged = {r.dispatch_id: q for q, r in zip(requests, results, strict=True) if r.created}
    pending = [r.dispatch_id for r in results if r.state is DispatchState.SCHEDULED]
    _after_commit_send(session, pending, sender, scheduled=logged)
    queued = [r.dispatch_id for r in results if r.state is DispatchState.QUEUED]
    _after_commit_send(session, queued, sender, task=names.ADMIT_TASK, scheduled=logged)
    return results


def cancel_in_session(
    session: Session, dispatch_id: str, *, reason: str = CANCELLED_REASON, via: Celery | None = None
) -> bool:
    """Cancel a dispatch inside the caller's transaction; True if this call ended it, False if
    it had ended already (completed, failed or cancelled).

    The WORKER_CANCELLED event and the CANCELLED state are written here, so the cancel is as
    durable as the caller's commit: no broker message is needed for it to hold. A completion
    racing it leaves exactly one terminal event (the unique index on terminal events decides:
    whichever commits first). After the outermost commit, `cancel` is sent to delete the Job at
    once and notify the engine; if that message is lost (a broker flush, no worker), the
    recovery sweep finds the recorded end with a Job still there and deletes the Job, and a
    create still queued for the dispatch skips it (or deletes the Job it made meanwhile).

    Raises:
        InvalidId: `dispatch_id` is not a UUID.
        UnknownDispatch: no such dispatch (nothing written).
    """
    check_dispatch_id(dispatch_id)
    event = dispatches.TerminalEvent(dispatch_id, EventType.WORKER_CANCELLED, {"reason": reason})
    won = bool(terminal.record(session, [event]))
    if won:
        row = dispatches.get_dispatch(session, dispatch_id)
        assert row is not None  # the write raised UnknownDispatch otherwise
        statelog.on_commit(
            session,
            DispatchState.CANCELLED,
            dispatch_id=dispatch_id,
            case_id=row.case_id,
            tenancy_id=row.tenancy_id,
            capability=row.capability,
            reason=reason,
        )
        _after_commit_send(session, [dispatch_id], via if via is not None else app, task=names.CANCEL_TASK)
    return won


def send_schedule_until_recorded(
    sessions: sessionmaker[Session],
    *,
    case_id: str,
    tenancy_id: str,
    capability: str,
    input: Any,
    idempotency_key: str,
    dispatch_id: str | None = None,
    secret: bool = False,
    input_key: SecretStr | None = None,
    timeout_s: float = 120.0,
    resend_s: float = 10.0,
    check_s: float = 0.25,
    via: Celery | None = None,
) -> str:
    """Schedule by task call, at least once: send `k8s-dispatch.schedule`, and send it again with
    the same idempotency key every `resend_s` until the dispatch is in the database (read with
    `sessions`, every `check_s`); its dispatch id.

    A task message lives only in the broker until a worker runs it, so one send can be lost (a
    broker flush, a failover); re-sending with the same key is safe, since a repeat is the same
    dispatch. A request the worker refuses (unknown capability, bad input: its typed error is
    in the worker's log) is never recorded and ends in the timeout; `schedule_in_session` raises
    such errors at once.

    `secret=True`: the message carries the input sealed under `input_key` (`Settings.input_key`,
    the workers' key too), never the input itself: the broker, Flower and a worker's log see
    only the Fernet token; the worker opens it and schedules it secret.

    Raises:
        SecretInputKeyMissing: `secret=True` and no `input_key` (before anything is sent).
        ScheduleNotRecorded: no dispatch with that key after `timeout_s` (no worker running, or
            the request refused); sending again later with the same key is still safe.
    """
    sender = via if via is not None else app
    kwargs = dict(
        case_id=case_id,
        tenancy_id=tenancy_id,
        capability=capability,
        input=input,
        idempotency_key=idempotency_key,
        dispatch_id=dispatch_id,
    )
    if secret:  # sealed once: every resend carries the same token
        kwargs["input"] = None
        kwargs["sealed_input"] = seal(canonical_json(input), input_key)
    deadline = time.monotonic() + timeout_s
    sends = 0
    while True:
        try:
            sender.send_task(names.SCHEDULE_TASK, kwargs=kwargs, queue=names.JOBS_QUEUE)
            sends += 1
        except OperationalError as e:
            log.warning("sending %s for key %r failed (%s); trying again", names.SCHEDULE_TASK, idempotency_key, e)
        resend_at = min(time.monotonic() + resend_s, deadline)
        while True:
            found = _recorded(sessions, tenancy_id, idempotency_key)
            if found is not None:
                return found
            now = time.monotonic()
            if now >= resend_at:
                break
            time.sleep(min(check_s, resend_at - now))
        if time.monotonic() >= deadline:
            raise ScheduleNotRecorded(
                f"no dispatch for tenancy {tenancy_id!r} and idempotency key {idempotency_key!r} after "
                f"{timeout_s:g}s and {sends} sends of {names.SCHEDULE_TASK}: is a worker running, and "
                "does its log show the request refused?"
            )


def _recorded(sessions: sessionmaker[Session], tenancy_id: str, idempotency_key: str) -> str | None:
    """The dispatch id recorded for the key, or None (also while the database is unreachable)."""
    try:
        with transaction(sessions) as session:
            return dispatches.dispatch_id_for_key(session, tenancy_id=tenancy_id, idempotency_key=idempotency_key)
    except DatabaseUnavailable as e:
        log.warning("looking up the dispatch for key %r failed (%s); trying again", idempotency_key, e)
        return None


def _after_commit_send(
    session: Session,
    dispatch_ids: list[str],
    sender: Celery,
    *,
    task: str = names.CREATE_JOBS_TASK,
    scheduled: Mapping[str, scheduling.ScheduleRequest] | None = None,
) -> None:
    # Remember the innermost SAVEPOINT the dispatches were written in: rolling that one back
    # takes them with it; releasing it hands them to the enclosing one.
    savepoint = session.get_nested_transaction()
    logged = scheduled or {}
    session.info.setdefault(_PENDING_KEY, []).extend(
        _Pending(d, sender, savepoint, task, logged.get(d)) for d in dispatch_ids
    )


@dataclass
class _Pending:
    dispatch_id: str
    sender: Celery
    savepoint: SessionTransaction | None  # None: written outside any SAVEPOINT
    task: str = names.CREATE_JOBS_TASK  # or CANCEL_TASK (a cancel_in_session), ADMIT_TASK (queued)
    scheduled: scheduling.ScheduleRequest | None = None  # created by this transaction: log SCHEDULED


# The hooks are the Session class's, installed once: one `event.listen` per session (the engine
# makes a session per transaction) cost more CPU than a one-dispatch transaction's INSERTs.
# A session with nothing pending pays a dict lookup per commit or rollback.
@event.listens_for(Session, "after_commit")
def _on_commit(session: Session) -> None:
    if _PENDING_KEY not in session.info:
        return
    # SQLAlchemy sends after_commit for a released SAVEPOINT too (scheduling.schedule_many uses
    # one): only the outermost commit makes the rows visible to a worker.
    released = session.get_nested_transaction()
    if released is not None:
        enclosing = released.parent if released.parent is not None and released.parent.nested else None
        for pending in session.info.get(_PENDING_KEY, []):
            if pending.savepoint is released:
                pending.savepoint = enclosing
        return
    pending = session.info.pop(_PENDING_KEY, [])
    for p in pending:
        if p.scheduled is not None:
            request = p.scheduled
            statelog.state_changed(
                DispatchState.QUEUED if p.task == names.ADMIT_TASK else DispatchState.SCHEDULED,
                dispatch_id=p.dispatch_id,
                case_id=request.case_id,
                tenancy_id=request.tenancy_id,
                capability=request.capability,
            )
    for p in [p for p in pending if p.task == names.CANCEL_TASK]:
        try:
            p.sender.send_task(
                names.CANCEL_TASK, args=[p.dispatch_id], kwargs={"recorded": True}, queue=names.JOBS_QUEUE
            )
        except OperationalError as e:
            log.warning(
                "dispatch %s is cancelled but cancel was not sent (%s); the sweep will delete its Job", p.dispatch_id, e
            )
    for sender, ids in _by_sender([p for p in pending if p.task == names.CREATE_JOBS_TASK]):
        _outbox(sender).put(ids)
    for sender, ids in _by_sender([p for p in pending if p.task == names.ADMIT_TASK]):
        try:  # one pass for the transaction's queued dispatches, however many
            sender.send_task(names.ADMIT_TASK, queue=names.JOBS_QUEUE)
        except OperationalError as e:
            log.warning("%d dispatches are queued but admit was not sent (%s); beat's pass admits them", len(ids), e)


_OUTBOXES: weakref.WeakKeyDictionary[Celery, Outbox] = weakref.WeakKeyDictionary()
_OUTBOXES_LOCK = threading.Lock()


def _outbox(sender: Celery) -> Outbox:
    """The sender's one outbox in this process: every thread's commits share its messages."""
    with _OUTBOXES_LOCK:
        outbox = _OUTBOXES.get(sender)
        if outbox is None:
            outbox = _OUTBOXES[sender] = Outbox(partial(_send_create_jobs, weakref.ref(sender)), batch=CREATE_BATCH)
        return outbox


def _send_create_jobs(sender_ref: weakref.ref[Celery], batch: list[str]) -> None:
    crashpoint(Point.AFTER_SCHEDULE_COMMIT)
    sender = sender_ref()
    if sender is None:  # the app is gone (closed and dropped): the sweep creates these
        log.warning(
            "%d dispatches (%s ...) are committed but their app is gone; the sweep will create them",
            len(batch),
            batch[0],
        )
        return
    try:
        sender.send_task(names.CREATE_JOBS_TASK, args=[batch], queue=names.JOBS_QUEUE)
    except OperationalError as e:
        log.warning(
            "%d dispatches (%s ...) are committed but create_jobs was not sent (%s); the sweep will create them",
            len(batch),
            batch[0],
            e,
        )


def _by_sender(pending: list[_Pending]) -> list[tuple[Celery, list[str]]]:
    """The pending dispatch ids per sender, each once, in the order they were written (pure)."""
    grouped: dict[int, tuple[Celery, dict[str, None]]] = {}
    for p in pending:
        grouped.setdefault(id(p.sender), (p.sender, {}))[1].setdefault(p.dispatch_id)
    return [(sender, list(ids)) for sender, ids in grouped.values()]


@event.listens_for(Session, "after_soft_rollback")
def _on_rollback(session: Session, previous_transaction: SessionTransaction) -> None:
    if _PENDING_KEY not in session.info:
        return
    if not previous_transaction.nested:
        session.info.pop(_PENDING_KEY, None)  # the whole transaction is gone
        return
    # A SAVEPOINT rolled back: drop what was written in it (or in SAVEPOINTs inside it).
    kept = [p for p in session.info.get(_PENDING_KEY, []) if not _inside(p.savepoint, previous_transaction)]
    session.info[_PENDING_KEY] = kept


def _inside(savepoint: SessionTransaction | None, outer: SessionTransaction) -> bool:
    while savepoint is not None:
        if savepoint is outer:
            return True
        savepoint = savepoint.parent
    return False
