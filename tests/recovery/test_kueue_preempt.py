"""Kueue's preemption of a running dispatch, on each cluster (localcluster, and the real
kube-apiserver with the real Job controller), through the real delivery path: the Job is
suspended while its Pod runs (what Kueue does to a preempted Workload), so the Job controller
deletes the Pod; that costs no attempt of its backoffLimit (0), and once admitted again the
dispatch runs and is delivered exactly once, COMPLETED.
"""

from __future__ import annotations

import uuid
from typing import Any

import kubernetes
import pytest
from forged_jobs import SIM
from runtimes import runtime_values
from test_kueue_unsuspend import QUEUE, admit, events, job, pods, queued, state

from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.ops.processes import wait_until
from k8s_dispatch.recovery.sweep import run_sweep
from k8s_dispatch.store import migrate
from k8s_dispatch.store.models import DispatchState, EventType
from k8s_dispatch.workers.manifest import job_name

CAPABILITIES = {
    "capabilities": {
        "sim.queued": {
            "worker": "sim", "image": "sim:1", "queue": QUEUE,
            "annotations": {SIM + "duration-ms": "4000", SIM + "result": '{"ran": true}'},
        },
    }
}  # fmt: skip


@pytest.fixture
def runtime_env(any_cluster, new_pg_database, redis_url, key_prefix, tmp_path) -> dict[str, str]:
    database_url = new_pg_database()
    migrate.upgrade(database_url)
    namespace = any_cluster.ensure_namespace(f"kp-{uuid.uuid4().hex[:8]}")
    return runtime_values(
        database_url=database_url, redis_url=redis_url, prefix=f"{key_prefix}-{uuid.uuid4().hex[:8]}",
        namespace=namespace, kubeconfig=any_cluster.kubeconfig, capabilities=CAPABILITIES,
        tmp=tmp_path, sweep_grace_s="0",
    )  # fmt: skip


def preempt(rt: Runtime, dispatch_id: str) -> None:
    """What Kueue's Job reconciler does to a preempted Workload's Job: suspend it (one update)."""
    api = kubernetes.config.new_client_from_config(config_file=str(rt.settings.kubeconfig))
    try:
        kubernetes.client.BatchV1Api(api).patch_namespaced_job(
            job_name(dispatch_id), rt.settings.namespace, {"spec": {"suspend": True}}
        )
    finally:
        api.close()


def running(pod: dict[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") == "Running" and not pod["metadata"].get("deletionTimestamp")


def test_a_preempted_dispatch_costs_no_attempt_and_completes_once_admitted_again(rt, notified):
    dispatch_id = queued(rt, "sim.queued")
    admit(rt, dispatch_id)
    wait_until(lambda: any(running(p) for p in pods(rt)), timeout=30.0, what="its Pod running")

    preempt(rt, dispatch_id)

    def suspended_without_a_pod() -> bool:
        status = job(rt, dispatch_id).get("status") or {}
        conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
        return conditions.get("Suspended") == "True" and not status.get("active") and not any(map(running, pods(rt)))

    wait_until(suspended_without_a_pod, timeout=30.0, what="the Job suspended, its Pod stopped")
    status = job(rt, dispatch_id).get("status") or {}
    assert not status.get("failed"), status  # the Pod the suspend stopped is no failure
    assert run_sweep(rt).errors == 0 and state(rt, dispatch_id) is DispatchState.CREATED

    admit(rt, dispatch_id)

    def delivered() -> bool:
        assert run_sweep(rt).errors == 0  # the sweep delivers a finished Job (category 2)
        return state(rt, dispatch_id) is not DispatchState.CREATED

    wait_until(delivered, timeout=60.0, interval=0.3, what="the re-admitted dispatch delivered")
    run_sweep(rt)  # again: nothing twice
    assert state(rt, dispatch_id) is DispatchState.COMPLETED
    [scheduled, (completed, payload)] = events(rt, dispatch_id)
    assert scheduled[0] == EventType.WORKER_SCHEDULED and completed == EventType.WORKER_COMPLETED
    assert payload["output"] == {"ran": True}, payload
    assert notified.ids == [dispatch_id]
