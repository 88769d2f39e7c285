"""The recovery sweep under Celery: a beat task, and a sweep when a worker starts.

The start-up sweep runs in `worker_ready`, which Celery sends after subscribing to the queues
and before its event loop handles the first message (`celery.worker.loops`: `consume()`, then
`on_ready()`, then the loop), with the Runtime built at `worker_init` (`tasks.app`).
"""

from __future__ import annotations

import logging
from typing import Any

from celery import signals

from k8s_dispatch import celeryconfig as names
from k8s_dispatch.core.errors import DispatchError
from k8s_dispatch.core.settings import PollMode
from k8s_dispatch.delivery.metrics import METRICS
from k8s_dispatch.recovery import deadlines
from k8s_dispatch.recovery.sweep import run_sweep
from k8s_dispatch.tasks import admission, lease, supersede
from k8s_dispatch.tasks.app import app
from k8s_dispatch.tasks.worker_runtime import get_runtime

log = logging.getLogger(__name__)

STARTUP_SWEEP_DONE = "start-up sweep done"  # the log line the start-up tests wait for


@app.task(name=names.SWEEP_TASK, send_events=False)
def sweep() -> dict[str, Any]:
    """One recovery sweep (beat sends this every `sweep_interval_s`); skipped if another started
    within half that interval (`tasks.supersede`), so a backlog of sweeps runs once, and skipped
    while another is under way on any replica (`tasks.lease`): a sweep can outlast its interval
    on a loaded cluster, and sweeps side by side would hold the worker threads everything else
    needs."""
    rt = get_runtime()
    interval_s = rt.settings.sweep_interval_s
    if not supersede.go_ahead(
        rt.redis, rt.settings.key_prefix, names.SWEEP_TASK, window_s=supersede.window_s(interval_s)
    ):
        return {"superseded": True}
    running = lease.take(rt.redis, rt.settings.key_prefix, names.SWEEP_TASK, ttl_s=lease.ttl_s(interval_s))
    if running is None:
        return {"running": True}
    with lease.kept(running, every_s=interval_s):
        report = run_sweep(rt, watched=True).to_dict()  # LISTs less often where poll's watch is healthy
    admission.count_tenancies(rt)
    if rt.settings.poll_mode is PollMode.WATCH:  # a LIST poll counts them as it reads them
        try:
            METRICS.jobs_past_deadline.set(deadlines.past_deadline(rt))
        except DispatchError as e:
            log.warning("counting the jobs past their deadline failed: %s: %s", e.reason, e)
    return report


@signals.worker_ready.connect
def _sweep_at_start(**_: Any) -> None:
    try:
        report = run_sweep(get_runtime())
    except DispatchError as e:  # e.g. the database is down: beat's sweep tries again
        log.error("start-up sweep failed: %s: %s", e.reason, e)
        return
    log.info("%s: %s", STARTUP_SWEEP_DONE, report.summary())
