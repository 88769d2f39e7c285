"""A capability's Kueue `queue`, with the unsuspend done as Kueue's Job reconciler does it (one
update of the Job: `spec.suspend: false` with the admitted flavor's nodeSelector and Kueue's pod
labels merged into the template), on each cluster (localcluster, and the real kube-apiserver with
the real Job controller), through the real delivery path (`create_jobs_for`, the sweep) on real
PostgreSQL and Redis: a queued dispatch stays CREATED with no Pod far past its
startTimeoutSeconds, runs once unsuspended and is delivered exactly once; the start clock of a
resumed Job counts from its resume. (tests/realcluster/test_kueue.py does it with Kueue itself.)
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any

import kubernetes
import pytest
from forged_jobs import SIM
from runtimes import runtime_values, schedule

from k8s_dispatch.delivery import create, records
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.demo.localcluster import startfaults
from k8s_dispatch.ops.processes import wait_until
from k8s_dispatch.recovery.sweep import run_sweep
from k8s_dispatch.store import dispatches, migrate
from k8s_dispatch.store.db import database_now, transaction
from k8s_dispatch.store.models import DispatchState, EventType
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.manifest import QUEUE_NAME_LABEL, job_name
from k8s_dispatch.workers.pod_health import CHECK_GRACE, is_suspended

START_S = 2
# Longer than the start clock and the grace before a Job's Pods are read at all.
QUEUED_FOR = max(timedelta(seconds=START_S), CHECK_GRACE) + timedelta(seconds=1)
QUEUE = "team-a"
CAPABILITIES = {
    "capabilities": {
        "sim.queued": {
            "worker": "sim", "image": "sim:1", "queue": QUEUE, "startTimeoutSeconds": START_S,
            "annotations": {SIM + "duration-ms": "300", SIM + "result": '{"ran": true}'},
        },
        "sim.queued-nofit": {  # admitted to a flavor whose nodes never fit: Unschedulable once running
            "worker": "sim", "image": "sim:1", "queue": QUEUE, "startTimeoutSeconds": START_S,
            "annotations": {SIM + "unschedulable": "true"},
        },
    }
}  # fmt: skip


@pytest.fixture
def runtime_env(any_cluster, new_pg_database, redis_url, key_prefix, tmp_path) -> dict[str, str]:
    database_url = new_pg_database()
    migrate.upgrade(database_url)
    namespace = any_cluster.ensure_namespace(f"kq-{uuid.uuid4().hex[:8]}")
    return runtime_values(
        database_url=database_url, redis_url=redis_url, prefix=f"{key_prefix}-{uuid.uuid4().hex[:8]}",
        namespace=namespace, kubeconfig=any_cluster.kubeconfig, capabilities=CAPABILITIES,
        tmp=tmp_path, sweep_grace_s="0",
    )  # fmt: skip


def admit(rt: Runtime, dispatch_id: str) -> None:
    """What Kueue's Job reconciler does on admission (RunWithPodSetsInfo, then one Update): the
    flavor's node labels into the template's nodeSelector, its pod labels, and suspend false."""
    api = kubernetes.config.new_client_from_config(config_file=str(rt.settings.kubeconfig))
    try:
        kubernetes.client.BatchV1Api(api).patch_namespaced_job(
            job_name(dispatch_id),
            rt.settings.namespace,
            {
                "spec": {
                    "suspend": False,
                    "template": {
                        "metadata": {"labels": {"kueue.x-k8s.io/podset": "main"}},
                        "spec": {"nodeSelector": {"kubernetes.io/os": "linux"}},
                    },
                }
            },
        )
    finally:
        api.close()


def job(rt: Runtime, dispatch_id: str) -> dict[str, Any]:
    return rt.kube.get_job(rt.settings.namespace, job_name(dispatch_id))


def pods(rt: Runtime) -> list[dict[str, Any]]:
    return rt.kube.list_pods(rt.settings.namespace, label_selector=job_labels.selector())


def db_now(rt: Runtime) -> datetime:
    with transaction(rt.sessions) as session:
        return database_now(session)


def events(rt: Runtime, dispatch_id: str) -> list[tuple[EventType, dict[str, Any]]]:
    with transaction(rt.sessions) as session:
        return [(e.type, dict(e.payload)) for e in dispatches.events_for(session, dispatch_id)]


def state(rt: Runtime, dispatch_id: str) -> DispatchState:
    record = records.load_record(rt, dispatch_id)
    assert record is not None
    return record.state


def queued(rt: Runtime, capability: str) -> str:
    """One dispatch of `capability` with its Job created: suspended, labelled for the queue."""
    dispatch_id = schedule(rt, capability)
    create.create_jobs_for(rt, [dispatch_id])
    created = job(rt, dispatch_id)
    assert created["spec"]["suspend"] is True and created["metadata"]["labels"][QUEUE_NAME_LABEL] == QUEUE
    # The Job controller has seen it: Suspended=True on it, and it makes no Pod.
    wait_until(
        lambda: any(
            c.get("type") == "Suspended" for c in (job(rt, dispatch_id).get("status") or {}).get("conditions") or []
        ),
        timeout=20.0,
        what="the Job controller's Suspended condition",
    )
    return dispatch_id


def test_a_queued_dispatch_waits_past_its_start_clock_and_runs_once_when_admitted(rt, notified):
    dispatch_id = queued(rt, "sim.queued")
    assert is_suspended(job(rt, dispatch_id))
    # Past its start clock for real (sweeps meanwhile), then with the sweep's clock an hour on.
    deadline = db_now(rt) + QUEUED_FOR
    while db_now(rt) < deadline:
        assert run_sweep(rt).errors == 0
    assert run_sweep(rt, now=db_now(rt) + timedelta(hours=1)).errors == 0
    assert state(rt, dispatch_id) is DispatchState.CREATED
    assert [t for t, _ in events(rt, dispatch_id)] == [EventType.WORKER_SCHEDULED]
    assert pods(rt) == [] and job(rt, dispatch_id)["spec"]["suspend"] is True

    admit(rt, dispatch_id)

    def delivered() -> bool:
        assert run_sweep(rt).errors == 0  # the sweep delivers a finished Job (category 2)
        return state(rt, dispatch_id) is not DispatchState.CREATED

    wait_until(delivered, timeout=30.0, interval=0.2, what="the admitted dispatch delivered")
    run_sweep(rt)  # again: nothing twice
    assert state(rt, dispatch_id) is DispatchState.COMPLETED
    [scheduled, (completed, payload)] = events(rt, dispatch_id)
    assert scheduled[0] == EventType.WORKER_SCHEDULED and completed == EventType.WORKER_COMPLETED
    assert payload["output"] == {"ran": True}, payload
    assert notified.ids == [dispatch_id]


def test_a_resumed_jobs_start_clock_counts_from_its_resume(rt, notified):
    """Admitted after waiting past its start clock onto a flavor no node fits: the sweep waits a
    whole startTimeoutSeconds from the resume, then fails it Unschedulable, once."""
    dispatch_id = queued(rt, "sim.queued-nofit")
    deadline = db_now(rt) + QUEUED_FOR
    while db_now(rt) < deadline:
        assert run_sweep(rt).errors == 0
    admit(rt, dispatch_id)
    wait_until(
        lambda: [p for p in pods(rt) if startfaults.shows_unschedulable(p)],
        timeout=20.0,
        what="the resumed Job's Pod Unschedulable",
    )
    resumed = job(rt, dispatch_id)
    assert not is_suspended(resumed) and resumed["status"].get("startTime")
    now = db_now(rt)
    # Its age is past the start clock and the grace, its time since the resume is not: it waits.
    assert run_sweep(rt, now=now).errors == 0
    assert state(rt, dispatch_id) is DispatchState.CREATED
    later = now + QUEUED_FOR
    report = run_sweep(rt, now=later)
    assert report.errors == 0 and state(rt, dispatch_id) is DispatchState.FAILED
    run_sweep(rt, now=later)
    [_, (failed, payload)] = events(rt, dispatch_id)
    assert failed == EventType.WORKER_FAILED and payload["reason"] == "Unschedulable", payload
    assert notified.ids == [dispatch_id]
