"""One Job per attempt, by construction: every create POSTs with its dispatch's row locked from
the read that decided it, so no delivery (and bulk delete) can come between that read and the
POST, however long the POST waits; and an attempt is counted only by a Job that was made.
Real PostgreSQL and Redis, localcluster over HTTP (its fault switch and its quota annotation)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from runtimes import own_database_values, schedule, set_job_quota

from k8s_dispatch.core.errors import NotFound
from k8s_dispatch.delivery import cancel, cleanup, complete, create, records
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.demo.localcluster import LocalCluster
from k8s_dispatch.ops.processes import wait_until
from k8s_dispatch.recovery.plan import Category
from k8s_dispatch.recovery.sweep import run_sweep
from k8s_dispatch.store import dispatches
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import DispatchState, EventType
from k8s_dispatch.workers.budget import Budget
from k8s_dispatch.workers.job_status import job_state
from k8s_dispatch.workers.kube import KubeClient
from k8s_dispatch.workers.manifest import FINALIZER, job_name

SIM = "localcluster.k8s-dispatch.io/"
CAPABILITIES = {
    "capabilities": {
        "sim.ok": {"worker": "sim", "image": "sim:1", "annotations": {SIM + "duration-ms": "20"}},
        "sim.hang": {"worker": "sim", "image": "sim:1", "annotations": {SIM + "outcome": "hang"}},
    }
}
RETRY_AFTER_S = 4.0  # how long the create under test waits between its read and its POST


@pytest.fixture
def runtime_env(sim_cluster, new_pg_database, redis_url, key_prefix, tmp_path) -> dict[str, str]:
    """This test's own database (a sweep reads all of it), namespace and Redis prefix."""
    return own_database_values(
        cluster=sim_cluster, new_pg_database=new_pg_database, redis_url=redis_url, key_prefix=key_prefix,
        tmp=tmp_path, namespace="once", capabilities=CAPABILITIES, sweep_grace_s="0",
    )  # fmt: skip


def creates(cluster: LocalCluster) -> int:
    """Jobs the API server created so far (POSTs answered 201)."""
    return sum(
        c.count
        for c in cluster.request_counts()
        if c.labels.verb == "POST" and c.labels.resource == "jobs" and c.code == 201
    )


def terminal_events(rt: Runtime, dispatch_id: str) -> list[EventType]:
    with transaction(rt.sessions) as session:
        return [e.type for e in dispatches.events_for(session, dispatch_id) if e.type != EventType.WORKER_SCHEDULED]


def finished_job(rt: Runtime, dispatch_id: str) -> dict[str, Any]:
    namespace, name = rt.settings.namespace, job_name(dispatch_id)
    found: list[dict[str, Any]] = []

    def finished() -> bool:
        found[:] = [rt.kube.get_job(namespace, name)]
        return job_state(found[0]).terminal

    wait_until(finished, what=f"job {name} finished", timeout=15)
    return found[0]


def gone(rt: Runtime, dispatch_id: str) -> bool:
    try:
        rt.kube.get_job(rt.settings.namespace, job_name(dispatch_id))
    except NotFound:
        return True
    return False


def in_thread(call: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """`call` started in a thread; the list gets its result, or the exception it raised."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(call())
        except Exception as e:  # handed to the test, which asserts on it
            out.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def deliver_and_bulk_delete(rt: Runtime, snapshot: dict[str, Any]) -> int:
    """The completion path as poll's batches run it: deliver, then the namespace's bulk delete."""
    done = complete.complete_jobs(rt, rt.settings.namespace, [snapshot], delete=False)
    assert done.outcomes == [complete.CompleteOutcome.COMPLETED], done
    return len(cleanup.delete_delivered(rt, rt.settings.namespace))


@pytest.fixture
def late_rt(rt: Runtime) -> Iterator[Runtime]:
    """A second worker's Runtime: its own API client and request budget (a 429's Retry-After
    pauses the process that got it; here, this client alone)."""
    late = Runtime.from_settings(
        rt.settings, resolver=rt.resolver, kube=KubeClient(rt.settings.kubeconfig, budget=Budget(0, 1))
    )
    yield late
    late.close()


def test_a_delivery_and_bulk_delete_between_a_creates_read_and_its_post_never_makes_a_second_job(
    rt: Runtime, late_rt: Runtime, sim_cluster: LocalCluster
) -> None:
    dispatch_id = schedule(rt, "sim.ok")
    assert create.create_jobs_for(rt, [dispatch_id]) == {dispatch_id: create.CreateOutcome.CREATED}
    snapshot = finished_job(rt, dispatch_id)
    before = creates(sim_cluster)

    # A late create of the same dispatch (a redelivered message, another worker's batch): its
    # POST is answered 429 and waits RETRY_AFTER_S, while the finished Job is delivered and
    # bulk-deleted. Read-then-POST would make the Job again once the wait is over.
    sim_cluster.call(lambda core: core.faults.throttle(1, RETRY_AFTER_S))
    late, late_out = in_thread(lambda: create.create_jobs_for(late_rt, [dispatch_id]))
    wait_until(lambda: sim_cluster.call(lambda core: core.faults.throttled) == 0, timeout=10, what="the 429 answered")
    deliverer, delivered = in_thread(lambda: deliver_and_bulk_delete(rt, snapshot))
    late.join(timeout=30)
    deliverer.join(timeout=30)

    assert late_out == [{dispatch_id: create.CreateOutcome.ADOPTED}]  # it found the Job, made none
    assert delivered == [1]
    assert terminal_events(rt, dispatch_id) == [EventType.WORKER_COMPLETED]
    wait_until(lambda: gone(rt, dispatch_id), timeout=15, what="the delivered job deleted")
    assert creates(sim_cluster) == before


def test_a_delivery_waits_for_a_create_in_flight_and_the_create_sees_an_ended_dispatch_after(
    rt: Runtime, sim_cluster: LocalCluster
) -> None:
    """The other order: the dispatch ended before the late create read it: nothing is made."""
    dispatch_id = schedule(rt, "sim.ok")
    create.create_jobs_for(rt, [dispatch_id])
    assert deliver_and_bulk_delete(rt, finished_job(rt, dispatch_id)) == 1
    wait_until(lambda: gone(rt, dispatch_id), timeout=15, what="the delivered job deleted")
    before = creates(sim_cluster)
    assert create.create_jobs_for(rt, [dispatch_id]) == {dispatch_id: create.CreateOutcome.SKIPPED}
    assert creates(sim_cluster) == before and gone(rt, dispatch_id)


def test_a_cancel_recorded_during_a_create_waits_for_it_and_finds_its_job(rt: Runtime, sim_cluster) -> None:
    """A cancel written while a create waits on the API commits after it: the row it ends
    already names the Job, which the cancel's clean-up (or the sweep) then deletes."""
    dispatch_id = schedule(rt, "sim.hang")
    sim_cluster.call(lambda core: core.faults.throttle(1, RETRY_AFTER_S))
    creating, created = in_thread(lambda: create.create_jobs_for(rt, [dispatch_id]))
    wait_until(lambda: sim_cluster.call(lambda core: core.faults.throttled) == 0, timeout=10, what="the 429 answered")
    cancelling, cancelled = in_thread(lambda: cancel.cancel_dispatch(rt, dispatch_id))
    creating.join(timeout=30)
    cancelling.join(timeout=30)
    assert created == [{dispatch_id: create.CreateOutcome.CREATED}] and cancelled == [True]
    assert terminal_events(rt, dispatch_id) == [EventType.WORKER_CANCELLED]
    wait_until(lambda: gone(rt, dispatch_id), timeout=15, what="the cancelled dispatch's job deleted")


def lose_job(rt: Runtime, dispatch_id: str) -> None:
    """Strip our finalizer and delete the Job, as an operator might: its result is gone."""
    namespace, name = rt.settings.namespace, job_name(dispatch_id)
    rt.kube.remove_finalizer(namespace, name, FINALIZER)
    rt.kube.delete_job(namespace, name)
    wait_until(lambda: gone(rt, dispatch_id), what=f"job {name} gone", timeout=15.0)


def test_a_lost_jobs_refused_recreates_spend_no_attempt(rt: Runtime, sim_cluster: LocalCluster) -> None:
    assert rt.settings.max_job_attempts == 3
    dispatch_id = schedule(rt, "sim.hang")
    create.create_jobs_for(rt, [dispatch_id])
    lose_job(rt, dispatch_id)
    set_job_quota(sim_cluster, rt.settings.namespace, 0)  # "exceeded quota": wait, never fail
    for _ in range(rt.settings.max_job_attempts + 1):
        report = run_sweep(rt)
        assert report.categories[Category.JOB_LOST].errors == 1, report.to_dict()
    record = records.load_record(rt, dispatch_id)
    assert record is not None and (record.state, record.attempts) == (DispatchState.CREATED, 0)
    assert terminal_events(rt, dispatch_id) == []

    set_job_quota(sim_cluster, rt.settings.namespace, None)
    assert run_sweep(rt).categories[Category.JOB_LOST].acted == 1
    record = records.load_record(rt, dispatch_id)
    assert record is not None and (record.state, record.attempts) == (DispatchState.CREATED, 1)
    assert not gone(rt, dispatch_id)


def test_a_rerun_decided_twice_makes_one_job_and_counts_one_attempt(rt: Runtime, sim_cluster) -> None:
    dispatch_id = schedule(rt, "sim.hang")
    create.create_jobs_for(rt, [dispatch_id])
    lose_job(rt, dispatch_id)
    before = creates(sim_cluster)
    again = {dispatch_id: create.Rerun(counted=0, attempt=1)}
    outcomes = [create.create_jobs_for(rt, [dispatch_id], reruns=again) for _ in range(2)]
    assert outcomes == [{dispatch_id: create.CreateOutcome.CREATED}, {dispatch_id: create.CreateOutcome.SKIPPED}]
    assert creates(sim_cluster) - before == 1
    record = records.load_record(rt, dispatch_id)
    assert record is not None and record.attempts == 1
