"""The clocks before a dispatch's container runs: which Jobs the sweep checks, and the queue clock.

Two of a capability's three clocks are kept here (the third, `activeDeadlineSeconds`, is the
Job controller's). The start clock (`startTimeoutSeconds`, and the per-reason timeouts of
`workers/pod_health.py`) counts from `job_created_at`, which the dispatch row records by the
database's clock (for a Job that waited suspended in a queue such as Kueue's, from its resume:
`pod_health.start_age`); the sweep's "now" is the database's too. The queue clock
(`queueTimeoutSeconds`) counts from the row's `admitted_at` (a fair-share limit's wait is a
turn, not a fault) or else its `created_at`, its scheduling, also by the database's clock. A
worker's own clock is never read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from k8s_dispatch.engine.db import database_now, transaction
from k8s_dispatch.engine.errors import ApiUnavailable, AuthorizationNotReady, QuotaExceeded, Transient
from k8s_dispatch.engine.models import Dispatch, DispatchState
from k8s_dispatch.recovery.sweep import Action, DispatchView, ReportRunning
from k8s_dispatch.workers.pod_health import StartPolicy, due_for_check

# The create errors that stand for "the Job cannot be created yet" and so run the queue clock: a
# full ResourceQuota, an API server unavailable or not yet authorizing. (A Conflict is a Job of
# ours on its way out: not a wait in the queue.)
QUEUE_WAITS: tuple[type[Transient], ...] = (QuotaExceeded, ApiUnavailable, AuthorizationNotReady)


@dataclass(frozen=True)
class StartCheck:
    """A running Job the sweep reads the Pods of: unstarted, past `CHECK_GRACE`.

    `attempts` is the row's count when planned: the give-up acts only if it is unchanged.
    """

    dispatch_id: str
    namespace: str
    job_name: str
    attempts: int
    age: timedelta  # since the dispatch recorded its Job created, by the database's clock
    policy: StartPolicy
    job: Mapping[str, Any] = field(compare=False, repr=False)


def due(
    jobs: Iterable[Mapping[str, Any]],
    actions: Sequence[Action],
    dispatches: Mapping[str, DispatchView],
    *,
    now: datetime,
    policy_for: Callable[[str], StartPolicy],
) -> list[StartCheck]:
    """The page's Jobs whose Pods to read (pure): those the plan found running (`ReportRunning`,
    dispatch CREATED) whose status shows no started container, older than the grace.

    `jobs` and `actions` are a page and its plan (`plan_jobs`); `policy_for(capability)` is the
    capability's start policy (the defaults for a capability gone from the config).
    """
    by_name = {(job.get("metadata") or {}).get("name", ""): job for job in jobs}
    checks: list[StartCheck] = []
    for action in actions:
        if not isinstance(action, ReportRunning) or action.adopt:
            continue
        view, job = dispatches.get(action.dispatch_id), by_name.get(action.job_name)
        if view is None or job is None or view.state is not DispatchState.CREATED:
            continue
        age = now - (view.job_created_at or view.updated_at)
        if due_for_check(job, age=age):
            checks.append(
                StartCheck(
                    dispatch_id=action.dispatch_id,
                    namespace=action.namespace,
                    job_name=action.job_name,
                    attempts=view.record.attempts,
                    age=age,
                    policy=policy_for(view.record.capability),
                    job=job,
                )
            )
    return checks


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
