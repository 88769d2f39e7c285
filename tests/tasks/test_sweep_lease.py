"""A sweep under way holds a lease (`tasks.lease`): beat's sweeps due meanwhile on any replica skip
at once instead of running beside it (real worker and beat, localcluster, Redis); and the lease
a long run keeps is renewed while it runs and let go when it ends (real Redis)."""

from __future__ import annotations

import re
import threading
import time
import uuid

import redis

from k8s_dispatch import celeryconfig as names
from k8s_dispatch.tasks import lease

SKIPPED = "k8s-dispatch.sweep skipped: the previous run is still under way"
SWEPT = re.compile(r"Task k8s-dispatch\.sweep\[[^\]]*\] succeeded in [\d.]+s: \{'(?!running|superseded)")


def test_a_sweep_under_way_makes_the_next_ones_skip_until_it_ends(deploy, sim_cluster):
    d = deploy(sim_cluster, capabilities={"sim.quick": {"worker": "sim", "image": "sim:1"}}, sweep_interval_s="0.5")
    worker = d.start_worker("w1")
    d.start_beat()
    d.wait(lambda: SWEPT.search(worker.log()), what="a first sweep")
    name = lease.key(d.prefix, names.SWEEP_TASK)
    d.wait(lambda: d.redis.set(name, "another-replica", nx=True, px=60_000), what="the lease held")
    skipped = worker.log().count(SKIPPED)
    d.wait(lambda: worker.log().count(SKIPPED) >= skipped + 3, what="3 sweeps skipped")
    swept = len(SWEPT.findall(worker.log()))
    d.redis.delete(name)
    d.wait(lambda: len(SWEPT.findall(worker.log())) >= swept + 2, what="sweeping going on")


def test_a_kept_lease_outlives_its_ttl_while_the_run_lasts_and_is_released_after(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    prefix, task = f"k8s-dispatch-test-{uuid.uuid4().hex[:8]}", "k8s-dispatch.sweep"
    try:
        running = lease.take(client, prefix, task, ttl_s=0.3)
        assert running is not None
        done = threading.Event()
        with lease.kept(running, every_s=0.1):
            deadline = time.monotonic() + 1.5  # five TTLs: held only if renewed
            while time.monotonic() < deadline:
                assert lease.take(client, prefix, task, ttl_s=0.3) is None
                done.wait(0.1)
        assert client.get(lease.key(prefix, task)) is None  # released, not left to expire
        assert lease.take(client, prefix, task, ttl_s=0.3) is not None
    finally:
        client.delete(lease.key(prefix, task))
        client.close()
