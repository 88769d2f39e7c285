"""The single delivery path, in process, against real PostgreSQL, Redis and localcluster.

Create, complete, cancel and clean up, each with the outcomes and reasons the engine sees, and
the refusals that keep a Job from being delivered. The Celery layer on top is tested with real
worker processes in tests/tasks.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import kubernetes
import pytest
import sqlalchemy as sa
from clusters import LOCAL, REAL, ClusterHandle
from forged_jobs import SIM, forge_job
from runtimes import Notified, runtime_values, schedule

from k8s_dispatch.core.errors import ApiUnavailable, InvalidId, UnknownDispatch
from k8s_dispatch.delivery import stats
from k8s_dispatch.delivery.cancel import cancel_dispatch
from k8s_dispatch.delivery.cleanup import JOB_NAME_LABEL, cleanup_job, delete_delivered_later, delete_noted
from k8s_dispatch.delivery.complete import CompleteOutcome, complete_job, complete_jobs, job_snapshot
from k8s_dispatch.delivery.create import CreateOutcome, create_job_for, create_jobs_for
from k8s_dispatch.delivery.records import load_record
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.delivery.terminal import notify_engine
from k8s_dispatch.demo.localcluster import LocalCluster
from k8s_dispatch.ops.processes import wait_until
from k8s_dispatch.recovery.sweep import run_sweep
from k8s_dispatch.store import dispatches
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import DispatchState, EventType
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.job_status import job_state
from k8s_dispatch.workers.manifest import FINALIZER, job_name
from k8s_dispatch.workers.types import DispatchRef


def capability(**fields: Any) -> dict[str, Any]:
    annotations = {SIM + "duration-ms": "20", **fields.pop("sim", {})}
    return {"worker": "sim", "image": "sim:1", "annotations": annotations, **fields}


CAPABILITIES = {
    "capabilities": {
        "sim.ok": capability(),
        "sim.fail": capability(sim={SIM + "outcome": "fail", SIM + "exit-code": "3"}),
        "sim.slow": capability(sim={SIM + "outcome": "hang"}, activeDeadlineSeconds=1),
        "sim.hang": capability(sim={SIM + "outcome": "hang"}, activeDeadlineSeconds=None),
        "sim.notjson": capability(sim={SIM + "result": "this is not JSON"}),
    }
}


@pytest.fixture(scope="module")
def local_cluster() -> Iterator[LocalCluster]:
    with LocalCluster(mode="simulate") as c:
        yield c


@pytest.fixture
def cluster(request: pytest.FixtureRequest) -> LocalCluster | ClusterHandle:
    """localcluster; a test marked `ON_BOTH` runs on the real control plane as well."""
    if getattr(request, "param", LOCAL) == REAL:
        return request.getfixturevalue("real_cluster")
    return request.getfixturevalue("local_cluster")


# The tests that state what must hold on any Kubernetes: they run on both clusters.
ON_BOTH = pytest.mark.parametrize("cluster", [LOCAL, REAL], indirect=True)


@pytest.fixture
def runtime_env(cluster, pg_url, redis_url, key_prefix, request, tmp_path) -> dict[str, str]:
    """This test's namespace (made ready on the real control plane) and CAPABILITIES."""
    namespace = f"dl-{uuid.uuid4().hex[:8]}"
    if isinstance(cluster, ClusterHandle):
        cluster.ensure_namespace(namespace)
    return runtime_values(
        database_url=pg_url, redis_url=redis_url, prefix=f"{key_prefix}-{request.node.name[:30]}",
        namespace=namespace, kubeconfig=cluster.kubeconfig, capabilities=CAPABILITIES, tmp=tmp_path,
        guard_lease_ms="10000",
    )  # fmt: skip


def job_finished(rt: Runtime, dispatch_id: str) -> dict[str, Any]:
    namespace = rt.settings.namespace
    return wait_until(
        lambda: (lambda j: j if job_state(j).terminal else None)(rt.kube.get_job(namespace, job_name(dispatch_id))),
        what=f"job of {dispatch_id} finished",
        timeout=30.0,
    )


def events(rt: Runtime, dispatch_id: str) -> list[tuple[str, Any]]:
    with transaction(rt.sessions) as session:
        return [(e.type, e.payload) for e in dispatches.events_for(session, dispatch_id)]


def job_exists(rt: Runtime, dispatch_id: str) -> bool:
    pages = rt.kube.iter_jobs(rt.settings.namespace, label_selector=f"{job_labels.DISPATCH_ID_KEY}={dispatch_id}")
    return any(page for page in pages)


def notified_at(rt: Runtime, dispatch_id: str):
    with transaction(rt.sessions) as session:
        return dispatches.get_dispatch(session, dispatch_id).notified_at


# --- the happy path ------------------------------------------------------------------------


@ON_BOTH
def test_create_then_complete_delivers_the_output_once_and_leaves_nothing(rt, notified):
    dispatch_id = schedule(rt, "sim.ok", {"text": "hello"})
    assert create_job_for(rt, dispatch_id) is CreateOutcome.CREATED
    record = load_record(rt, dispatch_id)
    assert record.state is DispatchState.CREATED
    assert (record.job_namespace, record.job_name) == (rt.settings.namespace, job_name(dispatch_id))
    job = rt.kube.get_job(rt.settings.namespace, job_name(dispatch_id))
    assert FINALIZER in job["metadata"]["finalizers"]

    job_finished(rt, dispatch_id)
    assert complete_job(rt, rt.settings.namespace, job_name(dispatch_id)) is CompleteOutcome.COMPLETED

    assert events(rt, dispatch_id)[1:] == [
        (EventType.WORKER_COMPLETED, {"output": {"simulated": True, "input": {"text": "hello"}}})
    ]
    assert load_record(rt, dispatch_id).state is DispatchState.COMPLETED
    assert notified.ids == [dispatch_id]
    assert notified_at(rt, dispatch_id) is not None
    wait_until(lambda: not job_exists(rt, dispatch_id), what="job deleted", timeout=10.0)
    # Again, as a redelivered message would: nothing more happens.
    assert complete_job(rt, rt.settings.namespace, job_name(dispatch_id)) is CompleteOutcome.GONE
    assert create_job_for(rt, dispatch_id) is CreateOutcome.SKIPPED
    assert len(events(rt, dispatch_id)) == 2 and notified.ids == [dispatch_id]


@ON_BOTH
def test_a_second_create_adopts_the_job_instead_of_doubling_it(rt):
    dispatch_id = schedule(rt, "sim.hang")
    assert create_job_for(rt, dispatch_id) is CreateOutcome.CREATED
    uid = rt.kube.get_job(rt.settings.namespace, job_name(dispatch_id))["metadata"]["uid"]
    assert create_job_for(rt, dispatch_id) is CreateOutcome.ADOPTED
    assert rt.kube.get_job(rt.settings.namespace, job_name(dispatch_id))["metadata"]["uid"] == uid
    assert complete_job(rt, rt.settings.namespace, job_name(dispatch_id)) is CompleteOutcome.RUNNING
    assert len(events(rt, dispatch_id)) == 1  # WORKER_SCHEDULED only
    cancel_dispatch(rt, dispatch_id)


# --- completions in batches, as poll hands them off -------------------------------------------


def listed_finished(rt: Runtime) -> list[dict[str, Any]]:
    """What poll hands off: snapshots of the finished Jobs one LIST of undelivered Jobs shows."""
    pages = rt.kube.iter_jobs(
        rt.settings.namespace, label_selector=job_labels.undelivered_selector(rt.settings.effective_deployment)
    )
    return [job_snapshot(job) for page in pages for job in page if job_state(job).terminal]


def test_a_batch_of_listed_jobs_is_delivered_without_a_get_or_a_delete_per_job(cluster, rt, notified):
    inputs = {schedule(rt, "sim.ok", {"i": i}): {"i": i} for i in range(12)}
    for dispatch_id in inputs:
        assert create_job_for(rt, dispatch_id) is CreateOutcome.CREATED
    for dispatch_id in inputs:
        job_finished(rt, dispatch_id)
    names = sorted(job_name(d) for d in inputs)

    cluster.audit(clear=True)
    batch = listed_finished(rt)
    assert sorted(j["metadata"]["name"] for j in batch) == names
    done = complete_jobs(rt, rt.settings.namespace, batch)
    assert done.outcomes == [CompleteOutcome.COMPLETED] * len(inputs) and done.error is None
    # One LIST of Jobs, one of Pods, a patch per Pod and per Job, one bulk delete: no GET, no DELETE of one Job.
    assert cluster.audit() == {
        ("batch", "jobs", "list"), ("", "pods", "list"), ("", "pods", "patch"), ("batch", "jobs", "patch"),
        ("batch", "jobs", "deletecollection"),
    }  # fmt: skip

    for dispatch_id, value in inputs.items():
        assert events(rt, dispatch_id)[1:] == [
            (EventType.WORKER_COMPLETED, {"output": {"simulated": True, "input": value}})
        ]
    assert sorted(notified.ids) == sorted(inputs)
    selector = f"{JOB_NAME_LABEL} in ({','.join(names)})"
    wait_until(lambda: not any(job_exists(rt, d) for d in inputs), what="every job deleted", timeout=10.0)
    wait_until(lambda: rt.kube.list_pods(rt.settings.namespace, label_selector=selector) == [],
               what="their pods deleted", timeout=10.0)  # fmt: skip
    # The same message again (a redelivery): nothing more happens.
    assert complete_jobs(rt, rt.settings.namespace, batch).outcomes == [CompleteOutcome.ALREADY_TERMINAL] * len(inputs)
    assert all(len(events(rt, d)) == 2 for d in inputs) and len(notified.ids) == len(inputs)


def test_the_bulk_delete_of_many_batches_is_left_to_the_next_poll_once(cluster, rt, notified):
    """complete_batch's way: the batches of a poll interval note their released Jobs in Redis,
    and the next poll removes them all with one bulk delete (none when nothing was noted)."""
    ids = [schedule(rt, "sim.ok", {"i": i}) for i in range(4)]
    for dispatch_id in ids:
        create_job_for(rt, dispatch_id)
        job_finished(rt, dispatch_id)
    listed = listed_finished(rt)
    cluster.audit(clear=True)
    for batch in (listed[:2], listed[2:]):
        done = complete_jobs(rt, rt.settings.namespace, batch, delete=False)
        assert done.outcomes == [CompleteOutcome.COMPLETED] * 2 and done.released
        delete_delivered_later(rt, rt.settings.namespace)
    assert ("batch", "jobs", "deletecollection") not in cluster.audit()
    assert all(job_exists(rt, d) for d in ids)  # released (delivered label on), not yet deleted

    assert delete_noted(rt, rt.settings.namespace) == 4
    assert ("batch", "jobs", "deletecollection") in cluster.audit()
    wait_until(lambda: not any(job_exists(rt, d) for d in ids), what="every job deleted", timeout=10.0)
    cluster.audit(clear=True)
    assert delete_noted(rt, rt.settings.namespace) == 0  # nothing noted since: no request at all
    assert cluster.audit() == set()
    assert held_pods(rt) == []


class Statements:
    """Counts the SQL statements sent on an engine (an executemany counts once)."""

    def __init__(self, engine: Any) -> None:
        self.count = 0
        sa.event.listen(engine, "before_cursor_execute", self._one)
        self._engine = engine

    def _one(self, *args: Any) -> None:
        self.count += 1

    def close(self) -> None:
        sa.event.remove(self._engine, "before_cursor_execute", self._one)


@pytest.mark.parametrize("size", [3, 15])
def test_a_batchs_database_work_does_not_grow_with_its_jobs(rt, notified, size):
    """Rows read, events written, dispatches notified: the same statements for 3 Jobs as for 15."""
    ids = [schedule(rt, "sim.ok", {"i": i}) for i in range(size)]
    for dispatch_id in ids:
        create_job_for(rt, dispatch_id)
        job_finished(rt, dispatch_id)
    batch = listed_finished(rt)
    statements = Statements(rt.engine)
    try:
        done = complete_jobs(rt, rt.settings.namespace, batch)
    finally:
        statements.close()
    assert done.outcomes == [CompleteOutcome.COMPLETED] * size and sorted(notified.ids) == sorted(ids)
    # The rows read; the case ids, the events (one multi-row insert), the dispatches (one
    # executemany), the cases; the dispatches marked notified. It was 6 per Job.
    assert statements.count <= 6


@ON_BOTH
def test_a_mixed_batch_gives_each_job_its_own_outcome_in_order(rt, notified):
    ok, elsewhere, running = schedule(rt, "sim.ok"), schedule(rt, "sim.ok"), schedule(rt, "sim.hang")
    for dispatch_id in (ok, elsewhere, running):
        create_job_for(rt, dispatch_id)
    for dispatch_id in (ok, elsewhere):
        job_finished(rt, dispatch_id)
    held = rt.guard.claim(elsewhere)  # another replica is delivering it
    assert held is not None
    pages = rt.kube.iter_jobs(
        rt.settings.namespace, label_selector=job_labels.undelivered_selector(rt.settings.effective_deployment)
    )
    listed = {j["metadata"]["name"]: job_snapshot(j) for page in pages for j in page}
    batch = [listed[job_name(d)] for d in (running, elsewhere, ok, ok)]  # ok twice: delivered once

    done = complete_jobs(rt, rt.settings.namespace, batch)
    assert done.outcomes == [
        CompleteOutcome.RUNNING, CompleteOutcome.CLAIMED_ELSEWHERE, CompleteOutcome.COMPLETED, CompleteOutcome.ALREADY_TERMINAL,
    ]  # fmt: skip
    assert notified.ids == [ok]
    assert rt.guard.holder(elsewhere) == held.owner and rt.guard.holder(ok) is None  # only ours released

    rt.guard.release(held)
    again = complete_jobs(rt, rt.settings.namespace, batch)  # the message redelivered
    assert again.outcomes == [
        CompleteOutcome.RUNNING, CompleteOutcome.COMPLETED, CompleteOutcome.ALREADY_TERMINAL, CompleteOutcome.ALREADY_TERMINAL,
    ]  # fmt: skip
    assert (len(events(rt, ok)), len(events(rt, elsewhere)), len(events(rt, running))) == (2, 2, 1)
    assert sorted(notified.ids) == sorted([ok, elsewhere])


def test_a_batch_shows_its_failed_dispatch_once_and_nothing_else(rt, notified):
    """`Runtime.on_failed` (Flower's failed-task echo) hears of the batch's one WORKER_FAILED, with
    its reason and message, once: not of the completed one, nor of the failure delivered again."""
    echoed: list[tuple[str, str, str]] = []
    rt.on_failed = lambda dispatch_id, reason, message: echoed.append((dispatch_id, reason, message))
    ok, failing = schedule(rt, "sim.ok"), schedule(rt, "sim.fail")
    for dispatch_id in (ok, failing):
        create_job_for(rt, dispatch_id)
        job_finished(rt, dispatch_id)
    pages = rt.kube.iter_jobs(
        rt.settings.namespace, label_selector=job_labels.undelivered_selector(rt.settings.effective_deployment)
    )
    batch = [job_snapshot(j) for page in pages for j in page]

    assert complete_jobs(rt, rt.settings.namespace, batch).outcomes == [CompleteOutcome.COMPLETED] * 2
    [(event, payload)] = events(rt, failing)[1:]
    assert event == EventType.WORKER_FAILED
    assert echoed == [(failing, payload["reason"], payload.get("message", ""))] and payload["reason"]
    assert CompleteOutcome.COMPLETED not in complete_jobs(rt, rt.settings.namespace, batch).outcomes  # redelivered
    assert len(echoed) == 1 and sorted(notified.ids) == sorted([ok, failing])


def test_a_job_recreated_under_the_same_name_after_the_list_is_left_alone(rt):
    dispatch_id = schedule(rt, "sim.ok")
    create_job_for(rt, dispatch_id)
    job_finished(rt, dispatch_id)
    [stale] = listed_finished(rt)
    assert complete_jobs(rt, rt.settings.namespace, [stale]).outcomes == [CompleteOutcome.COMPLETED]
    wait_until(lambda: not job_exists(rt, dispatch_id), what="job deleted", timeout=10.0)
    # A Job of the same name and labels appears (another uid); then the old snapshot comes again.
    name = forge_job(
        rt.kube, rt.settings.namespace, load_record(rt, dispatch_id).ref, deployment=rt.settings.effective_deployment
    )
    uid = rt.kube.get_job(rt.settings.namespace, name)["metadata"]["uid"]
    assert uid != stale["metadata"]["uid"]

    assert complete_jobs(rt, rt.settings.namespace, [stale]).outcomes == [CompleteOutcome.ALREADY_TERMINAL]
    metadata = rt.kube.get_job(rt.settings.namespace, name)["metadata"]
    assert metadata["uid"] == uid
    assert FINALIZER in metadata["finalizers"]  # its finalizer kept, not labelled, not deleted
    assert job_labels.DELIVERED_LABEL not in metadata["labels"]
    assert len(events(rt, dispatch_id)) == 2
    cleanup_job(rt, rt.settings.namespace, name)


def test_a_job_snapshot_keeps_what_delivery_reads_and_drops_the_rest(rt):
    dispatch_id = schedule(rt, "sim.ok")
    create_job_for(rt, dispatch_id)
    job = job_finished(rt, dispatch_id)
    snapshot = job_snapshot(job)
    assert set(snapshot) == {"metadata", "status"} and snapshot["status"] == job["status"]
    assert all(key.startswith(job_labels.PREFIX) for key in snapshot["metadata"].get("annotations", {}))
    assert "spec" not in snapshot and "managedFields" not in snapshot["metadata"]
    assert {"name", "namespace", "uid", "labels", "finalizers"} <= set(snapshot["metadata"])
    # It delivers exactly as the whole Job does.
    assert (
        complete_job(rt, rt.settings.namespace, job_name(dispatch_id), snapshot=snapshot) is CompleteOutcome.COMPLETED
    )
    assert events(rt, dispatch_id)[1][0] == EventType.WORKER_COMPLETED


# --- a finished Pod removed before delivery -------------------------------------------------------


@pytest.fixture
def api(cluster) -> Iterator[kubernetes.client.ApiClient]:
    """The official client, for what a person or a controller does to our Jobs and Pods."""
    client = kubernetes.config.new_client_from_config(config_file=str(cluster.kubeconfig))
    yield client
    client.close()


def pods_of(rt: Runtime, dispatch_id: str, *, job_uid: str | None = None) -> list[dict[str, Any]]:
    """The Pods of the dispatch's Job; with `job_uid`, of that Job only (a real cluster's garbage
    collector removes an earlier attempt's Pods some time after its Job)."""
    selector = f"{JOB_NAME_LABEL}={job_name(dispatch_id)}"
    if job_uid is not None:
        selector += f",batch.kubernetes.io/controller-uid={job_uid}"
    return rt.kube.list_pods(rt.settings.namespace, label_selector=selector)


def held_pods(rt: Runtime) -> list[str]:
    """Every Pod of ours in the namespace that our finalizer still holds."""
    pods = rt.kube.list_pods(rt.settings.namespace, label_selector=job_labels.selector())
    return [p["metadata"]["name"] for p in pods if FINALIZER in (p["metadata"].get("finalizers") or [])]


def nothing_left(rt: Runtime, dispatch_id: str) -> None:
    """The Job and its Pods gone, and no Pod of ours held by our finalizer: nothing leaks."""
    wait_until(
        lambda: not job_exists(rt, dispatch_id) and not pods_of(rt, dispatch_id), what="job and pods gone", timeout=30.0
    )
    assert held_pods(rt) == []


def finished_pod(rt: Runtime, dispatch_id: str) -> dict[str, Any]:
    job_finished(rt, dispatch_id)
    [pod] = pods_of(rt, dispatch_id)
    assert FINALIZER in pod["metadata"]["finalizers"]  # copied from the Job's template
    return pod


@ON_BOTH
def test_a_succeeded_jobs_pod_deleted_before_poll_sees_it_is_still_delivered_with_its_output(rt, notified, api):
    """`kubectl delete pod`, a drained node or PodGC (grace 0) before delivery: the Pod waits."""
    dispatch_id = schedule(rt, "sim.ok", {"text": "kept"})
    create_job_for(rt, dispatch_id)
    pod = finished_pod(rt, dispatch_id)
    kubernetes.client.CoreV1Api(api).delete_namespaced_pod(
        pod["metadata"]["name"], rt.settings.namespace, grace_period_seconds=0
    )
    [marked] = pods_of(rt, dispatch_id)
    assert marked["metadata"].get("deletionTimestamp")

    assert complete_jobs(rt, rt.settings.namespace, listed_finished(rt)).outcomes == [CompleteOutcome.COMPLETED]
    assert events(rt, dispatch_id)[1:] == [
        (EventType.WORKER_COMPLETED, {"output": {"simulated": True, "input": {"text": "kept"}}})
    ]
    assert notified.ids == [dispatch_id]
    nothing_left(rt, dispatch_id)


@ON_BOTH
def test_a_succeeded_job_deleted_in_the_foreground_before_delivery_is_delivered_with_its_output(rt, notified, api):
    """`kubectl delete job --cascade=foreground`: the Pods go first, so ours must wait for us."""
    dispatch_id = schedule(rt, "sim.ok", {"text": "fg"})
    create_job_for(rt, dispatch_id)
    finished_pod(rt, dispatch_id)
    kubernetes.client.BatchV1Api(api).delete_namespaced_job(
        job_name(dispatch_id), rt.settings.namespace, propagation_policy="Foreground"
    )
    wait_until(
        lambda: pods_of(rt, dispatch_id)[0]["metadata"].get("deletionTimestamp"), what="pod deleted", timeout=10.0
    )

    [listed] = listed_finished(rt)  # deleting, and still to deliver
    assert listed["metadata"].get("deletionTimestamp")
    assert complete_jobs(rt, rt.settings.namespace, [listed]).outcomes == [CompleteOutcome.COMPLETED]
    assert events(rt, dispatch_id)[1:] == [
        (EventType.WORKER_COMPLETED, {"output": {"simulated": True, "input": {"text": "fg"}}})
    ]
    nothing_left(rt, dispatch_id)  # the Pods freed, the Job then went with the foreground deletion


def lose_pod(rt: Runtime, api: Any, dispatch_id: str) -> None:
    """Strip our finalizer off the finished Pod and delete it, as a person might: its result is gone."""
    core = kubernetes.client.CoreV1Api(api)
    pod = finished_pod(rt, dispatch_id)
    name, index = pod["metadata"]["name"], pod["metadata"]["finalizers"].index(FINALIZER)
    core.patch_namespaced_pod(name, rt.settings.namespace, [{"op": "remove", "path": f"/metadata/finalizers/{index}"}])
    core.delete_namespaced_pod(name, rt.settings.namespace)
    wait_until(lambda: not pods_of(rt, dispatch_id), what="the pod gone", timeout=10.0)


@ON_BOTH
def test_a_succeeded_job_whose_pod_is_really_gone_is_run_again_and_completes_on_the_next_attempt(
    make_runtime, notified, api
):
    rt = make_runtime(notifier=notified, sweep_grace_s="0")
    dispatch_id = schedule(rt, "sim.ok", {"text": "again"})
    create_job_for(rt, dispatch_id)
    lose_pod(rt, api, dispatch_id)
    [stale] = listed_finished(rt)

    assert complete_jobs(rt, rt.settings.namespace, [stale]).outcomes == [CompleteOutcome.RERUN]
    assert events(rt, dispatch_id)[1:] == [] and notified.ids == []  # no failure of work that succeeded
    if load_record(rt, dispatch_id).attempts == 0:
        # kube-apiserver can still answer the re-create's POST with the old Job (409) and its GET
        # with 404: a Transient the caller leaves to the sweep, whose category 5 re-creates it
        wait_until(
            lambda: run_sweep(rt) and load_record(rt, dispatch_id).attempts == 1,
            timeout=30.0,
            what="the sweep re-creating the lost Job",
        )
    record = load_record(rt, dispatch_id)
    assert (record.state, record.attempts) == (DispatchState.CREATED, 1)
    job = rt.kube.get_job(rt.settings.namespace, job_name(dispatch_id))
    assert job["metadata"]["uid"] != stale["metadata"]["uid"]
    assert job["metadata"]["annotations"][job_labels.ATTEMPT_KEY] == "1"
    # The old snapshot again (a redelivered message): the new attempt and its Pod are left alone,
    # and counted once.
    uid = job["metadata"]["uid"]
    [new_pod] = wait_until(lambda: pods_of(rt, dispatch_id, job_uid=uid), what="the new attempt's pod", timeout=30.0)
    assert complete_jobs(rt, rt.settings.namespace, [stale, stale]).outcomes == [CompleteOutcome.RERUN] * 2
    assert rt.kube.get_job(rt.settings.namespace, job_name(dispatch_id))["metadata"]["uid"] == job["metadata"]["uid"]
    assert load_record(rt, dispatch_id).attempts == 1
    [still] = pods_of(rt, dispatch_id, job_uid=uid)
    assert still["metadata"]["uid"] == new_pod["metadata"]["uid"] and FINALIZER in still["metadata"]["finalizers"]

    job_finished(rt, dispatch_id)
    assert complete_jobs(rt, rt.settings.namespace, listed_finished(rt)).outcomes == [CompleteOutcome.COMPLETED]
    assert events(rt, dispatch_id)[1:] == [
        (EventType.WORKER_COMPLETED, {"output": {"simulated": True, "input": {"text": "again"}}})
    ]
    # (once; a sweep that ran above also told the engine of other tests' dispatches in the shared database)
    assert notified.ids.count(dispatch_id) == 1
    nothing_left(rt, dispatch_id)


@ON_BOTH
def test_a_lost_result_past_the_attempts_limit_fails_as_job_lost(make_runtime, notified, api):
    rt = make_runtime(notifier=notified, max_job_attempts="1")
    dispatch_id = schedule(rt, "sim.ok")
    create_job_for(rt, dispatch_id)
    lose_pod(rt, api, dispatch_id)

    assert complete_jobs(rt, rt.settings.namespace, listed_finished(rt)).outcomes == [CompleteOutcome.COMPLETED]
    [(event_type, payload)] = events(rt, dispatch_id)[1:]
    assert (event_type, payload["reason"]) == (EventType.WORKER_FAILED, "JobLost")
    assert "result was lost" in payload["message"] and "1 attempt(s)" in payload["message"]
    assert notified.ids == [dispatch_id]
    nothing_left(rt, dispatch_id)


# --- failures, with the reason the engine sees ----------------------------------------------------


@pytest.mark.parametrize(
    ("capability_name", "reason", "message_part"),
    [
        ("sim.fail", "BackoffLimitExceeded", None),
        ("sim.slow", "DeadlineExceeded", None),
        ("sim.notjson", "ResultNotJson", "this is not JSON"),
    ],
)
@ON_BOTH
def test_a_failed_job_gives_worker_failed_with_its_reason(rt, notified, capability_name, reason, message_part):
    dispatch_id = schedule(rt, capability_name)
    assert create_job_for(rt, dispatch_id) is CreateOutcome.CREATED
    job_finished(rt, dispatch_id)
    assert complete_job(rt, rt.settings.namespace, job_name(dispatch_id)) is CompleteOutcome.COMPLETED
    [(event_type, payload)] = events(rt, dispatch_id)[1:]
    assert event_type == EventType.WORKER_FAILED
    assert payload["reason"] == reason
    if message_part:
        assert message_part in payload["message"]
    record = load_record(rt, dispatch_id)
    assert record.state is DispatchState.FAILED
    assert notified.ids == [dispatch_id]
    wait_until(lambda: not job_exists(rt, dispatch_id), what="job deleted", timeout=10.0)


def test_a_capability_gone_from_the_config_fails_the_dispatch_at_create(make_runtime, notified):
    before = make_runtime(notifier=notified)
    dispatch_id = schedule(before, "sim.ok")
    after = make_runtime(notifier=notified, capabilities={"capabilities": {"sim.other": capability()}})
    assert create_job_for(after, dispatch_id) is CreateOutcome.FAILED
    [(event_type, payload)] = events(after, dispatch_id)[1:]
    assert (event_type, payload["reason"]) == (EventType.WORKER_FAILED, "UnknownCapability")
    assert "sim.ok" in payload["message"]
    assert not job_exists(after, dispatch_id)
    assert notified.ids == [dispatch_id]


def test_a_job_the_api_refuses_fails_the_dispatch_with_the_apis_reason(cluster, make_runtime, notified):
    """A 4xx from the API is permanent: WORKER_FAILED with its reason and message, no retry."""
    doomed = f"doomed-{uuid.uuid4().hex[:6]}"
    rt = make_runtime(notifier=notified, capabilities={"capabilities": {"sim.doomed": capability(namespace=doomed)}})
    # A namespace being deleted (held by a Job with someone else's finalizer) takes no new Job: 403.
    rt.kube.create_job(doomed, {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": "holder", "finalizers": ["other.example/hold"]},
        "spec": {"template": {"metadata": {"annotations": {SIM + "outcome": "hang"}},
                              "spec": {"restartPolicy": "Never", "containers": [{"name": "w", "image": "x"}]}}},
    })  # fmt: skip
    api = kubernetes.config.new_client_from_config(config_file=str(cluster.kubeconfig))
    try:
        kubernetes.client.CoreV1Api(api).delete_namespace(doomed)
    finally:
        api.close()

    dispatch_id = schedule(rt, "sim.doomed")
    assert create_job_for(rt, dispatch_id) is CreateOutcome.FAILED
    [(event_type, payload)] = events(rt, dispatch_id)[1:]
    assert (event_type, payload["reason"]) == (EventType.WORKER_FAILED, "Forbidden")
    assert "being terminated" in payload["message"]
    assert notified.ids == [dispatch_id]
    rt.kube.remove_finalizer(doomed, "holder", "other.example/hold")


def test_unknown_and_invalid_dispatch_ids_are_typed_errors(rt):
    with pytest.raises(UnknownDispatch):
        create_job_for(rt, str(uuid.uuid4()))
    with pytest.raises(InvalidId):
        create_job_for(rt, "not-a-uuid")
    with pytest.raises(UnknownDispatch):
        cancel_dispatch(rt, str(uuid.uuid4()))
    with pytest.raises(InvalidId):
        cancel_dispatch(rt, "../etc")


# --- refusals: a Job is delivered only if it agrees with the DB -------------------------------


@ON_BOTH
def test_a_job_whose_tenancy_disagrees_with_the_db_is_never_delivered(rt, notified):
    dispatch_id = schedule(rt, "sim.ok")
    record = load_record(rt, dispatch_id)
    forged = DispatchRef(**{**record.ref.__dict__, "tenancy_id": "tenant-evil"})
    name = forge_job(rt.kube, rt.settings.namespace, forged, deployment=rt.settings.effective_deployment)
    job_finished(rt, dispatch_id)
    refused_before = rt.stats.get(stats.JOBS_REFUSED)

    assert complete_job(rt, rt.settings.namespace, name) is CompleteOutcome.REFUSED
    assert events(rt, dispatch_id)[1:] == []  # nothing delivered
    assert load_record(rt, dispatch_id).state is DispatchState.SCHEDULED
    assert rt.stats.get(stats.JOBS_REFUSED) == refused_before + 1
    assert notified.ids == []
    assert job_exists(rt, dispatch_id)  # left for the sweep's orphan policy

    # Our own create meets the forged Job under the dispatch's name and refuses to adopt it.
    assert create_job_for(rt, dispatch_id) is CreateOutcome.FAILED
    [(event_type, payload)] = events(rt, dispatch_id)[1:]
    assert (event_type, payload["reason"]) == (EventType.WORKER_FAILED, "LabelMismatch")
    assert "tenant-evil" in payload["message"]
    cleanup_job(rt, rt.settings.namespace, name)


def test_a_job_naming_a_dispatch_that_does_not_exist_is_never_delivered(rt):
    ref = DispatchRef(
        dispatch_id=str(uuid.uuid4()),
        case_id="c",
        tenancy_id="t",
        capability="sim.ok",
        worker_name="sim",
        idempotency_key="k",
    )
    name = forge_job(rt.kube, rt.settings.namespace, ref, deployment=rt.settings.effective_deployment)
    wait_until(
        lambda: job_state(rt.kube.get_job(rt.settings.namespace, name)).terminal, what="forged job done", timeout=10.0
    )
    assert complete_job(rt, rt.settings.namespace, name) is CompleteOutcome.REFUSED
    with transaction(rt.sessions) as session:
        assert dispatches.get_dispatch(session, ref.dispatch_id) is None
        assert dispatches.events_for(session, ref.dispatch_id) == []
    cleanup_job(rt, rt.settings.namespace, name)


def test_a_copy_of_the_job_in_another_namespace_is_never_delivered(rt):
    dispatch_id = schedule(rt, "sim.ok")
    assert create_job_for(rt, dispatch_id) is CreateOutcome.CREATED
    copy_namespace = rt.settings.namespace + "-copy"
    name = forge_job(
        rt.kube, copy_namespace, load_record(rt, dispatch_id).ref, deployment=rt.settings.effective_deployment
    )
    wait_until(lambda: job_state(rt.kube.get_job(copy_namespace, name)).terminal, what="copy done", timeout=10.0)
    assert complete_job(rt, copy_namespace, name) is CompleteOutcome.REFUSED
    assert events(rt, dispatch_id)[1:] == []
    cleanup_job(rt, copy_namespace, name)
    job_finished(rt, dispatch_id)
    assert complete_job(rt, rt.settings.namespace, job_name(dispatch_id)) is CompleteOutcome.COMPLETED


# --- the guard and the unique terminal event ---------------------------------------------------


def test_a_completion_claimed_by_another_replica_is_left_to_it(rt):
    dispatch_id = schedule(rt, "sim.ok")
    create_job_for(rt, dispatch_id)
    job_finished(rt, dispatch_id)
    other = rt.guard.claim(dispatch_id)  # another replica is delivering it
    assert complete_job(rt, rt.settings.namespace, job_name(dispatch_id)) is CompleteOutcome.CLAIMED_ELSEWHERE
    assert events(rt, dispatch_id)[1:] == []
    assert rt.guard.duplicates_prevented() >= 1
    rt.guard.release(other)
    assert complete_job(rt, rt.settings.namespace, job_name(dispatch_id)) is CompleteOutcome.COMPLETED


def test_concurrent_completions_and_cancels_leave_exactly_one_terminal_event(make_runtime):
    replicas = [make_runtime(notifier=Notified()) for _ in range(3)]
    rt = replicas[0]
    ids = [schedule(rt, "sim.ok", {"i": i}) for i in range(12)]
    for dispatch_id in ids:
        create_job_for(rt, dispatch_id)
    for dispatch_id in ids:
        job_finished(rt, dispatch_id)

    errors: list[BaseException] = []
    barrier = threading.Barrier(len(replicas) * 2)

    def run(target: Callable[[], object]) -> None:
        barrier.wait()
        try:
            target()
        except BaseException as e:
            errors.append(e)

    def complete_all(r: Runtime) -> None:
        for dispatch_id in ids:
            complete_job(r, r.settings.namespace, job_name(dispatch_id))

    def cancel_half(r: Runtime) -> None:
        for dispatch_id in ids[::2]:
            cancel_dispatch(r, dispatch_id)

    threads = [threading.Thread(target=run, args=(lambda r=r: complete_all(r),)) for r in replicas]
    threads += [threading.Thread(target=run, args=(lambda r=r: cancel_half(r),)) for r in replicas]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []

    notified_ids = [i for r in replicas for i in r.notifier.ids]
    for dispatch_id in ids:
        terminal = [t for t, _ in events(rt, dispatch_id) if t != EventType.WORKER_SCHEDULED]
        assert len(terminal) == 1, (dispatch_id, terminal)
        assert terminal[0] in (EventType.WORKER_COMPLETED, EventType.WORKER_CANCELLED)
        assert notified_ids.count(dispatch_id) == 1
        assert not job_exists(rt, dispatch_id)
    # The odd ones were never cancelled: they completed.
    assert all(events(rt, d)[-1][0] == EventType.WORKER_COMPLETED for d in ids[1::2])


# --- cancel -------------------------------------------------------------------------------------


@ON_BOTH
def test_cancel_a_running_dispatch_records_cancelled_and_removes_its_job(rt, notified):
    dispatch_id = schedule(rt, "sim.hang")
    create_job_for(rt, dispatch_id)
    # Running: its Pod made. (One the Job controller makes after the cancel let the Pods go is the
    # sweep's to free, as an ended dispatch's: tests/recovery/test_sweep.py.)
    wait_until(lambda: pods_of(rt, dispatch_id), what="its pod created", timeout=30.0)
    assert cancel_dispatch(rt, dispatch_id, reason="UserCancelled") is True
    assert events(rt, dispatch_id)[1:] == [(EventType.WORKER_CANCELLED, {"reason": "UserCancelled"})]
    assert load_record(rt, dispatch_id).state is DispatchState.CANCELLED
    wait_until(lambda: not job_exists(rt, dispatch_id), what="job deleted", timeout=10.0)
    wait_until(lambda: not pods_of(rt, dispatch_id), what="its running pod freed and deleted", timeout=30.0)
    assert notified.ids == [dispatch_id]
    # A second cancel, and a late completion, change nothing.
    assert cancel_dispatch(rt, dispatch_id) is False
    assert complete_job(rt, rt.settings.namespace, job_name(dispatch_id)) is CompleteOutcome.GONE
    assert len(events(rt, dispatch_id)) == 2 and notified.ids == [dispatch_id]


def test_cancel_before_the_job_exists_means_it_is_never_created(rt):
    dispatch_id = schedule(rt, "sim.ok")
    assert cancel_dispatch(rt, dispatch_id) is True
    assert create_job_for(rt, dispatch_id) is CreateOutcome.SKIPPED
    assert not job_exists(rt, dispatch_id)


def test_cancel_of_a_finished_dispatch_is_a_no_op(rt, notified):
    dispatch_id = schedule(rt, "sim.ok")
    create_job_for(rt, dispatch_id)
    job_finished(rt, dispatch_id)
    complete_job(rt, rt.settings.namespace, job_name(dispatch_id))
    assert cancel_dispatch(rt, dispatch_id) is False
    assert [t for t, _ in events(rt, dispatch_id)] == [EventType.WORKER_SCHEDULED, EventType.WORKER_COMPLETED]


# --- notification: at least once, even when the broker is down -----------------------------------


def test_a_failed_notification_leaves_the_dispatch_for_the_sweep_to_notify(rt, notified):
    dispatch_id = schedule(rt, "sim.ok")
    create_job_for(rt, dispatch_id)
    job_finished(rt, dispatch_id)
    notified.fail = True
    assert complete_job(rt, rt.settings.namespace, job_name(dispatch_id)) is CompleteOutcome.COMPLETED
    assert notified_at(rt, dispatch_id) is None
    wait_until(lambda: not job_exists(rt, dispatch_id), what="job deleted", timeout=10.0)  # clean-up went on
    with transaction(rt.sessions) as session:
        assert dispatch_id in {d.dispatch_id for d in dispatches.iter_unnotified_terminal(session)}

    notified.fail = False
    assert notify_engine(rt, dispatch_id) is True
    assert notified.ids == [dispatch_id]
    assert notified_at(rt, dispatch_id) is not None
    with transaction(rt.sessions) as session:
        assert dispatch_id not in {d.dispatch_id for d in dispatches.iter_unnotified_terminal(session)}
        assert dispatches.mark_notified(session, dispatch_id) is False  # once only


def test_without_a_notifier_the_dispatch_stays_unnotified(make_runtime):
    rt = make_runtime(notifier=None)
    dispatch_id = schedule(rt, "sim.ok")
    create_job_for(rt, dispatch_id)
    job_finished(rt, dispatch_id)
    assert complete_job(rt, rt.settings.namespace, job_name(dispatch_id)) is CompleteOutcome.COMPLETED
    assert notify_engine(rt, dispatch_id) is False
    assert notified_at(rt, dispatch_id) is None


def test_a_batch_of_creates_deals_with_each_dispatch_as_alone_and_marks_them_together(make_runtime, notified):
    gone = {"capabilities": {**CAPABILITIES["capabilities"], "sim.gone": capability()}}
    before = make_runtime(notifier=notified, capabilities=gone)
    rt = make_runtime(notifier=notified)  # the same namespace and database; sim.gone removed
    good, existing, bad, ended = (schedule(before, c) for c in ("sim.hang", "sim.hang", "sim.gone", "sim.hang"))
    assert create_job_for(rt, existing) is CreateOutcome.CREATED  # a first message got through
    cancel_dispatch(rt, ended)
    unknown = str(uuid.uuid4())

    outcomes = create_jobs_for(rt, [good, existing, unknown, bad, ended, good])
    assert outcomes == {
        good: CreateOutcome.CREATED,
        existing: CreateOutcome.ADOPTED,
        bad: CreateOutcome.FAILED,
        ended: CreateOutcome.SKIPPED,
    }
    states = {d: load_record(rt, d).state for d in outcomes}
    assert states == {
        good: DispatchState.CREATED,
        existing: DispatchState.CREATED,
        bad: DispatchState.FAILED,
        ended: DispatchState.CANCELLED,
    }
    assert load_record(rt, good).job_name == job_name(good)
    assert [job_exists(rt, d) for d in (good, existing, bad, ended)] == [True, True, False, False]
    assert events(rt, bad)[1][1]["reason"] == "UnknownCapability"
    assert sorted(notified.ids) == sorted([ended, bad])
    with pytest.raises(InvalidId):
        create_jobs_for(rt, [good, "not-a-uuid"])
    for dispatch_id in (good, existing):
        cancel_dispatch(rt, dispatch_id)


def test_a_transient_error_mid_batch_keeps_the_jobs_created_before_it_and_the_retry_adopts_them(make_runtime):
    """The API fails 30% of requests (before acting on them): a batch stops at its first failed
    create, with every Job created before it already marked; the whole batch again adopts those."""
    with LocalCluster(mode="simulate", fault_rate=0.3) as flaky:
        rt = make_runtime(kubeconfig=flaky.kubeconfig)
        for _ in range(30):  # until a fault comes after at least one Job was created
            ids = [schedule(rt, "sim.hang") for _ in range(10)]
            try:
                create_jobs_for(rt, ids)
            except ApiUnavailable:
                marked = [d for d in ids if load_record(rt, d).state is DispatchState.CREATED]
                if marked:
                    break
        else:
            pytest.fail("no batch stopped after creating a Job")
        flaky.set_faults(0.0, 0)
        pages = rt.kube.iter_jobs(rt.settings.namespace, label_selector=job_labels.selector())
        jobs = {j["metadata"]["name"] for page in pages for j in page}
        assert {job_name(d) for d in ids} & jobs == {job_name(d) for d in marked}, "created = marked"
        outcomes = create_jobs_for(rt, ids)
        assert {d for d, o in outcomes.items() if o is CreateOutcome.ADOPTED} >= set(marked)
        assert all(load_record(rt, d).state is DispatchState.CREATED for d in ids)


def test_a_release_failing_mid_batch_keeps_the_outcomes_before_it_and_the_retries_release_every_job_once(
    make_runtime, notified
):
    """A batch's releases run a few Jobs at a time; with 30% of the API's requests failing,
    each call returns the outcomes up to its first failure and leaves the rest for the retry,
    which releases them (again, for those done out of order): one terminal event each, and
    no finalizer of ours left on a Job or a Pod."""
    with LocalCluster(mode="simulate") as flaky:
        rt = make_runtime(notifier=notified, kubeconfig=flaky.kubeconfig)
        ids = [schedule(rt, "sim.ok", {"i": i}) for i in range(12)]
        for dispatch_id in ids:
            assert create_job_for(rt, dispatch_id) is CreateOutcome.CREATED
        for dispatch_id in ids:
            job_finished(rt, dispatch_id)
        left = listed_finished(rt)
        assert len(left) == len(ids)
        flaky.set_faults(0.3, 0)
        stopped_midway = False
        for _ in range(100):
            done = complete_jobs(rt, rt.settings.namespace, left, delete=False)
            assert done.unavailable == list(left[len(done.outcomes) :])  # a prefix done, the rest to retry
            if done.error is None:
                break
            stopped_midway |= bool(done.outcomes)
            left = done.unavailable
        else:
            pytest.fail("the batch never got through")
        flaky.set_faults(0.0, 0)
        assert stopped_midway, "no call stopped after delivering some of its Jobs"
        assert all(len(events(rt, d)) == 2 for d in ids)  # scheduled, then exactly one terminal event
        assert sorted(notified.ids) == sorted(ids)
        names = {job_name(d) for d in ids}
        pages = rt.kube.iter_jobs(rt.settings.namespace, label_selector=job_labels.selector())
        jobs = [j for page in pages for j in page if j["metadata"]["name"] in names]
        assert len(jobs) == len(ids) and not any(FINALIZER in (j["metadata"].get("finalizers") or []) for j in jobs)
        pods = rt.kube.list_pods(
            rt.settings.namespace, label_selector=f"{JOB_NAME_LABEL} in ({','.join(sorted(names))})"
        )
        assert len(pods) == len(ids) and not any(FINALIZER in (p["metadata"].get("finalizers") or []) for p in pods)
