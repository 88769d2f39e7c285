"""The Celery app, the engine's notifier, and the hooks of every process: metrics, beat's stop.

Settings come from `celeryconfig` (read lazily, on first use of `app.conf`). The worker's one
`Runtime` is `tasks.worker_runtime`'s. The beat-init hook makes SIGTERM stop beat between ticks.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import TYPE_CHECKING, Any

from celery import Celery, signals

from k8s_dispatch.tasks import log_levels
from k8s_dispatch.tasks.task_events import Messages

if TYPE_CHECKING:
    from k8s_dispatch.core.settings import Settings
    from k8s_dispatch.delivery.runtime import Notifier

log = logging.getLogger(__name__)

# `Messages`: what Flower shows of each task (tasks/task_events.py).
app = Celery("k8s-dispatch", include=["k8s_dispatch.tasks.jobs", "k8s_dispatch.tasks.recovery_tasks"], amqp=Messages)
app.config_from_object("k8s_dispatch.celeryconfig")
log_levels.install()  # poll's and admit's routine lines at DEBUG: INFO is the work


def celery_notifier(settings: Settings, *, via: Celery | None = None) -> Notifier:
    """Sends the engine's task (`notify_task` on `notify_queue`) with the dispatch id.

    `via`: the Celery app to send with (default: this package's `app`).
    """
    from kombu.exceptions import OperationalError

    from k8s_dispatch.core.errors import BrokerUnavailable

    sender = via if via is not None else app

    def notify(dispatch_id: str) -> None:
        try:
            sender.send_task(settings.notify_task, args=[dispatch_id], queue=settings.notify_queue)
        except OperationalError as e:
            raise BrokerUnavailable(f"sending {settings.notify_task} for {dispatch_id}: {e}") from e

    return notify


@signals.worker_init.connect
def _serve_metrics(**_: Any) -> None:
    """Prometheus metrics on K8S_DISPATCH_METRICS_PORT (0: none); a taken port is logged, not fatal."""
    from k8s_dispatch.core.settings import get_settings
    from k8s_dispatch.delivery import metrics

    port = get_settings().metrics_port
    if port:
        try:
            metrics.serve(port)
        except OSError as e:
            log.error("metrics endpoint not started on port %d: %s", port, e)


@signals.beat_init.connect
def _stop_beat_between_ticks(sender: Any = None, **_: Any) -> None:
    """SIGTERM/SIGINT stop beat between two ticks, never in the middle of a publish.

    Celery's own handler closes the broker connection and raises SystemExit wherever the main
    thread is. Inside redis-py's socket read, the read's `finally` then fails on the closed
    socket, and that error replaces the SystemExit. A ValueError is logged as "Message Error"
    and beat goes on; a ConnectionError is retried without a word. Either way the SIGTERM is
    lost and beat runs until it is SIGKILLed. This handler raises SystemExit only when the
    signal lands in the scheduler loop itself (asleep between ticks). Anywhere else it just
    sets the loop's flag, so the current send completes and the loop ends after at most one
    interval. Either way `Service.start`'s `finally` closes the connection.

    A second signal can land inside the first's `Event.set()`, which holds the event's lock (not
    reentrant): the handler marks itself first and returns on any later signal, or beat would
    deadlock on that lock for ever (a supervisor's SIGTERM sent twice, as a test's teardown does).
    """
    service = sender
    if service is None or threading.current_thread() is not threading.main_thread():
        return  # an embedded beat thread: signals are the worker's
    loop = type(service).start.__code__
    stopping = False

    def stop(_signum: int, frame: Any) -> None:
        nonlocal stopping
        if stopping or service._is_shutdown.is_set():
            return  # already stopping: let the loop's finally finish its clean-up
        stopping = True  # before set(): a signal landing inside set() must not take its lock again
        service._is_shutdown.set()  # what Service.stop() does, without logging from a handler
        if frame is not None and frame.f_code is loop:
            raise SystemExit()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)


@signals.task_revoked.connect
def _count_discarded(
    sender: Any = None, request: Any = None, terminated: bool = False, expired: bool = False, **_: Any
) -> None:
    """A message this worker dropped unrun: logged as a warning and counted, never silent.

    Expired ones are the danger: an `expires` is an absolute time from the sender's clock that
    Celery compares with this worker's, so a skewed clock drops every such message. Our beat
    entries carry none (`tasks.supersede` replaces it); one sent by anyone else still may.
    """
    from k8s_dispatch.delivery.metrics import METRICS

    task = getattr(sender, "name", None) or getattr(request, "task", None) or "unknown"
    reason = "expired" if expired else "terminated" if terminated else "revoked"
    log.warning(
        "discarded task %s[%s]: %s%s",
        task,
        getattr(request, "id", "?"),
        reason,
        " (its expires has passed by this worker's clock)" if expired else "",
    )
    METRICS.task_discarded(task=task, reason=reason)
