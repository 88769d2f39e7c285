"""The Role in deploy/rbac.yaml against the API calls the code really makes.

A local cluster records every request as RBAC sees it, (group, resource, verb). The whole
delivery path runs against it — create (and adopt), poll's paginated LIST, complete with its
Pod LIST, the watch poll's LIST and WATCH, the release patch and the bulk delete (deletecollection), cancel with its delete, and
a recovery sweep that deletes an orphan —
and the record must equal what the Role grants: nothing missing, nothing granted unused.

The same path then runs on the real control plane as the Role's ServiceAccount (a token from the
TokenRequest API): there the real RBAC authorizer decides each request, and nothing is refused.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from clusters import ClusterHandle
from cryptography.fernet import Fernet
from deploy_files import DEPLOY, role_permissions

from k8s_dispatch.core.errors import ApiRejected
from k8s_dispatch.core.settings import load_settings
from k8s_dispatch.delivery import cancel, complete, create, disruptions, jobwatch, records
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.demo.localcluster import LocalCluster
from k8s_dispatch.ops.processes import wait_until
from k8s_dispatch.recovery.sweep import run_sweep
from k8s_dispatch.store import dispatches, scheduling
from k8s_dispatch.store.db import transaction
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.job_status import job_state
from k8s_dispatch.workers.resolver import CapabilityResolver
from k8s_dispatch.workers.types import DispatchRef

SIM = "localcluster.k8s-dispatch.io/"
RBAC_FILE = DEPLOY / "rbac.yaml"
INPUT_KEY = Fernet.generate_key().decode()
CAPABILITIES = {
    "capabilities": {
        "sim.ok": {"worker": "sim", "image": "sim:1", "annotations": {SIM + "duration-ms": "10"}},
        "sim.hang": {"worker": "sim", "image": "sim:1", "annotations": {SIM + "outcome": "hang"}},
        "sim.fail": {
            "worker": "sim",
            "image": "sim:1",
            "annotations": {SIM + "outcome": "fail", SIM + "duration-ms": "10", SIM + "log": "it broke\n"},
        },
    }
}


@pytest.fixture
def recorded() -> Iterator[LocalCluster]:
    with LocalCluster(mode="simulate") as cluster:
        yield cluster


def _runtime(
    database_url: str, redis_url: str, prefix: str, kubeconfig: Path, *, namespace: str = "default"
) -> Runtime:
    settings = load_settings(
        {
            "K8S_DISPATCH_DATABASE_URL": _migrated(database_url),
            "K8S_DISPATCH_REDIS_URL": redis_url,
            "K8S_DISPATCH_KEY_PREFIX": prefix,
            "K8S_DISPATCH_KUBECONFIG": str(kubeconfig),
            "K8S_DISPATCH_NAMESPACE": namespace,
            "K8S_DISPATCH_ORPHAN_POLICY": "delete",
            "K8S_DISPATCH_SWEEP_GRACE_S": "0",
            "K8S_DISPATCH_INPUT_KEY": INPUT_KEY,
        }
    )
    return Runtime.from_settings(
        settings, notifier=lambda _id: None, resolver=CapabilityResolver.from_mapping(CAPABILITIES, source="<test>")
    )


@pytest.fixture
def rt(recorded: LocalCluster, new_pg_database, redis_url: str, key_prefix: str) -> Iterator[Runtime]:
    runtime = _runtime(new_pg_database(), redis_url, f"{key_prefix}-rbac", recorded.kubeconfig)
    yield runtime
    runtime.close()


def _migrated(url: str) -> str:
    from k8s_dispatch.store import migrate

    migrate.upgrade(url)
    return url


def _schedule(rt: Runtime, capability: str, *, secret: bool = False) -> str:
    case_id = f"case-{uuid.uuid4().hex[:8]}"
    with transaction(rt.sessions) as session:
        scheduling.create_case(session, case_id=case_id, tenancy_id="tenant-a")
        return scheduling.schedule(
            session, case_id=case_id, tenancy_id="tenant-a", capability=capability, input={"n": 1},
            idempotency_key=f"key-{uuid.uuid4()}", router=rt.resolver, max_input_bytes=rt.settings.max_input_bytes,
            secret=secret, input_key=rt.settings.input_key,
        ).dispatch_id  # fmt: skip


def _finished(rt: Runtime, namespace: str, name: str) -> bool:
    return job_state(rt.kube.get_job(namespace, name)).terminal


def walk_the_delivery_path(rt: Runtime, *, timeout_s: float = 15) -> None:
    """Every API call the product makes: create, adopt (a secret input's Secret made after its Job,
    then found on the retry), poll's LIST, complete (Pod LIST, the
    Pod's and the Job's release patches, the bulk delete), a failure's detail (its Pod's log, the
    namespace's Warning Events), poll's LIST of failed Pods, cancel, and a sweep deleting an orphan."""
    namespace = rt.settings.namespace
    done, running, failing = _schedule(rt, "sim.ok"), _schedule(rt, "sim.hang"), _schedule(rt, "sim.fail")
    for dispatch_id in (done, running, failing):
        assert create.create_job_for(rt, dispatch_id) is create.CreateOutcome.CREATED
    assert create.create_job_for(rt, done) is create.CreateOutcome.ADOPTED  # a duplicate message
    sealed = _schedule(rt, "sim.ok", secret=True)
    assert create.create_job_for(rt, sealed) is create.CreateOutcome.CREATED  # the Job, then its Secret
    assert create.create_job_for(rt, sealed) is create.CreateOutcome.ADOPTED  # the Secret there, and ours

    name = records.job_location(rt, records.load_record(rt, done))[1]
    wait_until(lambda: _finished(rt, namespace, name), timeout=timeout_s, what="the Job finished")
    finished = [j["metadata"]["name"] for page in rt.kube.iter_jobs(namespace, label_selector=job_labels.selector(),
                page_size=rt.settings.poll_page_size) for j in page if job_state(j).terminal]  # fmt: skip
    assert name in finished  # what poll does in LIST mode: one paginated LIST
    for resumed in (False, True):  # and in watch mode: a LIST to start from, then a watch slice
        polled = jobwatch.poll_namespace(
            rt.kube, rt.redis, prefix=rt.settings.key_prefix, deployment=rt.settings.effective_deployment,
            namespace=namespace, page_size=rt.settings.poll_page_size, poll_interval_s=rt.settings.poll_interval_s,
            hand_off=lambda jobs: 0,
        )  # fmt: skip
        assert polled.listed is not resumed, polled
    assert complete.complete_job(rt, namespace, name) is complete.CompleteOutcome.COMPLETED
    assert disruptions.scan(rt, namespace) == []  # poll's LIST of our failed Pods
    bad = records.job_location(rt, records.load_record(rt, failing))[1]
    wait_until(lambda: _finished(rt, namespace, bad), timeout=timeout_s, what="the failing Job finished")
    assert complete.complete_job(rt, namespace, bad) is complete.CompleteOutcome.COMPLETED
    with transaction(rt.sessions) as session:
        detail = dispatches.terminal_event(session, failing).payload["detail"]
    assert detail["log_tail"] == "it broke\n"  # read, not refused (which would only leave it out)
    assert [e["reason"] for e in detail["events"]] == ["BackoffLimitExceeded"]
    assert cancel.cancel_dispatch(rt, running, reason="UserCancelled")

    forged = DispatchRef(str(uuid.uuid4()), "case-x", "tenant-a", "sim.ok", "sim", "key-x")
    labels, annotations = job_labels.encode(forged, deployment=rt.settings.effective_deployment)
    rt.kube.create_job(namespace, {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": f"forged-{uuid.uuid4().hex[:6]}", "labels": labels, "annotations": annotations},
        "spec": {"template": {"spec": {"restartPolicy": "Never", "containers": [{"name": "worker", "image": "x"}]}}},
    })  # fmt: skip
    report = run_sweep(rt)
    assert not report.errors, report.to_dict()
    wait_until(lambda: not next(iter(rt.kube.iter_jobs(namespace, label_selector=job_labels.selector(), page_size=50))),
               timeout=timeout_s, what="every Job gone (the orphan deleted by policy)")  # fmt: skip


def test_the_role_grants_exactly_the_calls_the_delivery_path_makes(recorded: LocalCluster, rt: Runtime) -> None:
    recorded.audit(clear=True)  # only what the project's code does from here on
    walk_the_delivery_path(rt)
    assert recorded.audit() == role_permissions()


def test_the_real_authorizer_lets_the_roles_service_account_walk_the_whole_path(
    real_cluster: ClusterHandle, new_pg_database, redis_url: str, key_prefix: str, tmp_path: Path
) -> None:
    namespace = f"rbac-{uuid.uuid4().hex[:8]}"
    kubeconfig = real_cluster.service_account_kubeconfig(namespace, tmp_path / "worker.kubeconfig", rbac_file=RBAC_FILE)
    runtime = _runtime(new_pg_database(), redis_url, f"{key_prefix}-rbac-real", kubeconfig, namespace=namespace)
    try:
        walk_the_delivery_path(runtime, timeout_s=60)  # a refused request raises ApiRejected here
        assert run_sweep(runtime).errors == 0
        with pytest.raises(ApiRejected) as e:  # and the authorizer does say no to the rest
            runtime.kube.list_pods("default", label_selector=job_labels.selector())
        assert e.value.reason == "Forbidden"
    finally:
        runtime.close()
