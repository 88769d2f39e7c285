"""The one `Runtime` of a worker process, built when the worker starts and closed when it stops.

The worker-init hook builds it before the worker consumes anything, so a broken capability file
stops the process at start with the file, capability and field in the message, and start-up
recovery finds the resolver ready. Dispatches that end free fair-share slots: the Runtime's
`on_ended` runs an admission pass (`tasks.admission`). When it stops (SIGTERM: Celery's warm
shutdown, once running tasks have ended), the worker makes its last pass over our Pods being
deleted (`delivery.shutdown`) before it closes the Runtime: a drain that evicts the workers with
the Job Pods they would read is not left waiting for Pods only a worker can let go.
"""

from __future__ import annotations

import sys
import threading
from functools import partial
from typing import TYPE_CHECKING, Any

from celery import signals

from k8s_dispatch.tasks.admission import on_ended
from k8s_dispatch.tasks.app import app
from k8s_dispatch.tasks.task_events import failure_echo

if TYPE_CHECKING:
    from k8s_dispatch.delivery.runtime import Runtime

EXIT_CONFIG = 3  # as the CLI's: invalid configuration, nothing was done

_runtime: Runtime | None = None
_runtime_lock = threading.Lock()


def get_runtime() -> Runtime:
    """This process's Runtime, built on first use (at worker start in a worker)."""
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            from k8s_dispatch.core.settings import get_settings
            from k8s_dispatch.delivery.runtime import Runtime
            from k8s_dispatch.tasks.app import celery_notifier

            settings = get_settings()
            runtime = Runtime.from_settings(settings, notifier=celery_notifier(settings))
            runtime.on_ended = partial(on_ended, runtime, app)  # ended dispatches free slots: admit
            runtime.on_failed = failure_echo(app)  # failed dispatches shown as failed tasks (Flower)
            _runtime = runtime
        return _runtime


@signals.worker_init.connect
def _build_runtime_at_start(**_: Any) -> None:
    from k8s_dispatch.core.errors import ConfigError

    try:
        get_runtime()
    except ConfigError as e:
        # Celery logs and swallows exceptions from signal handlers; SystemExit it lets through.
        # Printed, not logged: stderr is where a supervisor looks, whatever --logfile says.
        print(f"k8s-dispatch worker cannot start: {e.reason}: {e}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_CONFIG) from e


@signals.worker_shutdown.connect
def _close_runtime(**_: Any) -> None:
    from k8s_dispatch.delivery.shutdown import last_pass

    global _runtime
    with _runtime_lock:
        if _runtime is not None:
            try:
                last_pass(_runtime)
            finally:
                _runtime.close()
                _runtime = None
