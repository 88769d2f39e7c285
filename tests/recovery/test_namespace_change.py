"""A capability's namespace moves (or the capability goes) between scheduling and delivery: every
dispatch still gets exactly one Job, in the namespace recorded when it was scheduled, delivered
once, and nothing is left. Real PostgreSQL, Redis and localcluster over HTTP; the configs are
two runtimes of one deployment, as an old and a new worker during a rolling deploy."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

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
from k8s_dispatch.workers.manifest import FINALIZER, job_name
from k8s_dispatch.workers.resolver import CapabilityResolver
from tests.store.conftest import StaticRouter

SIM = "localcluster.k8s-dispatch.io/"


def config(**namespaces: str | None) -> CapabilityResolver:
    """Capabilities `sim.<name>` (a Job of 50 ms), each in the namespace given (None: the settings')."""
    caps: dict[str, Any] = {}
    for name, namespace in namespaces.items():
        caps[f"sim.{name}"] = {"worker": "sim", "image": "sim:1", "annotations": {SIM + "duration-ms": "50"}}
        if namespace is not None:
            caps[f"sim.{name}"]["namespace"] = namespace
    return CapabilityResolver.from_mapping({"capabilities": caps}, source="<test>")


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(mode="simulate") as c:
        yield c


@pytest.fixture
def world(cluster, new_pg_database, redis_url, key_prefix) -> Iterator[Callable[[CapabilityResolver], Runtime]]:
    """`world(config)`: a runtime of this test's one deployment (database, prefix) under `config`."""
    database_url = new_pg_database()
    migrate.upgrade(database_url)
    settings = load_settings(
        {
            "K8S_DISPATCH_DATABASE_URL": database_url,
            "K8S_DISPATCH_REDIS_URL": redis_url,
            "K8S_DISPATCH_KEY_PREFIX": f"{key_prefix}-ns-{uuid.uuid4().hex[:8]}",
            "K8S_DISPATCH_NAMESPACE": f"home-{uuid.uuid4().hex[:8]}",
            "K8S_DISPATCH_KUBECONFIG": str(cluster.kubeconfig),
            "K8S_DISPATCH_SWEEP_GRACE_S": "0",
        }
    )
    made: list[Runtime] = []

    def make(resolver: CapabilityResolver) -> Runtime:
        rt = Runtime.from_settings(settings, notifier=lambda _id: None, resolver=resolver)
        made.append(rt)
        return rt

    yield make
    for rt in made:
        rt.close()


def fresh(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def schedule(rt: Runtime, capability: str, count: int, *, router: Any = None) -> list[str]:
    case_id = f"case-{uuid.uuid4().hex[:8]}"
    requests = [
        scheduling.ScheduleRequest(case_id, "tenant-a", capability, {"i": i}, f"key-{uuid.uuid4()}")
        for i in range(count)
    ]
    with transaction(rt.sessions) as session:
        scheduling.create_case(session, case_id=case_id, tenancy_id="tenant-a")
        results = scheduling.schedule_many(session, requests, router=router or rt.resolver, max_input_bytes=1024)
    return [r.dispatch_id for r in results]


def job_creates(cluster: LocalCluster) -> int:
    """Jobs the API server created so far (successful POSTs), in every namespace."""
    return sum(
        c.count
        for c in cluster.request_counts()
        if c.labels.verb == "POST" and c.labels.resource == "jobs" and c.code == 201
    )


def jobs_in(rt: Runtime, namespace: str) -> dict[str, dict[str, Any]]:
    """Every deployment's Jobs in the namespace, by name."""
    return {
        j["metadata"]["name"]: j
        for page in rt.kube.iter_jobs(namespace, label_selector=job_labels.selector())
        for j in page
    }


def rows(rt: Runtime, ids: list[str]) -> dict[str, Any]:
    with transaction(rt.sessions) as session:
        return dispatches.get_dispatches(session, ids)


def terminal_events(rt: Runtime, ids: list[str]) -> dict[str, list[tuple[str, Any]]]:
    with transaction(rt.sessions) as session:
        return {
            d: [(e.type, e.payload) for e in dispatches.events_for(session, d) if e.type != EventType.WORKER_SCHEDULED]
            for d in ids
        }


def sweep_until_delivered(rt: Runtime, ids: list[str], namespaces: list[str]) -> None:
    """Sweep (the new config's) until every dispatch is terminal and no Job is left anywhere."""

    def done() -> bool:
        run_sweep(rt)
        return all(r.terminal for r in rows(rt, ids).values()) and not any(jobs_in(rt, ns) for ns in namespaces)

    wait_until(done, timeout=30, what="every dispatch delivered and no Job left")


def assert_completed_once(rt: Runtime, ids: list[str]) -> None:
    events = terminal_events(rt, ids)
    assert all(len(e) == 1 and e[0][0] == EventType.WORKER_COMPLETED for e in events.values()), events


def test_a_create_redelivered_after_the_namespace_moved_adopts_the_job_where_it_was_scheduled(world, cluster):
    ns_a, ns_b = fresh("ns-a"), fresh("ns-b")
    old, new = world(config(ok=ns_a)), world(config(ok=ns_b))
    ids = schedule(old, "sim.ok", 5)
    assert {r.job_namespace for r in rows(old, ids).values()} == {ns_a}  # fixed when scheduled

    before = job_creates(cluster)
    assert set(create_jobs_for(old, ids).values()) == {CreateOutcome.CREATED}
    # The message is redelivered to a worker started on the new config (or the sweep's create runs there).
    assert set(create_jobs_for(new, ids).values()) == {CreateOutcome.ADOPTED}
    assert jobs_in(new, ns_b) == {}
    assert set(jobs_in(new, ns_a)) == {job_name(d) for d in ids}
    assert {r.job_namespace for r in rows(new, ids).values()} == {ns_a}

    sweep_until_delivered(new, ids, [ns_a, ns_b])
    assert job_creates(cluster) - before == len(ids)  # one Job per dispatch, ever
    assert_completed_once(new, ids)


def test_the_sweep_under_the_new_config_racing_a_queued_create_makes_one_job(world, cluster):
    ns_a, ns_b = fresh("ns-a"), fresh("ns-b")
    old, new = world(config(ok=ns_a)), world(config(ok=ns_b))
    ids = schedule(old, "sim.ok", 4)  # create_jobs queued, not yet taken

    before = job_creates(cluster)
    run_sweep(new)  # a new worker's start-up sweep gets there first
    assert set(jobs_in(new, ns_a)) == {job_name(d) for d in ids} and jobs_in(new, ns_b) == {}
    # ... then an old worker takes the queued message.
    assert set(create_jobs_for(old, ids).values()) == {CreateOutcome.ADOPTED}

    sweep_until_delivered(new, ids, [ns_a, ns_b])
    assert job_creates(cluster) - before == len(ids)
    assert_completed_once(new, ids)


def test_a_row_an_engine_wrote_itself_gets_its_namespace_once_from_the_first_worker(world, cluster):
    ns_a, ns_b = fresh("ns-a"), fresh("ns-b")
    old, new = world(config(ok=ns_a)), world(config(ok=ns_b))
    ids = schedule(old, "sim.ok", 3, router=StaticRouter({"sim.ok": "sim"}))  # names no namespace
    assert {r.job_namespace for r in rows(old, ids).values()} == {None}

    before = job_creates(cluster)
    assert set(create_jobs_for(old, ids).values()) == {CreateOutcome.CREATED}
    assert set(create_jobs_for(new, ids).values()) == {CreateOutcome.ADOPTED}
    sweep_until_delivered(new, ids, [ns_a, ns_b])
    assert job_creates(cluster) - before == len(ids)
    assert {r.job_namespace for r in rows(new, ids).values()} == {ns_a}
    assert_completed_once(new, ids)


def test_a_removed_capability_still_delivers_its_jobs_and_fails_the_rest_with_a_typed_reason(world, cluster):
    ns_a = fresh("ns-a")
    old = world(config(ok=ns_a, gone=ns_a))
    new = world(config(ok=None))  # sim.gone removed, and no namespace of the new config is ns-a
    running = schedule(old, "sim.gone", 3)
    assert set(create_jobs_for(old, running).values()) == {CreateOutcome.CREATED}
    never_created = schedule(old, "sim.gone", 2)
    fine = schedule(old, "sim.ok", 2)

    # A redelivered create adopts what runs; one batch with every kind, none of them crashing it.
    outcomes = create_jobs_for(new, running + never_created + fine)
    assert {d: outcomes[d] for d in running} == {d: CreateOutcome.ADOPTED for d in running}
    assert {d: outcomes[d] for d in never_created} == {d: CreateOutcome.FAILED for d in never_created}
    assert {d: outcomes[d] for d in fine} == {d: CreateOutcome.CREATED for d in fine}
    events = terminal_events(new, never_created)
    assert {e[0][1]["reason"] for e in events.values()} == {"UnknownCapability"}

    # The new config does not list ns-a: the sweep still finds and delivers the Jobs there.
    sweep_until_delivered(new, running + fine, [ns_a, new.settings.namespace])
    assert_completed_once(new, running + fine)
    assert all(FINALIZER not in j["metadata"].get("finalizers", []) for j in jobs_in(new, ns_a).values())
