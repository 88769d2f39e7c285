"""Beat's tasks superseded by a Redis TTL (`tasks.supersede`), on real Redis: the first run in
a window goes ahead, the others skip and are counted, the window ends by Redis' clock alone,
and an unreachable Redis never stops a run."""

from __future__ import annotations

import socket

import redis
from prometheus_client import REGISTRY

from k8s_dispatch.ops.processes import wait_until
from k8s_dispatch.tasks import supersede

TASK = "k8s-dispatch.poll"


def superseded_count(task: str = TASK) -> float:
    return (
        REGISTRY.get_sample_value("k8s_dispatch_tasks_discarded_total", {"task": task, "reason": "superseded"}) or 0.0
    )


def test_the_window_is_half_the_interval() -> None:
    assert supersede.window_s(2.0) == 1.0 and supersede.window_s(30.0) == 15.0


def test_the_first_run_in_a_window_goes_ahead_and_the_rest_are_superseded_and_counted(client, prefix) -> None:
    before = superseded_count()
    assert supersede.go_ahead(client, prefix, TASK, window_s=30) is True
    assert [supersede.go_ahead(client, prefix, TASK, window_s=30) for _ in range(4)] == [False] * 4
    assert superseded_count() == before + 4
    # Another task, or another deployment (key prefix), has a window of its own.
    assert supersede.go_ahead(client, prefix, "k8s-dispatch.sweep", window_s=30) is True
    assert supersede.go_ahead(client, f"{prefix}-other", TASK, window_s=30) is True
    # The window is a TTL Redis keeps: no process's clock decides when it ends.
    assert 0 < client.pttl(supersede.key(prefix, TASK)) <= 30_000


def test_a_run_after_the_window_goes_ahead(client, prefix) -> None:
    assert supersede.go_ahead(client, prefix, TASK, window_s=0.2) is True
    assert supersede.go_ahead(client, prefix, TASK, window_s=0.2) is False
    wait_until(lambda: not client.exists(supersede.key(prefix, TASK)), timeout=5, what="the window's key expired")
    assert supersede.go_ahead(client, prefix, TASK, window_s=0.2) is True


def test_an_unreachable_redis_lets_every_run_go_ahead(prefix) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5)
    before = superseded_count()
    assert [supersede.go_ahead(down, prefix, TASK, window_s=30) for _ in range(2)] == [True, True]
    assert superseded_count() == before
