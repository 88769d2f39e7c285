"""`ops.flower.queue_names`: the queues Flower's Broker page lists, as a table."""

from __future__ import annotations

from typing import Any

import pytest
from kombu import Queue

from k8s_dispatch import celeryconfig as names
from k8s_dispatch.ops.flower import queue_names
from k8s_dispatch.tasks import app

OURS = sorted({names.JOBS_QUEUE, names.COMPLETE_QUEUE, names.SWEEP_QUEUE})


@pytest.mark.parametrize(
    ("conf", "live", "expected"),
    [
        ({}, [], ["engine"]),
        ({"task_queues": (Queue("a"), Queue("b")), "task_default_queue": "a"}, [], ["a", "b", "engine"]),
        ({"task_queues": None, "task_default_queue": "celery"}, ["x"], ["celery", "engine", "x"]),
        ({"task_queues": (Queue("a"),)}, ["a", "engine"], ["a", "engine"]),  # each once
        ({"task_default_queue": ""}, [], ["engine"]),  # no name is no queue
    ],
)
def test_the_broker_page_lists_the_live_the_declared_and_the_engines_queue(
    conf: dict[str, Any], live: list[str], expected: list[str]
) -> None:
    assert queue_names(conf, notify_queue="engine", live=live) == expected


def test_our_apps_queues_and_the_engines_are_listed_with_no_worker_live() -> None:
    assert queue_names(app.conf, notify_queue="engine-x") == sorted([*OURS, "engine-x"])
