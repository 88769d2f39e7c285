"""The engine's in-transaction entry: schedule a dispatch inside the caller's own transaction.

`schedule_in_session` writes the dispatch with `engine.store.schedule` and sends `create_job`
only once that transaction commits (nothing if it rolls back). Light on purpose: an engine
process or the CLI imports it without the Kubernetes client or the delivery machinery.
"""

from __future__ import annotations

import logging
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


def schedule_in_session(session: Session, *, via: Celery | None = None, **request: Any) -> store.ScheduleResult:
    """`engine.store.schedule` inside the caller's transaction; `create_job` is sent after commit.

    Takes `store.schedule`'s keyword arguments; `via` is the Celery app to send with (default:
    this package's, configured from K8S_DISPATCH_*). Nothing is sent if the transaction rolls
    back; if the broker is down at commit the dispatch is safe in the database and the
    recovery sweep creates its Job after the grace period.
    """
    result = store.schedule(session, **request)
    if result.created:
        statelog.on_commit(
            session,
            DispatchState.SCHEDULED,
            dispatch_id=result.dispatch_id,
            case_id=request["case_id"],
            tenancy_id=request["tenancy_id"],
            capability=request["capability"],
        )
    if result.state is DispatchState.SCHEDULED:
        _after_commit_send(session, result.dispatch_id, via if via is not None else app)
    return result


def _after_commit_send(session: Session, dispatch_id: str, sender: Celery) -> None:
    # Remember the innermost SAVEPOINT the dispatch was written in: rolling that one back
    # takes the dispatch with it; releasing it hands the dispatch to the enclosing one.
    pending = _Pending(dispatch_id, sender, session.get_nested_transaction())
    session.info.setdefault(_PENDING_KEY, []).append(pending)
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
    # SQLAlchemy sends after_commit for a released SAVEPOINT too (store.schedule uses one):
    # only the outermost commit makes the rows visible to a worker.
    released = session.get_nested_transaction()
    if released is not None:
        enclosing = released.parent if released.parent is not None and released.parent.nested else None
        for pending in session.info.get(_PENDING_KEY, []):
            if pending.savepoint is released:
                pending.savepoint = enclosing
        return
    for pending in session.info.pop(_PENDING_KEY, []):
        crashpoint(Point.AFTER_SCHEDULE_COMMIT)
        try:
            pending.sender.send_task(names.CREATE_JOB_TASK, args=[pending.dispatch_id], queue=names.JOBS_QUEUE)
        except OperationalError as e:
            log.warning(
                "dispatch %s is committed but create_job was not sent (%s); the sweep will create it",
                pending.dispatch_id,
                e,
            )


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
