"""A dispatch whose Job is edited by hand still ends, once, within a bounded time (real
PostgreSQL, Redis and localcluster over HTTP; the sweep run in-process): a Job whose labels or
attempt annotation disagree with the database fails its dispatch `JobTampered` after the
tampered grace and is removed, finalizers off; one put right within the grace is delivered as
usual; one hidden by a hand-added `delivered=true` is found by name and delivered as its Job
ends (the LIST's bulk delete of delivered Jobs takes it too: then JobDeleted), never created a
second time."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import kubernetes
import pytest
import sqlalchemy as sa
from runtimes import runtime_values, schedule

from k8s_dispatch.core.errors import NotFound
from k8s_dispatch.delivery import create, jobwatch
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.demo.localcluster import LocalCluster
from k8s_dispatch.ops.processes import wait_until
from k8s_dispatch.recovery.plan import JOB_TAMPERED_REASON, Category
from k8s_dispatch.recovery.sweep import run_sweep
from k8s_dispatch.store import dispatches, migrate
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import Dispatch, DispatchState, EventType
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.job_status import job_state
from k8s_dispatch.workers.manifest import FINALIZER, job_name

SIM = "localcluster.k8s-dispatch.io/"


def capability(duration_ms: int, **sim: str) -> dict[str, Any]:
    return {
        "worker": "sim",
        "image": "sim:1",
        "activeDeadlineSeconds": None,
        "annotations": {SIM + "duration-ms": str(duration_ms), **{SIM + k: v for k, v in sim.items()}},
    }


CAPABILITIES = {
    "capabilities": {"sim.ok": capability(20), "sim.slow": capability(3000), "sim.hang": capability(20, outcome="hang")}
}


@pytest.fixture
def runtime_env(sim_cluster, new_pg_database, redis_url, key_prefix, tmp_path) -> dict[str, str]:
    database_url = new_pg_database()
    migrate.upgrade(database_url)
    return runtime_values(
        database_url=database_url, redis_url=redis_url, prefix=f"{key_prefix}-{uuid.uuid4().hex[:8]}",
        namespace=f"tj-{uuid.uuid4().hex[:8]}", kubeconfig=sim_cluster.kubeconfig, capabilities=CAPABILITIES,
        tmp=tmp_path, sweep_grace_s="0", guard_lease_ms="10000",
    )  # fmt: skip


@pytest.fixture
def hand(sim_cluster: LocalCluster) -> Iterator[Any]:
    """An operator's kubectl: the Kubernetes client's own merge patches of Jobs."""
    api = kubernetes.config.new_client_from_config(config_file=str(sim_cluster.kubeconfig))
    yield kubernetes.client.BatchV1Api(api)
    api.close()


def edit(hand: Any, rt: Runtime, name: str, **metadata: dict[str, str]) -> None:
    """`kubectl label|annotate --overwrite job NAME k=v`."""
    hand.patch_namespaced_job(name, rt.settings.namespace, {"metadata": metadata})


def job_or_none(rt: Runtime, name: str) -> dict[str, Any] | None:
    try:
        return rt.kube.get_job(rt.settings.namespace, name)
    except NotFound:
        return None


def our_pods(rt: Runtime, name: str) -> list[dict[str, Any]]:
    return rt.kube.list_pods(rt.settings.namespace, label_selector=f"batch.kubernetes.io/job-name={name}")


def row(rt: Runtime, dispatch_id: str) -> Any:
    with transaction(rt.sessions) as session:
        return dispatches.get_dispatch(session, dispatch_id)


def terminal_events(rt: Runtime, dispatch_id: str) -> list[tuple[str, Any]]:
    with transaction(rt.sessions) as session:
        return [
            (e.type, e.payload) for e in dispatches.events_for(session, dispatch_id) if e.type != "WORKER_SCHEDULED"
        ]


def created(rt: Runtime, capability: str) -> tuple[str, str]:
    dispatch_id = schedule(rt, capability)
    create.create_job_for(rt, dispatch_id)
    assert row(rt, dispatch_id).state == DispatchState.CREATED
    return dispatch_id, job_name(dispatch_id)


def sweep_until(rt: Runtime, done: Any, *, what: str, timeout_s: float = 20.0) -> None:
    wait_until(lambda: run_sweep(rt) is not None and done(), what=what, timeout=timeout_s)


def assert_cleaned_up(rt: Runtime, name: str) -> None:
    wait_until(lambda: job_or_none(rt, name) is None, what=f"job {name} gone", timeout=15.0)
    assert all(FINALIZER not in (p["metadata"].get("finalizers") or []) for p in our_pods(rt, name))


def test_a_finished_job_whose_tenancy_is_overwritten_fails_job_tampered_after_the_grace(make_runtime, hand):
    rt = make_runtime(tampered_grace_s="2")
    dispatch_id, name = created(rt, "sim.ok")
    wait_until(lambda: job_state(rt.kube.get_job(rt.settings.namespace, name)).terminal, what="finished", timeout=15.0)
    edit(hand, rt, name, labels={job_labels.TENANCY_ID_KEY: "tenant-evil"})

    first = run_sweep(rt)
    c = first.categories[Category.TAMPERED]
    assert (c.found, c.acted) == (1, 1) and first.errors == 0  # found by the LIST, noted
    noted_at = row(rt, dispatch_id).job_tampered_at
    assert noted_at is not None and terminal_events(rt, dispatch_id) == []  # inside the grace: never delivered
    run_sweep(rt)
    assert row(rt, dispatch_id).job_tampered_at == noted_at  # the clock's origin does not move

    sweep_until(rt, lambda: row(rt, dispatch_id).state == DispatchState.FAILED, what="JobTampered")
    ((kind, payload),) = terminal_events(rt, dispatch_id)
    assert kind == EventType.WORKER_FAILED and payload["reason"] == JOB_TAMPERED_REASON
    assert "tenant-evil" in payload["message"] and payload["detail"]["refusal"] == "TenancyMismatch"
    assert_cleaned_up(rt, name)
    sweep_until(rt, lambda: row(rt, dispatch_id).job_stopped_at is not None, what="the job seen stopped")
    assert row(rt, dispatch_id).job_tampered_at is None  # forgotten once ended and gone
    assert len(terminal_events(rt, dispatch_id)) == 1 and job_or_none(rt, name) is None  # never re-created


def test_a_running_job_with_a_malformed_attempt_annotation_fails_and_is_stopped(make_runtime, hand):
    rt = make_runtime(tampered_grace_s="0")
    dispatch_id, name = created(rt, "sim.hang")
    uid = rt.kube.get_job(rt.settings.namespace, name)["metadata"]["uid"]
    edit(hand, rt, name, annotations={job_labels.ATTEMPT_KEY: "two"})

    report = run_sweep(rt)
    assert report.categories[Category.TAMPERED].acted == 1 and report.errors == 0
    ((kind, payload),) = terminal_events(rt, dispatch_id)
    assert kind == EventType.WORKER_FAILED and payload["reason"] == JOB_TAMPERED_REASON
    assert "two" in payload["message"]
    assert_cleaned_up(rt, name)  # it ran for ever: removed, its Pods freed
    sweep_until(rt, lambda: row(rt, dispatch_id).job_stopped_at is not None, what="its slot freed")
    assert job_or_none(rt, name) is None and len(terminal_events(rt, dispatch_id)) == 1
    assert uid  # the one Job there ever was


def test_a_job_put_right_within_the_grace_is_delivered_as_usual(make_runtime, hand):
    rt = make_runtime(tampered_grace_s="300")
    dispatch_id, name = created(rt, "sim.ok")
    wait_until(lambda: job_state(rt.kube.get_job(rt.settings.namespace, name)).terminal, what="finished", timeout=15.0)
    edit(hand, rt, name, labels={job_labels.CASE_ID_KEY: "case-other"})
    run_sweep(rt)
    assert row(rt, dispatch_id).job_tampered_at is not None
    case_id = row(rt, dispatch_id).case_id
    edit(hand, rt, name, labels={job_labels.CASE_ID_KEY: case_id})  # the operator undoes the edit
    sweep_until(rt, lambda: row(rt, dispatch_id).state == DispatchState.COMPLETED, what="delivered")
    assert [kind for kind, _ in terminal_events(rt, dispatch_id)] == [EventType.WORKER_COMPLETED]
    assert row(rt, dispatch_id).job_tampered_at is None


def test_delivered_true_put_on_a_running_job_by_hand_still_ends_it_once(make_runtime, hand):
    rt = make_runtime(tampered_grace_s="300")
    dispatch_id, name = created(rt, "sim.slow")
    uid = rt.kube.get_job(rt.settings.namespace, name)["metadata"]["uid"]
    edit(hand, rt, name, labels={job_labels.DELIVERED_LABEL: job_labels.DELIVERED})
    # Out of every selector of ours, held by our finalizer: found by its name from the database.
    report = run_sweep(rt)
    assert report.errors == 0 and row(rt, dispatch_id).job_tampered_at is not None
    assert rt.kube.get_job(rt.settings.namespace, name)["metadata"]["uid"] == uid  # not created again
    sweep_until(rt, lambda: row(rt, dispatch_id).state != DispatchState.CREATED, what="the dispatch ended")
    ((kind, payload),) = terminal_events(rt, dispatch_id)
    # Delivered as its Job ended: its result, or JobDeleted when the bulk delete of delivered Jobs
    # (which its label asks for) came first; never a second Job.
    assert (kind, payload.get("output")) == (EventType.WORKER_COMPLETED, {"simulated": True, "input": {"n": 1}}) or (
        kind == EventType.WORKER_FAILED and payload["reason"] == "JobDeleted"
    ), (kind, payload)
    assert_cleaned_up(rt, name)
    run_sweep(rt)
    assert row(rt, dispatch_id).job_tampered_at is None and len(terminal_events(rt, dispatch_id)) == 1
    assert uid and job_or_none(rt, name) is None


def test_a_hidden_job_whose_dispatch_ended_without_its_release_is_released_and_deleted(make_runtime, hand):
    """A replica recorded the end and died before it let the Job go, while the Job was hidden by
    hand: no LIST of ours selects the finished Job and the bulk delete leaves it held by our
    finalizer, so the sweep releases and deletes it by name."""
    rt = make_runtime(tampered_grace_s="300")
    dispatch_id, name = created(rt, "sim.slow")
    edit(hand, rt, name, labels={job_labels.DELIVERED_LABEL: job_labels.DELIVERED})
    assert run_sweep(rt).errors == 0 and row(rt, dispatch_id).job_tampered_at is not None
    with transaction(rt.sessions) as session:  # the end, recorded; the release never came
        dispatches.record_terminal(session, dispatch_id, EventType.WORKER_COMPLETED, {"output": {"n": 1}})
    wait_until(lambda: job_state(rt.kube.get_job(rt.settings.namespace, name)).terminal, what="finished", timeout=15.0)
    assert FINALIZER in (rt.kube.get_job(rt.settings.namespace, name)["metadata"].get("finalizers") or [])
    sweep_until(rt, lambda: job_or_none(rt, name) is None, what="the hidden Job released and deleted")
    assert_cleaned_up(rt, name)
    assert [kind for kind, _ in terminal_events(rt, dispatch_id)] == [EventType.WORKER_COMPLETED]


def test_with_the_delete_policy_the_removed_jobs_dispatch_runs_again_from_its_row_alone(make_runtime, hand):
    """ORPHAN_POLICY=delete removes the refused Job at once; its dispatch is noted on its row
    first, so beat's sweep runs it again though no watch event said the Job left (a note lost
    with the broker, a relist) and the namespace's next LIST is far away."""
    rt = make_runtime(orphan_policy="delete", tampered_grace_s="300")
    dispatch_id, name = created(rt, "sim.slow")
    uid = rt.kube.get_job(rt.settings.namespace, name)["metadata"]["uid"]
    edit(hand, rt, name, labels={job_labels.TENANCY_ID_KEY: "tenant-evil"})
    assert run_sweep(rt).categories[Category.TAMPERED].acted == 1
    assert row(rt, dispatch_id).job_tampered_at is not None
    wait_until(lambda: job_or_none(rt, name) is None, what="the edited Job removed", timeout=15.0)
    # The watch is healthy and noted nothing; the LIST is not due: only the row says what to do.
    watch = jobwatch.key(rt.settings.key_prefix, rt.settings.effective_deployment, rt.settings.namespace)
    rt.redis.set(jobwatch.healthy_key(watch), 1, ex=600)
    rt.redis.set(jobwatch.listed_key(watch), 1, ex=600)
    assert not rt.redis.exists(jobwatch.gone_key(watch))

    def again() -> dict[str, Any] | None:
        run_sweep(rt, watched=True)
        return job_or_none(rt, name)

    job = wait_until(again, what="a Job of its own", timeout=20.0)
    assert job["metadata"]["uid"] != uid and job["metadata"]["annotations"][job_labels.ATTEMPT_KEY] == "1"
    wait_until(lambda: job_state(rt.kube.get_job(rt.settings.namespace, name)).terminal, what="finished", timeout=15.0)
    sweep_until(rt, lambda: row(rt, dispatch_id).state == DispatchState.COMPLETED, what="delivered")
    assert [kind for kind, _ in terminal_events(rt, dispatch_id)] == [EventType.WORKER_COMPLETED]
    assert row(rt, dispatch_id).job_tampered_at is None  # put right: forgotten


def test_a_job_hidden_before_its_create_was_marked_is_adopted_noted_and_delivered(make_runtime, hand):
    """The create's answer was lost (its Job made, its row still SCHEDULED), then the Job was
    labelled `delivered=true` by hand: the create's retry adopts it on 409 while nothing of ours
    selects it and no watch event will come. The row notes it with its mark, so beat's sweep
    delivers it by name though the watch is healthy and the namespace's next LIST is far away."""
    rt = make_runtime(tampered_grace_s="300")
    dispatch_id, name = created(rt, "sim.ok")
    uid = rt.kube.get_job(rt.settings.namespace, name)["metadata"]["uid"]
    with transaction(rt.sessions) as session:  # the mark never committed
        session.execute(
            sa.update(Dispatch)
            .where(Dispatch.dispatch_id == dispatch_id)
            .values(state=DispatchState.SCHEDULED, job_name=None, job_created_at=None)
        )
    edit(hand, rt, name, labels={job_labels.DELIVERED_LABEL: job_labels.DELIVERED})

    assert create.create_jobs_for(rt, [dispatch_id]) == {dispatch_id: create.CreateOutcome.ADOPTED}
    assert row(rt, dispatch_id).state == DispatchState.CREATED
    assert row(rt, dispatch_id).job_tampered_at is not None
    watch = jobwatch.key(rt.settings.key_prefix, rt.settings.effective_deployment, rt.settings.namespace)
    rt.redis.set(jobwatch.healthy_key(watch), 1, ex=600)
    rt.redis.set(jobwatch.listed_key(watch), 1, ex=600)

    def ended() -> bool:
        run_sweep(rt, watched=True)
        return row(rt, dispatch_id).state != DispatchState.CREATED

    wait_until(ended, what="the hidden Job's dispatch ended", timeout=20.0)
    ((kind, payload),) = terminal_events(rt, dispatch_id)
    assert (kind, payload.get("output")) == (EventType.WORKER_COMPLETED, {"simulated": True, "input": {"n": 1}})
    sweep_until(rt, lambda: job_or_none(rt, name) is None, what="the delivered Job's bulk delete")
    assert_cleaned_up(rt, name)
    assert uid and len(terminal_events(rt, dispatch_id)) == 1
