"""An idle worker's INFO log is quiet: the "received" / "succeeded" lines of poll, admit, cleanup
and sweep are at DEBUG (tasks/log_levels.py), while the work (a dispatch's tasks) and every line of
ours stay at INFO. Counted on a real worker over a window of at least 20 polls it ran."""

from __future__ import annotations

import logging
import re
import socket

from k8s_dispatch import celeryconfig as names
from k8s_dispatch.tasks import log_levels
from k8s_dispatch.tasks.recovery_tasks import STARTUP_SWEEP_DONE

CAPABILITIES = {"sim.ok": {"worker": "sim", "image": "sim:1"}}
WORKER_START_S = 90.0
INFO_LINE = re.compile(r"^\[[^\]]*: INFO/", re.M)
HOUSEKEEPING_LINE = re.compile(r"Task k8s-dispatch\.(poll|admit|cleanup|sweep)\[")


def _polls_run(d, node: str) -> int:
    """The worker's own count of poll tasks it ran (Celery's remote-control `stats`)."""
    stats = d.producer.control.inspect(destination=[node], timeout=2.0).stats() or {}
    return int(stats.get(node, {}).get("total", {}).get(names.POLL_TASK, 0))


def test_an_idle_worker_logs_no_housekeeping_at_info_and_the_work_still_shows(deploy, sim_cluster) -> None:
    d = deploy(sim_cluster, capabilities=CAPABILITIES)  # beat polls every 0.2 s
    worker = d.start_worker("quiet", env={log_levels.LEVEL_VARIABLE: "debug"})
    worker.wait_for_log(STARTUP_SWEEP_DONE, timeout_s=WORKER_START_S)
    node = f"quiet@{socket.gethostname()}"  # --hostname=quiet@%h
    d.start_beat()
    start_at, polls_before = len(worker.log()), _polls_run(d, node)
    d.wait(lambda: _polls_run(d, node) - polls_before >= 20, timeout_s=60, what="20 polls run by the worker")
    idle = worker.log()[start_at:]
    assert not HOUSEKEEPING_LINE.search(idle), idle
    assert len(INFO_LINE.findall(idle)) <= 2, idle  # nothing happened: (almost) nothing to say

    # The work itself is still at INFO: a dispatch's own tasks are received and succeed in the log.
    (dispatch_id,) = d.schedule_batch("sim.ok", 1)
    d.wait_terminal([dispatch_id], timeout_s=60)
    d.wait(lambda: f"Task {names.COMPLETE_BATCH_TASK}[" in worker.log()[start_at:], what="complete_batch logged")
    assert f"Task {names.CREATE_JOBS_TASK}[" in worker.log()[start_at:]


def _record(message: str, task: str, level: int = logging.INFO) -> logging.LogRecord:
    data = {"name": task, "id": "x"}
    record = logging.LogRecord("celery.app.trace", level, __file__, 1, message, (data,), None)
    record.data = data
    return record


def test_only_housekeeping_received_and_succeeded_lines_are_demoted() -> None:
    from celery.app import trace

    logger = logging.getLogger("celery.app.trace")
    keep = logger.level
    logger.setLevel(logging.INFO)
    try:
        demote = log_levels.HousekeepingAtDebug()
        assert not demote.filter(_record(trace.LOG_SUCCESS, names.POLL_TASK))
        assert not demote.filter(_record(trace.LOG_RECEIVED, names.ADMIT_TASK))
        assert demote.filter(_record(trace.LOG_SUCCESS, names.CREATE_JOB_TASK))  # the work
        assert demote.filter(_record(trace.LOG_FAILURE, names.POLL_TASK, logging.ERROR))  # a failure
        logger.setLevel(logging.DEBUG)
        shown = _record(trace.LOG_SUCCESS, names.POLL_TASK)
        assert demote.filter(shown) and shown.levelno == logging.DEBUG
    finally:
        logger.setLevel(keep)
