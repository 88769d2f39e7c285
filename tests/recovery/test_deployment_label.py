"""Two deployments (own database, own key prefix) sharing one namespace, with ORPHAN_POLICY=delete:
each delivers its own Jobs, never lists, delivers or deletes the other's, adopts its own Jobs
made before the deployment label existed, and only reports an unlabelled Job that is nobody's
it knows. Real PostgreSQL, Redis and localcluster over HTTP; the sweeps of both run in turn."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from k8s_dispatch.core.errors import ConfigError
from k8s_dispatch.core.settings import load_settings
from k8s_dispatch.delivery.create import CreateOutcome, create_jobs_for
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.demo.localcluster import LocalCluster
from k8s_dispatch.ops.processes import wait_until
from k8s_dispatch.recovery.sweep import run_sweep
from k8s_dispatch.store import dispatches, migrate, scheduling
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import EventType
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.job_status import job_state
from k8s_dispatch.workers.manifest import FINALIZER, job_name
from k8s_dispatch.workers.resolver import CapabilityResolver
from k8s_dispatch.workers.types import DispatchRef

SIM = "localcluster.k8s-dispatch.io/"
CAPABILITIES = {
    "capabilities": {
        "sim.quick": {"worker": "sim", "image": "sim:1", "annotations": {SIM + "duration-ms": "20"}},
        # Runs through several sweeps of the other deployment.
        "sim.slow": {"worker": "sim", "image": "sim:1", "annotations": {SIM + "duration-ms": "1500"}},
    }
}


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(mode="simulate") as c:
        yield c


@pytest.fixture
def namespace() -> str:
    return f"shared-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def deployment(cluster, namespace, new_pg_database, redis_url, key_prefix) -> Iterator[Callable[[], Runtime]]:
    """`deployment()`: a new deployment on the shared namespace: its own database and prefix."""
    made: list[Runtime] = []

    def make() -> Runtime:
        database_url = new_pg_database()
        migrate.upgrade(database_url)
        settings = load_settings(
            {
                "K8S_DISPATCH_DATABASE_URL": database_url,
                "K8S_DISPATCH_REDIS_URL": redis_url,
                "K8S_DISPATCH_KEY_PREFIX": f"{key_prefix}-dep-{uuid.uuid4().hex[:8]}",
                "K8S_DISPATCH_NAMESPACE": namespace,
                "K8S_DISPATCH_KUBECONFIG": str(cluster.kubeconfig),
                "K8S_DISPATCH_ORPHAN_POLICY": "delete",
                "K8S_DISPATCH_SWEEP_GRACE_S": "0",
                "K8S_DISPATCH_POLL_PAGE_SIZE": "4",
            }
        )
        rt = Runtime.from_settings(
            settings, notifier=lambda _id: None, resolver=CapabilityResolver.from_mapping(CAPABILITIES, source="<test>")
        )
        made.append(rt)
        return rt

    yield make
    for rt in made:
        rt.close()


def schedule(rt: Runtime, capability: str, count: int) -> list[str]:
    case_id = f"case-{uuid.uuid4().hex[:8]}"
    requests = [
        scheduling.ScheduleRequest(case_id, "tenant-a", capability, {"i": i}, f"key-{uuid.uuid4()}")
        for i in range(count)
    ]
    with transaction(rt.sessions) as session:
        scheduling.create_case(session, case_id=case_id, tenancy_id="tenant-a")
        return [
            r.dispatch_id for r in scheduling.schedule_many(session, requests, router=rt.resolver, max_input_bytes=1024)
        ]


def unlabelled_job(rt: Runtime, namespace: str, ref: DispatchRef, *, duration_ms: int = 20) -> dict[str, Any]:
    """Create a Job as the code before the deployment label did: our labels, finalizer, no deployment."""
    labels, annotations = job_labels.encode(ref)
    assert job_labels.DEPLOYMENT_LABEL not in labels
    sim = {SIM + "duration-ms": str(duration_ms), SIM + "result": '{"old": true}'}
    return rt.kube.create_job(
        namespace,
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {
                "name": job_name(ref.dispatch_id),
                "labels": labels,
                "annotations": annotations,
                "finalizers": [FINALIZER],
            },
            "spec": {
                "backoffLimit": 0,
                "template": {
                    "metadata": {"annotations": sim},
                    "spec": {"restartPolicy": "Never", "containers": [{"name": "worker", "image": "sim:1"}]},
                },
            },
        },
    )


def ref_of(rt: Runtime, dispatch_id: str) -> DispatchRef:
    with transaction(rt.sessions) as session:
        row = dispatches.get_dispatch(session, dispatch_id)
        assert row is not None
        return DispatchRef(
            row.dispatch_id, row.case_id, row.tenancy_id, row.capability, row.worker_name, row.idempotency_key
        )  # type: ignore[arg-type]


def mark_created(rt: Runtime, ids: list[str], namespace: str) -> None:
    with transaction(rt.sessions) as session:
        dispatches.mark_created_many(session, [dispatches.CreatedJob(d, job_name(d), namespace, 0) for d in ids])


def jobs(rt: Runtime, namespace: str) -> dict[str, dict[str, Any]]:
    """Every deployment's Jobs in the namespace, by name."""
    return {
        j["metadata"]["name"]: j
        for page in rt.kube.iter_jobs(namespace, label_selector=job_labels.selector())
        for j in page
    }


def events(rt: Runtime, ids: list[str]) -> dict[str, list[tuple[str, Any]]]:
    with transaction(rt.sessions) as session:
        return {
            d: [(e.type, e.payload) for e in dispatches.events_for(session, d) if e.type != EventType.WORKER_SCHEDULED]
            for d in ids
        }


def test_two_deployments_on_one_namespace_deliver_their_own_and_never_touch_the_others(deployment, namespace):
    a, b = deployment(), deployment()
    assert a.settings.effective_deployment != b.settings.effective_deployment
    mine = [(rt, schedule(rt, "sim.slow", 5) + schedule(rt, "sim.quick", 5)) for rt in (a, b)]
    for rt, ids in mine:
        assert set(create_jobs_for(rt, ids).values()) == {CreateOutcome.CREATED}
    uids = {name: job["metadata"]["uid"] for name, job in jobs(a, namespace).items()}
    assert len(uids) == 20

    # Jobs made before the label: A's own (running, and finished), and one no deployment knows.
    a_old_running, a_old_finished = schedule(a, "sim.slow", 1), schedule(a, "sim.quick", 1)
    for dispatch_id, duration in ((a_old_running[0], 1500), (a_old_finished[0], 20)):
        unlabelled_job(a, namespace, ref_of(a, dispatch_id), duration_ms=duration)
    mark_created(a, a_old_running + a_old_finished, namespace)
    nobody = DispatchRef(str(uuid.uuid4()), "case-x", "tenant-x", "sim.quick", "sim", "key-x")  # type: ignore[arg-type]
    stranger = unlabelled_job(a, namespace, nobody)
    mine[0][1].extend(a_old_running + a_old_finished)

    labelled = {"a": 0, "b": 0}

    def both_done() -> bool:
        for who, rt in (
            ("b", b),
            ("a", a),
        ):  # B first: it meets A's Jobs, labelled and not, before A has delivered them
            report = run_sweep(rt)
            assert report.errors == 0, report.table()
            labelled[who] += report.jobs_labelled
        delivered = all(len(e) == 1 for rt, ids in mine for e in events(rt, ids).values())
        return delivered and set(jobs(a, namespace)) <= {job_name(nobody.dispatch_id)}

    wait_until(both_done, timeout=60, what="both deployments' dispatches delivered and their Jobs gone")
    for rt, ids in mine:
        for dispatch_id, got in events(rt, ids).items():
            assert [t for t, _ in got] == [EventType.WORKER_COMPLETED], (dispatch_id, got)
    assert labelled == {"a": 2, "b": 0}  # A's two old Jobs, given A's label by A alone
    # The stranger was reported by both, deleted by neither, and never released.
    left = jobs(a, namespace).get(job_name(nobody.dispatch_id))
    assert left is not None, "the unlabelled Job that is neither's was deleted"
    assert left["metadata"]["uid"] == stranger["metadata"]["uid"]
    assert left["metadata"]["finalizers"] == [FINALIZER] and "deletionTimestamp" not in left["metadata"]
    assert job_state(left).terminal
    assert job_labels.deployment_of(left["metadata"]["labels"]) is None
    a.kube.release_job(namespace, left["metadata"]["name"], finalizer=FINALIZER)
    a.kube.delete_job(namespace, left["metadata"]["name"])


def test_each_selector_names_the_deployment() -> None:
    assert (
        job_labels.undelivered_selector("prod")
        == "app.kubernetes.io/managed-by=k8s-dispatch,k8s-dispatch.io/deployment=prod,!k8s-dispatch.io/delivered"
    )
    assert (
        job_labels.delivered_selector("prod")
        == "app.kubernetes.io/managed-by=k8s-dispatch,k8s-dispatch.io/deployment=prod,k8s-dispatch.io/delivered=true"
    )
    assert job_labels.unlabelled_selector() == "app.kubernetes.io/managed-by=k8s-dispatch,!k8s-dispatch.io/deployment"


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, "k8s-dispatch"),
        ({"K8S_DISPATCH_KEY_PREFIX": "team-a"}, "team-a"),
        ({"K8S_DISPATCH_KEY_PREFIX": "team-a", "K8S_DISPATCH_DEPLOYMENT": "prod.eu-1"}, "prod.eu-1"),
    ],
)
def test_the_deployment_defaults_to_the_key_prefix(environ: dict[str, str], expected: str) -> None:
    assert load_settings(environ).effective_deployment == expected


def test_a_key_prefix_that_is_no_label_value_derives_a_distinct_valid_one() -> None:
    from k8s_dispatch.core.names import is_label_value

    derived = {
        load_settings({"K8S_DISPATCH_KEY_PREFIX": p}).effective_deployment for p in ("a:b", "a/b", "a b", "x" * 64, ":")
    }
    assert len(derived) == 5 and all(is_label_value(d) and d for d in derived)


@pytest.mark.parametrize("bad", ["", "two words", "-lead", "trail.", "x" * 64, "ünï"])
def test_a_deployment_that_is_no_label_value_stops_the_process_naming_the_variable(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"K8S_DISPATCH_DEPLOYMENT.*not a valid label value"):
        load_settings({"K8S_DISPATCH_DEPLOYMENT": bad})


def test_a_create_meeting_its_own_unlabelled_job_adopts_and_labels_it(deployment, namespace):
    # Made by the code before the label, which died before marking the row.
    rt = deployment()
    [dispatch_id] = schedule(rt, "sim.quick", 1)
    unlabelled_job(rt, namespace, ref_of(rt, dispatch_id))
    assert create_jobs_for(rt, [dispatch_id]) == {dispatch_id: CreateOutcome.ADOPTED}
    job = jobs(rt, namespace)[job_name(dispatch_id)]
    assert job_labels.deployment_of(job["metadata"]["labels"]) == rt.settings.effective_deployment
    wait_until(lambda: run_sweep(rt) and not jobs(rt, namespace), timeout=30, what="the Job delivered and gone")
    assert [t for t, _ in events(rt, [dispatch_id])[dispatch_id]] == [EventType.WORKER_COMPLETED]
