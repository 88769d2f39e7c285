"""The object store's cleanup under Celery: a beat task deleting orphans and expired results
(`artifacts.cleanup`). Idempotent (a deletion of what is gone succeeds), and superseded like the
sweep, so a backlog of its messages runs once."""

from __future__ import annotations

import logging

from k8s_dispatch import artifacts
from k8s_dispatch import celeryconfig as names
from k8s_dispatch.artifacts.cleanup import clean
from k8s_dispatch.artifacts.errors import ObjectStoreUnavailable
from k8s_dispatch.tasks import supersede
from k8s_dispatch.tasks.app import app
from k8s_dispatch.tasks.worker_runtime import get_runtime

log = logging.getLogger(__name__)


@app.task(name=names.ARTIFACTS_CLEANUP_TASK, send_events=False)
def clean_objects() -> dict[str, int | bool]:
    """One pass over the objects under our prefix; nothing without an object store."""
    rt = get_runtime()
    store = artifacts.for_settings(rt.settings)
    if store is None:
        return {"configured": False}
    interval = names.artifacts_cleanup_interval_s(rt.settings)
    if not supersede.go_ahead(
        rt.redis, rt.settings.key_prefix, names.ARTIFACTS_CLEANUP_TASK, window_s=supersede.window_s(interval)
    ):
        return {"superseded": True}
    try:
        report = clean(store, rt.sessions)
    except ObjectStoreUnavailable as e:  # the next run goes on where this one stopped
        log.warning("object store cleanup stopped: %s", e)
        return {"unavailable": True}
    if report.orphans_deleted or report.expired_deleted:
        log.info("object store cleanup: %s", report.to_dict())
    return dict(report.to_dict())
