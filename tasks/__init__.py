"""The Celery side of k8s-dispatch: `celery -A k8s_dispatch.tasks worker|beat|flower` finds `app` here.

Importing this package imports Celery but reads no settings: the config is loaded on first
use, so the CLI (`k8s_dispatch.cli`) stays quick and never touches the broker on its own.
"""

from k8s_dispatch.tasks.app import app

__all__ = ["app"]
