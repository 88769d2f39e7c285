"""Flower as operators run it: `k8s-dispatch flower [FLOWER OPTIONS]`.

Flower's Broker page (and its `/api/queues/length`) lists the queues that a live worker consumes,
and the configured ones only while no worker is live. The engine's notification queue has no
consumer of ours: while the engine's worker is down, which is when its unread notifications pile
up, the page would leave that queue out. Flower started here lists every queue the deployment
sends to (`queue_names`) beside the live ones; everything else is Flower as `celery flower` runs it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

APP = "k8s_dispatch.tasks"


def queue_names(conf: Mapping[str, Any], *, notify_queue: str, live: Iterable[str] = ()) -> list[str]:
    """The queues the Broker page lists, sorted (pure): the `live` ones (what running workers
    consume), the app's declared and default queues, and the engine's `notify_queue`."""
    declared = {getattr(q, "name", None) for q in conf.get("task_queues") or ()}
    default = conf.get("task_default_queue")
    return sorted({*live, notify_queue, *(name for name in (*declared, default) if isinstance(name, str) and name)})


def run(argv: Sequence[str]) -> int:
    """Start Flower with `argv` (its own options: --port, --basic-auth...), its queue list ours.

    Flower asks its handlers for the queue names (`BaseHandler.get_active_queue_names`, Flower
    2.x): the one place to widen, where each live worker's queues are still read first.
    """
    from celery.bin.celery import celery as celery_command
    from flower.views import BaseHandler

    from k8s_dispatch.core.settings import get_settings

    notify_queue = get_settings().notify_queue
    live_queue_names = BaseHandler.get_active_queue_names

    def every_queue(handler: BaseHandler) -> list[str]:
        return queue_names(handler.capp.conf, notify_queue=notify_queue, live=live_queue_names(handler))

    BaseHandler.get_active_queue_names = every_queue
    result = celery_command.main(args=["-A", APP, "flower", *argv], prog_name="celery", standalone_mode=False)
    return result if isinstance(result, int) else 0
