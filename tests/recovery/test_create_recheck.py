"""A slow `create_jobs` batch (here: its first create answered 429 with a Retry-After longer
than RECHECK_S) reads its remaining rows again before the next create: a dispatch that ended
meanwhile gets no Job, so its work never runs a second time. localcluster (its fault switch)."""

from __future__ import annotations

import threading
import uuid

import pytest
from runtimes import runtime_values

from k8s_dispatch.engine import store
from k8s_dispatch.engine.db import transaction
from k8s_dispatch.engine.models import EventType
from k8s_dispatch.ops.processes import wait_until
from k8s_dispatch.recovery import delivery
from k8s_dispatch.recovery.runtime import Runtime

SIM = "localcluster.k8s-dispatch.io/"
CAPABILITIES = {
    "capabilities": {"sim.ok": {"worker": "sim", "image": "sim:1", "annotations": {SIM + "duration-ms": "20"}}}
}


@pytest.fixture
def runtime_env(sim_cluster, pg_url, redis_url, key_prefix, tmp_path) -> dict[str, str]:
    return runtime_values(
        database_url=pg_url, redis_url=redis_url, prefix=f"{key_prefix}-recheck", namespace=f"rc-{uuid.uuid4().hex[:8]}",
        kubeconfig=sim_cluster.kubeconfig, capabilities=CAPABILITIES, tmp=tmp_path,
    )  # fmt: skip


def creates(cluster) -> int:
    return sum(
        c.count
        for c in cluster.request_counts()
        if c.labels.verb == "POST" and c.labels.resource == "jobs" and c.code == 201
    )


def schedule(rt: Runtime) -> str:
    case_id = f"case-{uuid.uuid4().hex[:8]}"
    with transaction(rt.sessions) as session:
        store.create_case(session, case_id=case_id, tenancy_id="t")
        return store.schedule(
            session, case_id=case_id, tenancy_id="t", capability="sim.ok", input={}, idempotency_key=case_id,
            router=rt.resolver, max_input_bytes=1000,
        ).dispatch_id  # fmt: skip


def test_a_dispatch_that_ended_while_its_batch_waited_gets_no_job(rt: Runtime, sim_cluster) -> None:
    first, second = schedule(rt), schedule(rt)
    before = creates(sim_cluster)
    sim_cluster.call(lambda core: core.faults.throttle(1, 2 * delivery.RECHECK_S))  # the first create waits
    outcomes: dict[str, delivery.CreateOutcome] = {}
    batch = threading.Thread(target=lambda: outcomes.update(delivery.create_jobs_for(rt, [first, second])))
    batch.start()
    wait_until(lambda: sim_cluster.call(lambda core: core.faults.throttled) == 0, timeout=10, what="the 429 answered")
    with transaction(rt.sessions) as session:  # ended elsewhere while the batch waits (a cancel)
        store.record_terminal(session, second, EventType.WORKER_CANCELLED, {"reason": "Cancelled"})
    batch.join(timeout=30)
    assert outcomes == {first: delivery.CreateOutcome.CREATED, second: delivery.CreateOutcome.SKIPPED}
    assert creates(sim_cluster) - before == 1  # the ended one's Job was never made
