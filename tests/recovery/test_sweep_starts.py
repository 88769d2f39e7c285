"""The sweep's start clocks against real PostgreSQL, Redis and localcluster over HTTP, with the
sweep's "now" moved forward instead of waiting: Pods are read only for unstarted Jobs past the
grace, ONE Pending-Pod LIST per page of them (counted by the server's own request counter), none
for Jobs whose container runs; at the start clock an Unschedulable Job fails once with the
scheduler's message however many sweeps run, its Job deleted and its Pods freed; a Job whose
dispatch changed since the plan is left alone."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any

import pytest
from forged_jobs import SIM
from runtimes import runtime_values, schedule

from k8s_dispatch.delivery import cancel, create, records, unstarted
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.demo.localcluster import LocalCluster, startfaults
from k8s_dispatch.ops.processes import wait_until
from k8s_dispatch.recovery.plan import Category
from k8s_dispatch.recovery.sweep import run_sweep
from k8s_dispatch.store import dispatches, migrate
from k8s_dispatch.store.db import database_now, transaction
from k8s_dispatch.store.models import DispatchState, EventType
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.capability import StartPolicy
from k8s_dispatch.workers.manifest import FINALIZER, job_name
from k8s_dispatch.workers.pod_health import WAIT, assess

START_S = 600
CAPABILITIES = {
    "capabilities": {
        name: {"worker": "sim", "image": "sim:1", "startTimeoutSeconds": START_S, "annotations": annotations}
        for name, annotations in {
            "sim.nofit": {SIM + "unschedulable": "true"},
            "sim.runs": {SIM + "outcome": "hang"},
        }.items()
    }
}
PAGE = 7


@pytest.fixture
def cluster(sim_cluster: LocalCluster) -> LocalCluster:
    return sim_cluster


@pytest.fixture
def runtime_env(cluster, new_pg_database, redis_url, key_prefix, tmp_path) -> dict[str, str]:
    database_url = new_pg_database()
    migrate.upgrade(database_url)
    return runtime_values(
        database_url=database_url, redis_url=redis_url, prefix=f"{key_prefix}-{uuid.uuid4().hex[:8]}",
        namespace=f"st-{uuid.uuid4().hex[:8]}", kubeconfig=cluster.kubeconfig, capabilities=CAPABILITIES,
        tmp=tmp_path, sweep_grace_s="0", poll_page_size=str(PAGE),
    )  # fmt: skip


def started(rt: Runtime, capability: str, count: int) -> list[str]:
    ids = [schedule(rt, capability) for _ in range(count)]
    create.create_jobs_for(rt, ids)
    return ids


def pods(rt: Runtime) -> list[dict[str, Any]]:
    return rt.kube.list_pods(rt.settings.namespace, label_selector=job_labels.selector())


def settled(rt: Runtime, nofit: int, runs: int) -> None:
    """Every Pod has its status: the unschedulable ones say so, the others run."""

    def done() -> bool:
        seen = pods(rt)
        return (
            sum(startfaults.shows_unschedulable(p) for p in seen) == nofit
            and sum(p["status"].get("phase") == "Running" for p in seen) == runs
        )

    wait_until(
        done,
        what=f"{nofit} unschedulable and {runs} running pods",
        timeout=20.0,
        details=lambda: repr(
            [
                (
                    p["metadata"]["name"],
                    p["status"].get("phase"),
                    p["metadata"].get("deletionTimestamp"),
                    p["metadata"].get("finalizers"),
                )
                for p in pods(rt)
            ]
        ),
    )


def pod_lists(cluster: LocalCluster) -> int:
    return sum(c.count for c in cluster.request_counts() if c.labels.resource == "pods" and c.labels.verb == "LIST")


def db_now(rt: Runtime) -> datetime:
    with transaction(rt.sessions) as session:
        return database_now(session)


def sweep_pod_lists(cluster: LocalCluster, rt: Runtime, *, now: datetime) -> tuple[int, Any]:
    before = pod_lists(cluster)
    report = run_sweep(rt, now=now)
    return pod_lists(cluster) - before, report


def test_pods_are_read_once_per_page_of_unstarted_jobs_past_the_grace_and_never_for_running_ones(cluster, rt):
    started(rt, "sim.nofit", 2 * PAGE)  # two pages of unstarted Jobs
    settled(rt, 2 * PAGE, 0)
    now = db_now(rt)
    young, report = sweep_pod_lists(cluster, rt, now=now)  # inside the grace: no Pod read
    assert report.errors == 0
    old, report = sweep_pod_lists(cluster, rt, now=now + timedelta(seconds=30))
    assert old - young == 2, (young, old)  # one Pending-Pod LIST per page of such Jobs
    assert report.categories[Category.RUNNING].found == 2 * PAGE
    assert report.categories[Category.RUNNING].acted == 0  # Unschedulable waits for the start clock

    for dispatch_id in [d for d in _open(rt)]:
        cancel.cancel_dispatch(rt, dispatch_id)
    started(rt, "sim.runs", PAGE + 1)
    settled(rt, 0, PAGE + 1)
    wait_until(lambda: all(j["status"].get("ready") for j in _jobs(rt)), what="jobs ready", timeout=20.0)
    now = db_now(rt)
    young, _ = sweep_pod_lists(cluster, rt, now=now)
    old, report = sweep_pod_lists(cluster, rt, now=now + timedelta(seconds=START_S * 2))
    assert old == young  # running Jobs cost no Pod read, even far past their start clock
    assert report.categories[Category.RUNNING].acted == 0
    assert all(record.state is DispatchState.CREATED for record in records.load_records(rt, _open(rt)).values())


def test_at_the_start_clock_an_unschedulable_job_fails_once_and_leaves_nothing(cluster, rt, notified):
    ids = started(rt, "sim.nofit", 3)
    settled(rt, 3, 0)
    now = db_now(rt)
    early = run_sweep(rt, now=now + timedelta(seconds=START_S - 30))
    assert early.categories[Category.RUNNING].acted == 0
    late = now + timedelta(seconds=START_S + 5)
    first = run_sweep(rt, now=late)
    assert first.categories[Category.RUNNING].acted == 3 and first.errors == 0
    run_sweep(rt, now=late)  # a second sweep (or a racing one) changes nothing
    for dispatch_id in ids:
        with transaction(rt.sessions) as session:
            events = [(e.type, dict(e.payload)) for e in dispatches.events_for(session, dispatch_id)]
        [(failed, payload)] = events[1:]
        detail = payload.pop("detail")
        assert (failed, payload) == (
            EventType.WORKER_FAILED,
            {"reason": "Unschedulable", "message": startfaults.SCHEDULER_MESSAGE},
        )
        assert detail["pod"].startswith(job_name(dispatch_id) + "-") and "exit_code" not in detail, detail
    assert sorted(notified.ids) == sorted(ids)
    wait_until(lambda: not _jobs(rt), what="their Jobs deleted", timeout=20.0)
    assert not [p for p in pods(rt) if FINALIZER in (p["metadata"].get("finalizers") or [])]


def test_a_give_up_rechecks_the_row_and_the_pods_before_failing(cluster, rt):
    [dispatch_id] = started(rt, "sim.nofit", 1)
    settled(rt, 1, 0)
    namespace, name = rt.settings.namespace, job_name(dispatch_id)
    job = rt.kube.get_job(namespace, name)
    record = records.load_record(rt, dispatch_id)
    kwargs = dict(
        dispatch_id=dispatch_id,
        snapshot=job,
        decide=lambda p, e: assess(job, p, age=timedelta(0), policy=_policy(), events=e),
    )
    # the plan's attempt is not the row's any more (a re-creation since): nothing is done
    assert unstarted.fail_unstarted(rt, namespace, name, attempts=record.attempts + 1, **kwargs) is None
    # the Pods read again say wait (here: the clock, judged afresh, has not run out)
    assert unstarted.fail_unstarted(rt, namespace, name, attempts=record.attempts, **kwargs) is None
    held = rt.guard.claim(dispatch_id)  # another replica is on it
    assert held is not None
    try:
        verdict = unstarted.fail_unstarted(
            rt, namespace, name, attempts=record.attempts, dispatch_id=dispatch_id, snapshot=job,
            decide=lambda p, e: assess(job, p, age=timedelta(seconds=START_S), policy=_policy(), events=e),
        )  # fmt: skip
        assert verdict is None
    finally:
        rt.guard.release(held)
    assert records.load_record(rt, dispatch_id).state is DispatchState.CREATED
    assert assess(job, pods(rt), age=timedelta(seconds=1), policy=_policy()) == WAIT
    verdict = unstarted.fail_unstarted(
        rt, namespace, name, attempts=record.attempts, dispatch_id=dispatch_id, snapshot=job,
        decide=lambda p, e: assess(job, p, age=timedelta(seconds=START_S), policy=_policy(), events=e),
    )  # fmt: skip
    assert verdict is not None and verdict.reason == "Unschedulable"
    assert records.load_record(rt, dispatch_id).state is DispatchState.FAILED


def _policy() -> StartPolicy:
    return StartPolicy(start_timeout_s=START_S)


def _open(rt: Runtime) -> list[str]:
    with transaction(rt.sessions) as session:
        return [d.dispatch_id for d in dispatches.iter_dispatches(session, states=[DispatchState.CREATED])]


def _jobs(rt: Runtime) -> list[dict[str, Any]]:
    return [j for page in rt.kube.iter_jobs(rt.settings.namespace, label_selector=job_labels.selector()) for j in page]
