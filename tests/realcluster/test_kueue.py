"""Kueue's own controller (built from sigs.k8s.io/kueue by tools/build.sh) on a real control plane
of this module's own: a ClusterQueue whose quota holds one Job's CPU, a LocalQueue named by a
capability's `queue:`, and two dispatches through the real delivery path (`create_jobs_for`, the
sweep) on real PostgreSQL and Redis. Sampled every 100 ms by label: never both running, one
queued (suspended) while the other runs, each admitted through a Workload Kueue made, the second
only after the first finished (past its own startTimeoutSeconds, which never fails it), and both
delivered exactly once."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config

from k8s_dispatch.core.settings import load_settings
from k8s_dispatch.delivery import create
from k8s_dispatch.delivery.records import load_records
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.lab.realcluster.controlplane import ControlPlane
from k8s_dispatch.lab.realcluster.kueue import GROUP, VERSION, Kueue
from k8s_dispatch.recovery.sweep import run_sweep
from k8s_dispatch.store import dispatches, migrate
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import DispatchState, EventType
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.job_status import job_state
from k8s_dispatch.workers.manifest import job_name
from k8s_dispatch.workers.pod_health import is_suspended
from tests.recovery.runtimes import Notified, runtime_values, schedule

SIM = "localcluster.k8s-dispatch.io/"
RUN_MS = 3000  # each Job's run: longer than the second one's start clock
START_S = 1
QUEUE = "team-a"


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ControlPlane, Kueue]]:
    """A control plane of this module's own (Kueue's CRDs and controller stay off the session's)."""
    directory = tmp_path_factory.mktemp("kueue-plane")
    cp = ControlPlane(directory=directory / "cp", mode="simulate")
    cp.start()
    kueue = Kueue(cp, directory=directory / "kueue")
    try:
        kueue.start()
        yield cp, kueue
    finally:
        kueue.stop()
        cp.stop()


def custom(api: client.ApiClient) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api)


def make_queues(cp: ControlPlane, namespace: str, *, cpu: str) -> str:
    """A ResourceFlavor, a ClusterQueue with `cpu` of it for `namespace` only, and the LocalQueue
    QUEUE pointing at it; returns once Kueue reports the LocalQueue Active."""
    suffix = uuid.uuid4().hex[:6]
    flavor, cluster_queue = f"flavor-{suffix}", f"cq-{suffix}"
    with config.new_client_from_config(config_file=str(cp.kubeconfig)) as api:
        objects = custom(api)
        objects.create_cluster_custom_object(
            GROUP, VERSION, "resourceflavors",
            {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceFlavor", "metadata": {"name": flavor}},
        )  # fmt: skip
        objects.create_cluster_custom_object(
            GROUP, VERSION, "clusterqueues",
            {
                "apiVersion": f"{GROUP}/{VERSION}", "kind": "ClusterQueue", "metadata": {"name": cluster_queue},
                "spec": {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                    "resourceGroups": [{
                        "coveredResources": ["cpu"],
                        "flavors": [{"name": flavor, "resources": [{"name": "cpu", "nominalQuota": cpu}]}],
                    }],
                },
            },
        )  # fmt: skip
        objects.create_namespaced_custom_object(
            GROUP, VERSION, namespace, "localqueues",
            {
                "apiVersion": f"{GROUP}/{VERSION}", "kind": "LocalQueue",
                "metadata": {"name": QUEUE, "namespace": namespace}, "spec": {"clusterQueue": cluster_queue},
            },
        )  # fmt: skip

        def active() -> bool:
            lq = objects.get_namespaced_custom_object(GROUP, VERSION, namespace, "localqueues", QUEUE)
            conditions = (lq.get("status") or {}).get("conditions") or []
            return any(c.get("type") == "Active" and c.get("status") == "True" for c in conditions)

        _wait(active, timeout=60.0, what="the LocalQueue Active")
    return cluster_queue


def _wait(condition: Any, *, timeout: float, what: str, details: Any = None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout:.0f}s waiting for {what}" + (f"\n{details()}" if details else "")
            )
        time.sleep(0.1)


@pytest.fixture
def notified() -> Notified:
    return Notified()


@pytest.fixture
def rt(plane, notified, new_pg_database, redis_url, key_prefix, tmp_path: Path) -> Iterator[Runtime]:
    cp, _ = plane
    namespace = f"kq-{uuid.uuid4().hex[:8]}"
    with config.new_client_from_config(config_file=str(cp.kubeconfig)) as api:
        client.CoreV1Api(api).create_namespace({"metadata": {"name": namespace}})
        core = client.CoreV1Api(api)
        _wait(lambda: _has_default_account(core, namespace), timeout=60.0, what="the default ServiceAccount")
    database_url = new_pg_database()
    migrate.upgrade(database_url)
    capabilities = {
        "capabilities": {
            "sim.kueue": {
                "worker": "sim", "image": "sim:1", "queue": QUEUE, "startTimeoutSeconds": START_S,
                "resources": {"requests": {"cpu": "1"}},
                "annotations": {SIM + "duration-ms": str(RUN_MS), SIM + "result": '{"ran": true}'},
            }
        }
    }  # fmt: skip
    values = runtime_values(
        database_url=database_url, redis_url=redis_url, prefix=f"{key_prefix}-{uuid.uuid4().hex[:8]}",
        namespace=namespace, kubeconfig=cp.kubeconfig, capabilities=capabilities, tmp=tmp_path, sweep_grace_s="0",
    )  # fmt: skip
    runtime = Runtime.from_settings(load_settings(values), notifier=notified)
    yield runtime
    runtime.close()


def _has_default_account(core: client.CoreV1Api, namespace: str) -> bool:
    try:
        core.read_namespaced_service_account("default", namespace)
        return True
    except client.ApiException as e:
        if e.status != 404:
            raise
        return False


def test_two_dispatches_of_a_one_job_queue_run_one_after_the_other_and_both_complete(plane, rt, notified):
    cp, kueue = plane
    namespace = rt.settings.namespace
    make_queues(cp, namespace, cpu="1")  # room for one Job's `requests: {cpu: 1}`
    ids = [schedule(rt, "sim.kueue", {"i": i}) for i in range(2)]
    create.create_jobs_for(rt, ids)
    names = {job_name(d): d for d in ids}

    running_at_once = 0
    queued_behind: set[str] = set()  # a Job seen suspended while the other ran
    resumed: dict[str, float] = {}
    finished: dict[str, float] = {}
    workloads: set[str] = set()
    last_sweep = 0.0
    api = config.new_client_from_config(config_file=str(cp.kubeconfig))
    try:
        objects = custom(api)
        deadline = time.monotonic() + 120
        while not all(r.state is not DispatchState.CREATED for r in load_records(rt, ids).values()):
            assert time.monotonic() < deadline, f"not delivered in time:\n{kueue.log_tail()}"
            now = time.monotonic()
            pages = rt.kube.iter_jobs(namespace, label_selector=job_labels.selector())
            jobs = {j["metadata"]["name"]: j for page in pages for j in page}
            running = [n for n, j in jobs.items() if not is_suspended(j) and not job_state(j).terminal]
            running_at_once = max(running_at_once, len(running))
            if running:
                queued_behind |= {n for n, j in jobs.items() if is_suspended(j)}
            for name in running:
                resumed.setdefault(name, now)
            for name, j in jobs.items():
                if job_state(j).terminal:
                    finished.setdefault(name, now)
            for name in set(resumed) - set(jobs):  # finished, delivered and deleted between two samples
                finished.setdefault(name, now)
            listed = objects.list_namespaced_custom_object(GROUP, VERSION, namespace, "workloads")["items"]
            workloads |= {w["metadata"]["name"] for w in listed if (w.get("status") or {}).get("admission")}
            if now - last_sweep >= 0.5:  # the beat's sweep, which delivers finished Jobs
                assert run_sweep(rt).errors == 0
                last_sweep = now
            time.sleep(0.1)
    finally:
        api.close()

    assert running_at_once == 1, "the quota holds one Job: never two running"
    assert len(queued_behind) == 1 and queued_behind <= set(names), queued_behind
    assert set(resumed) == set(names) and len(workloads) == 2, (resumed, workloads)
    [second] = queued_behind
    [first] = set(names) - {second}
    # Kueue admitted the second only once the first's quota was freed: when it finished.
    assert resumed[second] >= finished[first], (resumed, finished)
    records = load_records(rt, ids)
    assert all(r.state is DispatchState.COMPLETED for r in records.values()), records
    for dispatch_id in ids:
        with transaction(rt.sessions) as session:
            kinds = [e.type for e in dispatches.events_for(session, dispatch_id)]
        assert kinds == [EventType.WORKER_SCHEDULED, EventType.WORKER_COMPLETED], kinds
    assert sorted(notified.ids) == sorted(ids)
