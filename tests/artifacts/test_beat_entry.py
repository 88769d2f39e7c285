"""The cleanup's beat entry and task: scheduled only with an object store, registered in the app."""

from __future__ import annotations

from k8s_dispatch import celeryconfig
from k8s_dispatch.core.settings import load_settings


def test_beat_sends_the_cleanup_only_when_an_object_store_is_configured() -> None:
    without = celeryconfig.config(load_settings({}))
    assert "artifacts-cleanup" not in without["beat_schedule"]
    settings = load_settings({"K8S_DISPATCH_OBJECT_STORE_ENDPOINT": "http://127.0.0.1:1"})
    entry = celeryconfig.config(settings)["beat_schedule"]["artifacts-cleanup"]
    assert entry["task"] == celeryconfig.ARTIFACTS_CLEANUP_TASK
    assert entry["schedule"].total_seconds() == 300
    assert entry["options"] == {"queue": celeryconfig.SWEEP_QUEUE}


def test_the_worker_imports_the_cleanup_task() -> None:
    from k8s_dispatch.tasks.app import app

    app.loader.import_default_modules()
    assert celeryconfig.ARTIFACTS_CLEANUP_TASK in app.tasks
