"""The engine's in-transaction entry: schedule dispatches inside the caller's own transaction.

`schedule_in_session` / `schedule_many_in_session` write the dispatches with
`engine.store.schedule_many` and send `create_jobs` only once that transaction commits (nothing
if it rolls back): every dispatch the transaction wrote, by any number of calls, in messages of
up to CREATE_BATCH ids, so a worker pays its per-message and per-transaction costs once per
batch. Light on purpose: an engine process or the CLI imports it without the Kubernetes client
or the delivery machinery.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from celery import Celery
from kombu.exceptions import OperationalError
from sqlalchemy import event
from sqlalchemy.orm import Session, SessionTransaction

import celeryconfig as names
from engine import store
from engine.models import DispatchState
from recovery import statelog
from recovery.crashpoints import Point, crashpoint
from tasks.app import app

log = logging.getLogger(__name__)

_PENDING_KEY = "k8s_dispatch.pending_create_job"
_HOOKED_KEY = "k8s_dispatch.hooked"
# Dispatch ids per `create_jobs` message. A worker's thread creates a message's Jobs one after
# the other, so a batch is also the unit of parallelism: 50 keeps a fan-out of hundreds spread
# over the worker's threads while the per-message costs (broker round trips, the records' read,
# the one marking transaction) are paid once per 50 Jobs. Measured (bench/dispatch_throughput.py,
# transactions of 50, side by side): messages of 50 cost the worker 0.9-1.2 ms CPU per Job,
# messages of 25 1.4-1.55 ms.
CREATE_BATCH = 50


def schedule_in_session(
    session: Session, *, via: Celery | None = None, now: Any = None, **request: Any
) -> store.ScheduleResult:
    """`engine.store.schedule` inside the caller's transaction; `create_jobs` is sent after commit.

    Takes `store.schedule`'s keyword arguments: `schedule_many_in_session` for one request.
    """
    router, max_input_bytes = request.pop("router"), request.pop("max_input_bytes")
    (result,) = schedule_many_in_session(
        session, [store.ScheduleRequest(**request)], router=router, max_input_bytes=max_input_bytes, via=via, now=now
    )
    return result


def schedule_many_in_session(
    session: Session,
    requests: Sequence[store.ScheduleRequest],
    *,
    router: store.CapabilityRouter,
    max_input_bytes: int,
    via: Celery | None = None,
    now: Any = None,
) -> list[store.ScheduleResult]:
    """`engine.store.schedule_many` inside the caller's transaction (all or nothing); the Jobs'
    creation is sent after the outermost commit, CREATE_BATCH dispatches per message.

    `via` is the Celery app to send with (default: this package's, configured from
    K8S_DISPATCH_*). Nothing is sent if the transaction rolls back (or the SAVEPOINT the
    dispatches were written in); if the broker is down at commit the dispatches are safe in the
    database and the recovery sweep creates their Jobs after the grace period. A repeated
    request is sent again (create_jobs is idempotent; a lost first message is covered).
    """
    results = store.schedule_many(session, requests, router=router, max_input_bytes=max_input_bytes, now=now)
    sender = via if via is not None else app
    for request, result in zip(requests, results):
        if result.created:
            statelog.on_commit(
                session,
                DispatchState.SCHEDULED,
                dispatch_id=result.dispatch_id,
                case_id=request.case_id,
                tenancy_id=request.tenancy_id,
                capability=request.capability,
            )
    _after_commit_send(session, [r.dispatch_id for r in results if r.state is DispatchState.SCHEDULED], sender)
    return results


def _after_commit_send(session: Session, dispatch_ids: list[str], sender: Celery) -> None:
    # Remember the innermost SAVEPOINT the dispatches were written in: rolling that one back
    # takes them with it; releasing it hands them to the enclosing one.
    savepoint = session.get_nested_transaction()
    session.info.setdefault(_PENDING_KEY, []).extend(_Pending(d, sender, savepoint) for d in dispatch_ids)
    if not session.info.get(_HOOKED_KEY):
        session.info[_HOOKED_KEY] = True
        event.listen(session, "after_commit", _on_commit)
        event.listen(session, "after_soft_rollback", _on_rollback)


@dataclass
class _Pending:
    dispatch_id: str
    sender: Celery
    savepoint: SessionTransaction | None  # None: written outside any SAVEPOINT


def _on_commit(session: Session) -> None:
    # SQLAlchemy sends after_commit for a released SAVEPOINT too (store.schedule_many uses
    # one): only the outermost commit makes the rows visible to a worker.
    released = session.get_nested_transaction()
    if released is not None:
        enclosing = released.parent if released.parent is not None and released.parent.nested else None
        for pending in session.info.get(_PENDING_KEY, []):
            if pending.savepoint is released:
                pending.savepoint = enclosing
        return
    for sender, ids in _by_sender(session.info.pop(_PENDING_KEY, [])):
        for start in range(0, len(ids), CREATE_BATCH):
            batch = ids[start : start + CREATE_BATCH]
            crashpoint(Point.AFTER_SCHEDULE_COMMIT)
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


def _on_rollback(session: Session, previous_transaction: SessionTransaction) -> None:
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
