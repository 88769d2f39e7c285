"""A restart of Redis under busy Celery workers: real `celery -A k8s_dispatch.tasks worker` processes
and beat on a redis-server of this test's own (lab.chaos.services.OwnRedis: SIGKILLed, then started
again on its port and files), PostgreSQL and localcluster (with API latency, so tasks are still
running when the broker goes). The workers must live through it and go on consuming, and every
dispatch, fed before, during and after the outage, must end exactly once.

Celery 5.7's consumer closes its broker connection after `collect()` has detached it; kombu's Redis
channels then rebuilt their pool from the detached connection to give back the unacknowledged
messages, raised AttributeError, and the worker exited ("Unrecoverable error"). tasks/broker.py
gives the consumer channels that fail as a lost connection instead.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from k8s_dispatch.demo.localcluster import LocalCluster
from k8s_dispatch.lab.chaos.services import OwnRedis
from tests.tasks.conftest import Deployment, Proc

# The fixture, here on the test's own Redis (`redis_url` below).
from tests.tasks.conftest import deploy as deploy

SIM = "localcluster.k8s-dispatch.io/"
CAPABILITIES = {"sim.ok": {"worker": "sim", "image": "sim:1", "annotations": {SIM + "duration-ms": "300"}}}
# As the chaos run deploys: a message lost with the broker's last second (its append-only file is
# fsynced once a second) is found by the sweep, an unacknowledged one is delivered again.
SETTINGS = {"sweep_interval_s": "5", "sweep_grace_s": "10", "broker_visibility_timeout_s": "60",
            "poll_interval_s": "0.5"}  # fmt: skip
RESTARTS = 2
BATCHES = 4  # of 10 dispatches, before each restart and once more at the end
LOST = "Connection to broker lost"
CONNECTED = "Connected to "


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[OwnRedis]:
    server = OwnRedis(directory=tmp_path / "redis", log_dir=tmp_path, env=dict(os.environ))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(own_redis: OwnRedis) -> str:
    """The `deploy` fixture's Redis: this test's own, which it may restart."""
    return own_redis.url


@pytest.fixture
def key_prefix() -> str:
    return f"k8s-dispatch-test-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def slow_cluster() -> Iterator[LocalCluster]:
    """localcluster answering each request 100 ms late: creates and polls are still running when
    the broker goes."""
    with LocalCluster(mode="simulate", latency_ms=100) as cluster:
        yield cluster


def unacked(d: Deployment) -> set[bytes]:
    """The delivery tags of messages delivered to a worker and not acknowledged yet."""
    try:
        return set(d.redis.hkeys(f"{d.prefix}:unacked"))
    except redis.RedisError:
        return set()


def assert_alive(workers: list[Proc]) -> None:
    """Each worker is the process started at the beginning, and has not begun to exit."""
    for w in workers:
        assert w.managed.alive and w.managed.starts == 1, f"{w.name} exited ({w.managed.returncode})\n{w.tail(80)}"
        assert "Unrecoverable error" not in w.log(), w.tail(80)


def wait_alive(d: Deployment, workers: list[Proc], condition: Callable[[], bool], *, what: str) -> None:
    """Wait for `condition`, failing at once should a worker exit meanwhile."""

    def holds() -> bool:
        assert_alive(workers)
        return condition()

    d.wait(holds, timeout_s=60, what=what)


def restart_under_load(d: Deployment, server: OwnRedis, workers: list[Proc], *, held: set[bytes]) -> set[bytes]:
    """SIGKILL Redis while workers hold messages delivered since `held` (the unacknowledged ones
    the last restart left: delivered again only after the visibility timeout); start it again
    once every worker has seen the connection go (or at once, should one not); wait for every
    worker to connect again. Returns the unacknowledged messages it left."""
    wait_alive(d, workers, lambda: bool(unacked(d) - held), what="a worker holding messages it was just delivered")
    lost = {w.name: w.log().count(LOST) for w in workers}
    connected = {w.name: w.log().count(CONNECTED) for w in workers}
    server.proc.kill(signal.SIGKILL)
    try:
        wait_alive(d, workers, lambda: all(w.log().count(LOST) > lost[w.name] for w in workers),
                   what="every worker losing its broker connection")  # fmt: skip
    finally:
        server.start()
    wait_alive(d, workers, lambda: all(w.log().count(CONNECTED) > connected[w.name] for w in workers),
               what="every worker connected again")  # fmt: skip
    return unacked(d)


def test_busy_workers_live_through_a_redis_restart_and_every_dispatch_ends_once(deploy, own_redis, slow_cluster):
    d = deploy(slow_cluster, capabilities=CAPABILITIES, **SETTINGS)
    workers = [d.start_worker(f"w{i}") for i in range(2)]
    d.start_beat()
    ids: list[str] = []
    held: set[bytes] = set()
    for _ in range(RESTARTS):
        for _ in range(BATCHES):
            ids += d.schedule_batch("sim.ok", 10)
        held = restart_under_load(d, own_redis, workers, held=held)
    assert_alive(workers)
    received = {w.name: w.log().count("] received") for w in workers}
    for _ in range(BATCHES):  # after the restarts: consumed by the same processes
        ids += d.schedule_batch("sim.ok", 10)

    events = d.wait_terminal(ids, timeout_s=180)
    assert {d_id: len(e) for d_id, e in events.items() if len(e) != 1} == {}
    assert all(e[0][0] == "WORKER_COMPLETED" for e in events.values()), events
    d.wait_no_jobs(timeout_s=60)
    assert_alive(workers)
    for w in workers:
        d.wait(lambda w=w: w.log().count("] received") > received[w.name], timeout_s=60,
               what=f"{w.name} receiving a task after the restarts")  # fmt: skip
