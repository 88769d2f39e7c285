"""Beat's periodic tasks superseded without trusting clocks: a poll or sweep that another one
started shortly before skips itself, judged by a Redis key with a TTL (`SET NX PX`).

Why not Celery's `expires`: beat stamps an absolute time with ITS clock and the worker compares
it with ITS OWN, so a worker whose clock runs ahead of beat's by more than the expiry drops every
such message, silently. A key's TTL is counted by Redis alone, so no two hosts' clocks are ever
compared. The effect `expires` was there for is kept: after a stall (workers busy or down) the
polls queued behind it are run one by one, and all but the first skip at the cost of one SET.
A skipped run is never a lost one: the first run does the work, and beat sends another every
interval. With Redis unreachable a run goes ahead: both tasks are safe to run twice.
"""

from __future__ import annotations

import logging

import redis

from k8s_dispatch.delivery.metrics import METRICS

log = logging.getLogger(__name__)

# A run holds its task for this share of the task's interval: long enough for a backlog of
# queued copies (each a SET of about a millisecond) to skip, short enough that the next tick's
# run, even a late one followed by a prompt one, is not skipped for long.
WINDOW_SHARE = 0.5


def window_s(interval_s: float) -> float:
    """How long a run of a task sent every `interval_s` supersedes the next ones (pure)."""
    return WINDOW_SHARE * interval_s


def key(prefix: str, task: str) -> str:
    """The task's key (pure): one per deployment (key prefix) and task."""
    return f"{prefix}:ran-recently:{task}"


def go_ahead(client: redis.Redis, prefix: str, task: str, *, window_s: float) -> bool:
    """True if this run of `task` should do its work (no other started within `window_s`; this
    one now holds the window), False if it is superseded by one that did: then logged and
    counted (`k8s_dispatch_tasks_discarded_total{reason="superseded"}`).

    Redis unreachable: True (logged), since running twice is safe and skipping is not needed.
    """
    try:
        first = client.set(key(prefix, task), 1, nx=True, px=max(1, int(window_s * 1000)))
    except redis.RedisError as e:
        log.warning("%s: cannot tell whether another run just started (%s); running", task, e)
        return True
    if not first:
        log.info("%s skipped: superseded by a run that started less than %.1fs ago", task, window_s)
        METRICS.task_discarded(task=task, reason="superseded")
    return bool(first)
