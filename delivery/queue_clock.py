"""The queue clock: how long a dispatch may wait for its first Job to be made (`queueTimeoutSeconds`).
It counts from the row's `admitted_at` (a fair-share limit's wait is a turn, not a fault) or else
its `created_at`, its scheduling, by the database's clock; a worker's own clock is never read.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from k8s_dispatch.core.errors import ApiUnavailable, AuthorizationNotReady, QuotaExceeded, Transient
from k8s_dispatch.store.db import database_now, transaction
from k8s_dispatch.store.models import Dispatch, DispatchState

# The create errors that stand for "the Job cannot be created yet" and so run the queue clock: a
# full ResourceQuota, an API server unavailable or not yet authorizing. (A Conflict is a Job of
# ours on its way out: not a wait in the queue.)
QUEUE_WAITS: tuple[type[Transient], ...] = (QuotaExceeded, ApiUnavailable, AuthorizationNotReady)


def queue_expired(sessions: Any, dispatch_id: str, *, timeout_s: int | None) -> bool:
    """Whether the dispatch, still SCHEDULED (its first Job never created), has waited longer
    than `timeout_s` since it was admitted (scheduled, if no limit queued it), by the database's
    clock. One query; only asked when
    a create could not be made (a `QUEUE_WAITS` error) and the capability has a queue clock."""
    if timeout_s is None:
        return False
    with transaction(sessions) as session:
        return queue_expired_in(session, dispatch_id, timeout_s=timeout_s)


def queue_expired_in(session: Session, dispatch_id: str, *, timeout_s: int) -> bool:
    """`queue_expired` inside the caller's transaction (one that holds the dispatch's row lock)."""
    created = session.scalar(
        sa.select(sa.func.coalesce(Dispatch.admitted_at, Dispatch.created_at)).where(
            Dispatch.dispatch_id == dispatch_id, Dispatch.state == DispatchState.SCHEDULED
        )
    )
    if created is None:
        return False
    return bool(database_now(session) - created >= timedelta(seconds=timeout_s))


def queue_message(timeout_s: int, error: Transient) -> str:
    """The message of a `QueueTimeout`: the clock, and the last reason the Job could not be made."""
    return f"the Job could not be created within queueTimeoutSeconds ({timeout_s} s): {error.reason}: {error}"
