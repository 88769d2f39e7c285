"""A step of a worker's wall clock does not age a waiting Job: its start clock runs on the database's.

A real worker under libfaketime (`tests/stepped_clock.py`) sweeps a dispatch whose Pod cannot
be scheduled (start clock 600 s, the default); its wall clock is then stepped 700 s forward
while sweeps go on. The dispatch, seconds old by the database's clock, stays waiting (the
worker's `database_now` used to carry the 700 s into its age and fail it `Unschedulable`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from stepped_clock import SteppedClock

from k8s_dispatch import celeryconfig as names
from k8s_dispatch.delivery.stats import Stats
from k8s_dispatch.recovery.sweep import SWEEPS_RUN
from k8s_dispatch.store import dispatches
from k8s_dispatch.store.db import database_now, transaction
from k8s_dispatch.store.models import DispatchState, EventType
from k8s_dispatch.tasks.recovery_tasks import STARTUP_SWEEP_DONE
from k8s_dispatch.workers.capability import DEFAULT_START_TIMEOUT_S
from k8s_dispatch.workers.pod_health import CHECK_GRACE

SIM = "localcluster.k8s-dispatch.io/"
STEP_S = 700  # past the default start clock
CAPABILITIES = {
    "sim.nofit": {
        "worker": "sim",
        "image": "sim:1",
        "annotations": {SIM + "outcome": "hang", SIM + "unschedulable": "true"},
    }
}
WORKER_START_S = 90.0  # a cold worker under libfaketime on a busy 2-core machine
SWEEPS_AFTER_STEP = 3


def created_age(d: Any, dispatch_id: str) -> timedelta | None:
    """How long ago its Job was recorded created, by the database's clock (None: not yet)."""
    with transaction(d.sessions) as session:
        row = dispatches.get_dispatch(session, dispatch_id)
        now = database_now(session)
    assert row is not None
    if row.state is not DispatchState.CREATED or row.job_created_at is None:
        return None
    return now - row.job_created_at


def test_a_worker_stepped_past_the_start_clock_leaves_a_young_waiting_job_waiting(deploy, sim_cluster, tmp_path):
    assert STEP_S > DEFAULT_START_TIMEOUT_S
    clock = SteppedClock(tmp_path)
    d = deploy(sim_cluster, capabilities=CAPABILITIES, sweep_interval_s="1", sweep_grace_s="1")
    worker = d.start_worker("stepped", env=clock.env(), wait=False)
    worker.wait_for_log(STARTUP_SWEEP_DONE, timeout_s=WORKER_START_S)
    d.start_beat()
    stats = Stats(d.redis, prefix=d.prefix)

    [dispatch_id] = d.schedule_batch("sim.nofit", 1)
    # Old enough for the sweep to read its Pod (CHECK_GRACE), far from the start clock.
    d.wait(
        lambda: (age := created_age(d, dispatch_id)) is not None and age > CHECK_GRACE + timedelta(seconds=1),
        what="its Job created and past the check grace",
    )

    clock.step(f"+{STEP_S}s")
    assert abs(clock.offset_seen() - STEP_S) < 5, "the step did not take hold"
    sweeps = stats.get(SWEEPS_RUN)
    d.wait(
        lambda: stats.get(SWEEPS_RUN) >= sweeps + SWEEPS_AFTER_STEP,
        timeout_s=60,
        what=f"{SWEEPS_AFTER_STEP} sweeps by the stepped worker",
    )
    events = d.terminal_events([dispatch_id])
    assert events == {dispatch_id: []}, events
    age = created_age(d, dispatch_id)
    assert age is not None and age < timedelta(seconds=DEFAULT_START_TIMEOUT_S)  # still waiting, young

    d.send(names.CANCEL_TASK, dispatch_id)
    assert d.wait_terminal([dispatch_id])[dispatch_id][0][0] == EventType.WORKER_CANCELLED.value
    d.wait_no_jobs(timeout_s=30)
