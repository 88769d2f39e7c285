"""Hosts' clocks need not agree: a real `celery -A k8s_dispatch.tasks worker` under Debian's faketime, 60 s
ahead of or behind beat, PostgreSQL, Redis and localcluster (all on the true clock), keeps
polling and sweeping, and writes and compares row times on the database's clock. A message
that a worker's clock does expire is logged and counted; a backlog of polls or sweeps runs once.
"""

from __future__ import annotations

import glob
import subprocess
import sys
import time
import uuid
from datetime import timedelta

import pytest
from test_monitoring import scrape  # the same /metrics reader

from k8s_dispatch import celeryconfig as names
from k8s_dispatch.delivery.stats import Stats
from k8s_dispatch.ops import processes
from k8s_dispatch.recovery.sweep import SWEEPS_RUN
from k8s_dispatch.store import dispatches, scheduling
from k8s_dispatch.store.db import database_now, transaction
from k8s_dispatch.store.models import EventType
from k8s_dispatch.tasks.recovery_tasks import STARTUP_SWEEP_DONE
from k8s_dispatch.workers.resolver import CapabilityResolver

SIM = "localcluster.k8s-dispatch.io/"
CAPABILITIES = {"sim.ok": {"worker": "sim", "image": "sim:1", "annotations": {SIM + "duration-ms": "50"}}}
SKEW_S = 60
DELIVER_S = 60.0  # ten 50 ms Jobs with a poll every 0.2 s: seconds; a worker that drops polls: never
WORKER_START_S = 90.0  # a cold worker under faketime on a busy 2-core machine


def faketime_env(offset: str) -> dict[str, str]:
    """The environment that runs a process `offset` (e.g. "+60s") off the true clock: libfaketime
    (multithreaded variant: the worker runs threads) preloaded. Monotonic clocks are left true
    (DONT_FAKE_MONOTONIC), or every timeout and sleep in the worker would misbehave."""
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketimeMT.so.1"))
    if not found:
        pytest.fail("libfaketime is not installed: run tests/services.sh (apt-get install faketime)")
    return {"LD_PRELOAD": found[0], "FAKETIME": offset, "DONT_FAKE_MONOTONIC": "1"}


def skew_of(env: dict[str, str]) -> float:
    """How far a Python process with `env` is off the true clock: faketime really took hold."""
    before = time.time()
    out = subprocess.run(
        [sys.executable, "-c", "import time; print(time.time())"],
        env={**processes.project_env({}), **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return float(out) - before


def discarded(port: int, task: str, reason: str) -> float:
    return scrape(port).get(("k8s_dispatch_tasks_discarded_total", (("reason", reason), ("task", task))), 0.0)


@pytest.mark.parametrize("offset", [f"+{SKEW_S}s", f"-{SKEW_S}s"])
def test_a_worker_off_by_a_minute_keeps_polling_and_sweeping(deploy, sim_cluster, offset):
    env = faketime_env(offset)
    assert abs(abs(skew_of(env)) - SKEW_S) < 10, "faketime did not shift the clock"
    d = deploy(sim_cluster, capabilities=CAPABILITIES, sweep_interval_s="2")
    worker = d.start_worker("skewed", env=env, wait=False)
    worker.wait_for_log(STARTUP_SWEEP_DONE, timeout_s=WORKER_START_S)
    d.start_beat()
    stats = Stats(d.redis, prefix=d.prefix)
    sweeps_at_start = stats.get(SWEEPS_RUN)

    # Scheduled after the start-up sweep: only beat's poll (and sweep) can deliver these.
    ids = d.schedule_batch("sim.ok", 10)
    events = d.wait_terminal(ids, timeout_s=DELIVER_S)
    assert all(events[i] == [(EventType.WORKER_COMPLETED, {"output": {"simulated": True, "input": {"i": n}}})]
               for n, i in enumerate(ids))  # fmt: skip
    d.wait_no_jobs()
    # Beat's sweeps run too (every 2 s), not only the start-up one.
    d.wait(lambda: stats.get(SWEEPS_RUN) >= sweeps_at_start + 2, timeout_s=30, what="two sweeps sent by beat")

    # The skewed worker marked the rows created and recorded their ends on the database's clock.
    with transaction(d.sessions) as session:
        now = database_now(session)
        rows = dispatches.get_dispatches(session, ids)
    for row in rows.values():
        assert now - timedelta(seconds=30) < row.finished_at <= now, (row.finished_at, now)
        assert now - timedelta(seconds=30) < row.updated_at <= now
    assert "discarded task" not in worker.log()


def test_the_sweeps_grace_period_runs_on_the_databases_clock(deploy, sim_cluster):
    """A worker a minute behind must not see a fresh row as a minute younger: a dispatch with no
    message (written "from any language") gets its Job after the grace period, not a minute later."""
    d = deploy(sim_cluster, capabilities=CAPABILITIES, sweep_interval_s="1", sweep_grace_s="3")
    worker = d.start_worker("behind", env=faketime_env(f"-{SKEW_S}s"), wait=False)
    worker.wait_for_log(STARTUP_SWEEP_DONE, timeout_s=WORKER_START_S)
    d.start_beat()
    case_id = d.new_case()
    with transaction(d.sessions) as session:  # no create_jobs message: the sweep's category 1
        dispatch_id = scheduling.schedule(
            session,
            case_id=case_id,
            tenancy_id="tenant-a",
            capability="sim.ok",
            input={"i": 1},
            idempotency_key=f"key-{uuid.uuid4()}",
            router=CapabilityResolver.from_settings(d.settings),
            max_input_bytes=d.settings.max_input_bytes,
        ).dispatch_id
    # grace 3 s + a sweep every 1 s + the Job and its poll: well under the minute of skew.
    events = d.wait_terminal([dispatch_id], timeout_s=SKEW_S / 2)
    assert [t for t, _ in events[dispatch_id]] == [EventType.WORKER_COMPLETED]


def test_a_message_the_workers_clock_expires_is_logged_and_counted(deploy, sim_cluster):
    port = processes.free_port()
    d = deploy(sim_cluster, capabilities=CAPABILITIES, metrics_port=str(port))
    worker = d.start_worker("ahead", env=faketime_env(f"+{SKEW_S}s"), wait=False)
    worker.wait_for_log(" ready.", timeout_s=WORKER_START_S)
    # Sent by a process on the true clock with 10 s to live: past, by the worker's clock.
    result = d.producer.send_task(names.POLL_TASK, queue=names.SWEEP_QUEUE, expires=10.0)
    worker.wait_for_log(f"discarded task {names.POLL_TASK}[{result.id}]: expired")
    d.wait(lambda: discarded(port, names.POLL_TASK, "expired") == 1, what="the expired poll counted")


def test_a_backlog_of_polls_and_sweeps_runs_once_each_the_rest_superseded(deploy, sim_cluster):
    port = processes.free_port()
    # Long intervals: the whole backlog falls within one window (half an interval).
    d = deploy(
        sim_cluster, capabilities=CAPABILITIES, metrics_port=str(port), poll_interval_s="20", sweep_interval_s="60"
    )
    for _ in range(10):
        d.send(names.POLL_TASK)
    for _ in range(3):
        d.send(names.SWEEP_TASK)
    stats = Stats(d.redis, prefix=d.prefix)
    worker = d.start_worker("w1", wait=False)
    worker.wait_for_log(STARTUP_SWEEP_DONE, timeout_s=WORKER_START_S)

    def drained() -> bool:
        # the sweep that runs counts itself when it ends, which may be after the others were skipped
        return (
            discarded(port, names.POLL_TASK, "superseded") == 9
            and discarded(port, names.SWEEP_TASK, "superseded") == 2
            and stats.get(SWEEPS_RUN) >= 2
        )

    d.wait(drained, what="9 polls and 2 sweeps superseded, the other sweep done")
    assert worker.log().count(f"{names.POLL_TASK} skipped: superseded") == 9
    assert stats.get(SWEEPS_RUN) == 2  # the start-up sweep and the first queued one
