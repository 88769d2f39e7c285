"""Which running Jobs the sweep reads the Pods of: unstarted, past the grace (pure).
The start clock (`startTimeoutSeconds`, and the per-reason timeouts of `workers/pod_health.py`)
counts from `job_created_at`, which the dispatch row records by the database's clock (for a Job
that waited suspended in a queue such as Kueue's, from its resume: `pod_health.start_age`); the
sweep's "now" is the database's too. A worker's own clock is never read. (The third clock,
`activeDeadlineSeconds`, is the Job controller's; the queue clock is `delivery/queue_clock.py`.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from k8s_dispatch.recovery.plan import Action, DispatchView, ReportRunning
from k8s_dispatch.store.models import DispatchState
from k8s_dispatch.workers.capability import StartPolicy
from k8s_dispatch.workers.pod_health import due_for_check


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
