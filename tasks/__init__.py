"""The Celery side of k8s-dispatch: `celery -A tasks worker|beat|flower` finds `app` here.

Importing this package imports Celery but reads no settings: the config is loaded on first
use, so the CLI (`tasks.cli`) stays quick and never touches the broker on its own.
"""

from tasks.app import app

__all__ = ["app"]
