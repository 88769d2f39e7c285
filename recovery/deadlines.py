"""Running Jobs past their deadline, counted from the database: what the poll by watch, which
reads no running Job, leaves the `poll_jobs_past_deadline` gauge to (the sweep sets it).

A dispatch whose Job was created longer ago than its capability's `activeDeadlineSeconds` plus
the slack, and is not yet ended, is one the Job controller should have failed (or whose end we
have not recorded). The Job's own clock starts at its `startTime`; the row's `job_created_at`
is a little earlier, which the slack (120 s) absorbs. Capabilities that queue their Jobs
suspended (Kueue) are left out: their deadline starts at admission, which the row does not know.
"""

from __future__ import annotations

from datetime import timedelta

import sqlalchemy as sa

from k8s_dispatch.delivery.metrics import DEADLINE_SLACK_S
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.store.db import database_now, transaction
from k8s_dispatch.store.models import Dispatch, DispatchState


def past_deadline(rt: Runtime, *, slack_s: float = DEADLINE_SLACK_S) -> int:
    """How many created, unended dispatches are past their capability's deadline by more than
    `slack_s`: one COUNT per capability with a deadline.

    Raises:
        DatabaseUnavailable
    """
    total = 0
    with transaction(rt.sessions) as session:
        now = database_now(session)
        for capability in sorted(rt.resolver.capabilities()):
            spec = rt.resolver.spec(capability)
            if spec.active_deadline_seconds is None or spec.queue is not None:
                continue
            cutoff = now - timedelta(seconds=spec.active_deadline_seconds + slack_s)
            total += (
                session.scalar(
                    sa.select(sa.func.count()).where(
                        Dispatch.state == DispatchState.CREATED,
                        Dispatch.capability == capability,
                        Dispatch.job_created_at < cutoff,
                    )
                )
                or 0
            )
    return total
