"""With real `celery -A k8s_dispatch.tasks worker|beat` processes, PostgreSQL, Redis and localcluster: two
deployments sharing a namespace with ORPHAN_POLICY=delete each deliver all their own work and
touch none of the other's; a worker killed between creating a Job and marking it, then workers
started on a config that moved the capability's namespace, still make one Job per dispatch."""

from __future__ import annotations

import signal
import uuid
from typing import Any

from k8s_dispatch.delivery.crashpoints import ENV_VAR as CRASH_AT
from k8s_dispatch.delivery.crashpoints import Point
from k8s_dispatch.delivery.stats import Stats
from k8s_dispatch.demo.localcluster import LocalCluster
from k8s_dispatch.recovery.executor import ORPHANS_REPORTED
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import EventType
from k8s_dispatch.tasks.scheduling import schedule_in_session
from k8s_dispatch.workers.resolver import CapabilityResolver
from tests.tasks.conftest import Deployment, capabilities_file, wait_until

SIM = "localcluster.k8s-dispatch.io/"


def sim(duration_ms: int, namespace: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"worker": "sim", "image": "sim:1", "annotations": {SIM + "duration-ms": str(duration_ms)}}
    if namespace is not None:
        spec["namespace"] = namespace
    return spec


def schedule(d: Deployment, capability: str, count: int) -> dict[str, Any]:
    """Dispatches written in one engine transaction (`create_jobs` sent after commit): id -> input."""
    case_id = d.new_case()
    resolver = CapabilityResolver.from_settings(d.settings)
    inputs = [{"capability": capability, "i": i} for i in range(count)]
    with transaction(d.sessions) as session:
        return {
            schedule_in_session(
                session, via=d.producer, case_id=case_id, tenancy_id="tenant-a", capability=capability, input=value,
                idempotency_key=f"key-{uuid.uuid4()}", router=resolver, max_input_bytes=d.settings.max_input_bytes,
            ).dispatch_id: value
            for value in inputs
        }  # fmt: skip


def job_requests(cluster: LocalCluster, verb: str, code: int | None = None) -> int:
    """Requests on Jobs the API server answered so far with `verb` (and `code`), in every namespace."""
    return sum(
        c.count
        for c in cluster.request_counts()
        if c.labels.verb == verb and c.labels.resource == "jobs" and (code is None or c.code == code)
    )


def job_creates(cluster: LocalCluster) -> int:
    """Jobs the API server created so far (successful POSTs), in every namespace."""
    return job_requests(cluster, "POST", 201)


def assert_completed_once(d: Deployment, inputs: dict[str, Any]) -> None:
    for dispatch_id, events in d.wait_terminal(list(inputs), timeout_s=120).items():
        expected = [(EventType.WORKER_COMPLETED, {"output": {"simulated": True, "input": inputs[dispatch_id]}})]
        assert events == expected, dispatch_id


def test_two_deployments_on_one_namespace_with_orphan_policy_delete_touch_none_of_each_others_jobs(deploy, sim_cluster):
    shared = f"shared-{uuid.uuid4().hex[:8]}"
    caps = {"sim.slow": sim(1500), "sim.quick": sim(50)}
    knobs = dict(namespace=shared, orphan_policy="delete", sweep_interval_s="1", sweep_grace_s="1")
    a, b = deploy(sim_cluster, capabilities=caps, **knobs), deploy(sim_cluster, capabilities=caps, **knobs)
    for d in (a, b):
        d.start_worker("worker")
        d.start_beat()
    before = job_creates(sim_cluster)
    work = {id(d): {**schedule(d, "sim.slow", 12), **schedule(d, "sim.quick", 12)} for d in (a, b)}

    # The slow Jobs run through a dozen sweeps of the other deployment, which lists the namespace.
    for d in (a, b):
        assert_completed_once(d, work[id(d)])
    a.wait_no_jobs(timeout_s=30)  # every deployment's Jobs: none left
    assert job_creates(sim_cluster) - before == 48  # each Job once: none deleted and made again
    for d in (a, b):  # neither ever saw the other's Jobs, so neither could release or delete one
        assert Stats(d.redis, prefix=d.prefix).get(ORPHANS_REPORTED) == 0, d.logs()
        assert "orphan policy" not in d.logs()


def test_a_crash_between_create_and_mark_then_a_namespace_change_still_makes_one_job(deploy, sim_cluster, tmp_path):
    ns_a, ns_b = f"ns-a-{uuid.uuid4().hex[:6]}", f"ns-b-{uuid.uuid4().hex[:6]}"
    d = deploy(sim_cluster, capabilities={"sim.ok": sim(50, ns_a)}, sweep_interval_s="1", sweep_grace_s="1")
    moved = capabilities_file(tmp_path / "moved.yaml", {"sim.ok": sim(50, ns_b)})
    before = job_creates(sim_cluster)

    doomed = d.start_worker("doomed", env={CRASH_AT: Point.AFTER_JOB_CREATE.value})
    ids = schedule(d, "sim.ok", 4)
    wait_until(
        lambda: not doomed.managed.alive, timeout_s=60, what="the worker to die at its crash point", on_fail=doomed.tail
    )
    assert doomed.managed.returncode == -signal.SIGKILL
    d.procs.remove(doomed)
    assert job_creates(sim_cluster) - before == 1  # one Job made, its row not marked
    assert [j["metadata"]["namespace"] for j in d.jobs(ns_a)] == [ns_a]

    # Restarted on the new config: its start-up sweep and beat's sweeps find the first Job where
    # the dispatch recorded it, and make the others there too.
    d.start_worker("moved", env={"K8S_DISPATCH_CAPABILITIES": str(moved)})
    d.start_beat()
    assert_completed_once(d, ids)
    wait_until(lambda: not d.jobs(ns_a) and not d.jobs(ns_b), timeout_s=30, what="no Job left", on_fail=d.logs)
    assert job_creates(sim_cluster) - before == len(ids)
