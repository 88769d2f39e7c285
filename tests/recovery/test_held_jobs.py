"""A Job labelled `delivered=true` by hand whose dispatch's end is recorded before any sweep noted
the edit (a stopping worker's last pass read it just before; its release then met a 500): out of
every selector of ours but the bulk delete's, which leaves it held by our finalizer for ever. The
sweep's LIST of the delivered Jobs releases and deletes it; where the watch is followed, poll notes
it gone and the next sweep does the same, though the namespace's next LIST is an hour away. Each
cluster, real PostgreSQL and Redis; poll and the sweep run in-process."""

from __future__ import annotations

import uuid
from typing import Any

import kubernetes
import pytest
from forged_jobs import SIM
from runtimes import runtime_values, schedule

from k8s_dispatch.core.errors import NotFound
from k8s_dispatch.delivery import create, jobwatch
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.ops.processes import wait_until
from k8s_dispatch.recovery.sweep import run_sweep
from k8s_dispatch.store import dispatches, migrate
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import DispatchState, EventType
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.job_status import job_state
from k8s_dispatch.workers.manifest import FINALIZER, job_name

CAPABILITIES = {
    "capabilities": {"sim.slow": {"worker": "sim", "image": "sim:1", "annotations": {SIM + "duration-ms": "2000"}}}
}


@pytest.fixture
def runtime_env(any_cluster, new_pg_database, redis_url, key_prefix, tmp_path) -> dict[str, str]:
    database_url = new_pg_database()
    migrate.upgrade(database_url)
    namespace = any_cluster.ensure_namespace(f"hj-{uuid.uuid4().hex[:8]}")
    return runtime_values(
        database_url=database_url, redis_url=redis_url, prefix=f"{key_prefix}-{uuid.uuid4().hex[:8]}",
        namespace=namespace, kubeconfig=any_cluster.kubeconfig, capabilities=CAPABILITIES,
        tmp=tmp_path, sweep_grace_s="0", tampered_grace_s="300",
    )  # fmt: skip


def hand_label(rt: Runtime, name: str) -> None:
    """An operator's `kubectl label job NAME k8s-dispatch.io/delivered=true`."""
    api = kubernetes.config.new_client_from_config(config_file=str(rt.settings.kubeconfig))
    try:
        kubernetes.client.BatchV1Api(api).patch_namespaced_job(
            name, rt.settings.namespace, {"metadata": {"labels": {job_labels.DELIVERED_LABEL: job_labels.DELIVERED}}}
        )
    finally:
        api.close()


def job_or_none(rt: Runtime, name: str) -> dict[str, Any] | None:
    try:
        return rt.kube.get_job(rt.settings.namespace, name)
    except NotFound:
        return None


def poll(rt: Runtime) -> None:
    """One poll of the namespace's watch; nothing finished is in its selector to hand off."""
    settings = rt.settings
    jobwatch.poll_namespace(
        rt.kube, rt.redis, prefix=settings.key_prefix, deployment=settings.effective_deployment,
        namespace=settings.namespace, page_size=10, poll_interval_s=1.0, hand_off=lambda jobs: 0,
    )  # fmt: skip


def terminal_events(rt: Runtime, dispatch_id: str) -> list[str]:
    with transaction(rt.sessions) as session:
        return [e.type for e in dispatches.events_for(session, dispatch_id) if e.type != "WORKER_SCHEDULED"]


@pytest.mark.parametrize("followed", [False, True], ids=["listed", "watch-followed"])
def test_a_job_labelled_delivered_by_hand_whose_end_is_recorded_is_let_go(make_runtime, followed: bool) -> None:
    rt = make_runtime()
    namespace = rt.settings.namespace
    watch = jobwatch.key(rt.settings.key_prefix, rt.settings.effective_deployment, namespace)
    dispatch_id = schedule(rt, "sim.slow")
    create.create_job_for(rt, dispatch_id)
    name = job_name(dispatch_id)
    if followed:
        poll(rt)  # the watch's position, from a LIST that holds the running Job
    hand_label(rt, name)
    with transaction(rt.sessions) as session:  # the last pass's record; its release never came
        dispatches.record_terminal(session, dispatch_id, EventType.WORKER_COMPLETED, {"output": {"n": 1}})
    wait_until(lambda: job_state(rt.kube.get_job(namespace, name)).terminal, what="the Job finished", timeout=30.0)
    job = rt.kube.get_job(namespace, name)
    assert FINALIZER in (job["metadata"].get("finalizers") or [])
    with transaction(rt.sessions) as session:
        assert dispatches.get_dispatch(session, dispatch_id).job_tampered_at is None  # never noted

    if followed:
        # Poll sees the Job leave its selector, labelled delivered with our finalizer on: not our
        # release. The watch is healthy and the namespace's next LIST an hour away.
        wait_until(lambda: poll(rt) or dispatch_id in jobwatch.gone(rt.redis, watch), what="noted gone", timeout=30)
        rt.redis.set(jobwatch.healthy_key(watch), 1, ex=600)
        rt.redis.set(jobwatch.listed_key(watch), 1, ex=600)

    def let_go() -> bool:
        return run_sweep(rt, watched=followed) is not None and job_or_none(rt, name) is None

    wait_until(let_go, what="the held Job released and deleted", timeout=30.0)
    pods = rt.kube.list_pods(namespace, label_selector=f"batch.kubernetes.io/job-name={name}")
    assert all(FINALIZER not in (p["metadata"].get("finalizers") or []) for p in pods)
    assert terminal_events(rt, dispatch_id) == [EventType.WORKER_COMPLETED]
    with transaction(rt.sessions) as session:
        assert dispatches.get_dispatch(session, dispatch_id).state == DispatchState.COMPLETED
    if followed:
        run_sweep(rt, watched=True)
        assert dispatch_id not in jobwatch.gone(rt.redis, watch)  # let go: forgotten
