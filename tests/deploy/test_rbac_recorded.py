"""The Role in deploy/rbac.yaml against the API calls the code really makes.

A local cluster records every request as RBAC sees it, (group, resource, verb). The whole
delivery path runs against it — create (and adopt), poll's paginated LIST, complete with its
Pod LIST, the release patch and the bulk delete (deletecollection), cancel with its delete, and
a recovery sweep that deletes an orphan —
and the record must equal what the Role grants: nothing missing, nothing granted unused.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from deploy_files import role_permissions

from engine import store
from engine.db import transaction
from engine.settings import load_settings
from localcluster import LocalCluster
from recovery import delivery
from recovery.reconcile import run_sweep
from recovery.runtime import Runtime
from tasks.processes import wait_until
from workers import labels as job_labels
from workers.job_status import job_state
from workers.resolver import CapabilityResolver
from workers.types import DispatchRef

SIM = "localcluster.k8s-dispatch.io/"
CAPABILITIES = {
    "capabilities": {
        "sim.ok": {"worker": "sim", "image": "sim:1", "annotations": {SIM + "duration-ms": "10"}},
        "sim.hang": {"worker": "sim", "image": "sim:1", "annotations": {SIM + "outcome": "hang"}},
    }
}


@pytest.fixture
def recorded() -> Iterator[LocalCluster]:
    with LocalCluster(mode="simulate") as cluster:
        yield cluster


@pytest.fixture
def rt(recorded: LocalCluster, new_pg_database, redis_url: str, key_prefix: str) -> Iterator[Runtime]:
    settings = load_settings(
        {
            "K8S_DISPATCH_DATABASE_URL": _migrated(new_pg_database()),
            "K8S_DISPATCH_REDIS_URL": redis_url,
            "K8S_DISPATCH_KEY_PREFIX": f"{key_prefix}-rbac",
            "K8S_DISPATCH_KUBECONFIG": str(recorded.kubeconfig),
            "K8S_DISPATCH_ORPHAN_POLICY": "delete",
            "K8S_DISPATCH_SWEEP_GRACE_S": "0",
        }
    )
    runtime = Runtime.from_settings(
        settings, notifier=lambda _id: None, resolver=CapabilityResolver.from_mapping(CAPABILITIES, source="<test>")
    )
    yield runtime
    runtime.close()


def _migrated(url: str) -> str:
    from engine import migrate

    migrate.upgrade(url)
    return url


def _schedule(rt: Runtime, capability: str) -> str:
    case_id = f"case-{uuid.uuid4().hex[:8]}"
    with transaction(rt.sessions) as session:
        store.create_case(session, case_id=case_id, tenancy_id="tenant-a")
        return store.schedule(
            session, case_id=case_id, tenancy_id="tenant-a", capability=capability, input={"n": 1},
            idempotency_key=f"key-{uuid.uuid4()}", router=rt.resolver, max_input_bytes=rt.settings.max_input_bytes,
        ).dispatch_id  # fmt: skip


def _finished(rt: Runtime, namespace: str, name: str) -> bool:
    return job_state(rt.kube.get_job(namespace, name)).terminal


def test_the_role_grants_exactly_the_calls_the_delivery_path_makes(recorded: LocalCluster, rt: Runtime) -> None:
    recorded.audit(clear=True)  # only what the project's code does from here on
    namespace = rt.settings.namespace
    done, running = _schedule(rt, "sim.ok"), _schedule(rt, "sim.hang")
    for dispatch_id in (done, running):
        assert delivery.create_job_for(rt, dispatch_id) is delivery.CreateOutcome.CREATED
    assert delivery.create_job_for(rt, done) is delivery.CreateOutcome.ADOPTED  # a duplicate message

    name = delivery.job_location(rt, delivery.load_record(rt, done))[1]
    wait_until(lambda: _finished(rt, namespace, name), timeout=15, what="the Job finished")
    finished = [j["metadata"]["name"] for page in rt.kube.iter_jobs(namespace, label_selector=job_labels.selector(),
                page_size=rt.settings.poll_page_size) for j in page if job_state(j).terminal]  # fmt: skip
    assert finished == [name]  # what poll does: one paginated LIST
    assert delivery.complete_job(rt, namespace, name) is delivery.CompleteOutcome.COMPLETED
    assert delivery.cancel_dispatch(rt, running, reason="UserCancelled")

    forged = DispatchRef(str(uuid.uuid4()), "case-x", "tenant-a", "sim.ok", "sim", "key-x")
    labels, annotations = job_labels.encode(forged, deployment=rt.settings.effective_deployment)
    rt.kube.create_job(namespace, {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": f"forged-{uuid.uuid4().hex[:6]}", "labels": labels, "annotations": annotations},
        "spec": {"template": {"spec": {"restartPolicy": "Never", "containers": [{"name": "worker", "image": "x"}]}}},
    })  # fmt: skip
    report = run_sweep(rt)
    assert not report.errors, report.to_dict()
    wait_until(lambda: not list(rt.kube.iter_jobs(namespace, label_selector=job_labels.selector(), page_size=50))[0],
               timeout=15, what="every Job gone (the orphan deleted by policy)")  # fmt: skip

    assert recorded.audit() == role_permissions()
