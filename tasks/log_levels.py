"""Housekeeping at DEBUG: the "received" and "succeeded" lines Celery writes at INFO for each
poll, admit, cleanup, sweep and artifacts cleanup (several a second while idle) are logged at DEBUG, so that a
worker's INFO log is the work and its state changes. A failure or a retry of any task stays
at Celery's level, and so does every line our own code writes.

K8S_DISPATCH_HOUSEKEEPING_LOG=info keeps Celery's INFO lines: for a harness that counts polls
in a worker's log (the tests, the benchmarks).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Mapping

from celery.app import trace

from k8s_dispatch.celeryconfig import HOUSEKEEPING_TASKS

LEVEL_VARIABLE = "K8S_DISPATCH_HOUSEKEEPING_LOG"
# The loggers Celery writes those two lines with (celery.worker.strategy: received; celery.app.trace: succeeded).
LOGGERS = ("celery.worker.strategy", "celery.app.trace")
_ROUTINE = frozenset({trace.LOG_RECEIVED, trace.LOG_SUCCESS})


def is_routine(message: object, data: object, tasks: Collection[str] = HOUSEKEEPING_TASKS) -> bool:
    """True for Celery's "received" or "succeeded" line of one of `tasks` (pure)."""
    return message in _ROUTINE and isinstance(data, Mapping) and data.get("name") in tasks


class HousekeepingAtDebug(logging.Filter):
    """Turns a routine housekeeping line into a DEBUG record, dropped unless its logger logs DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or not is_routine(record.msg, getattr(record, "data", None)):
            return True
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def install(environ: Mapping[str, str] | None = None) -> None:
    """Add the filter to Celery's two loggers, once (a second call changes nothing), unless
    `environ` (default: the process's) sets K8S_DISPATCH_HOUSEKEEPING_LOG=info."""
    environ = os.environ if environ is None else environ
    if environ.get(LEVEL_VARIABLE, "debug").strip().lower() == "info":
        return
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, HousekeepingAtDebug) for f in logger.filters):
            logger.addFilter(HousekeepingAtDebug())
