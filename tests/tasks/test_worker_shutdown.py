"""A stopping worker's last pass (delivery/shutdown.py), with a real `celery worker` process given
SIGTERM, on localcluster and on the real control plane (kube-apiserver's Eviction API, the real Job
controller, our node agent). No beat runs: nothing but the last pass reads the Pods.

A Pod evicted while it ran, being deleted and held by our finalizer when the worker is told to stop:
its disruption is recorded once and the Pod let go; the Job's next Pod then completes the dispatch
once (no attempt spent). A finished Job's Pod being deleted: its result is recorded once, before our
finalizer comes off. A running map's finished Pod: its item is recorded, then it is let go. Let go at
once, holding nothing wanted: the Pod of a dispatch that has ended, and a failed Pod its Job runs
again. The pure part (which Pods, how long, which failure may end its Job) by table.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest
from kubernetes import client

from k8s_dispatch import api
from k8s_dispatch import celeryconfig as names
from k8s_dispatch.delivery import shutdown, terminal
from k8s_dispatch.store import dispatches
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import EventType
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.manifest import FINALIZER, job_name
from k8s_dispatch.workers.resolver import CapabilityResolver
from k8s_dispatch.workers.types import DispatchRef

SIM = "localcluster.k8s-dispatch.io/"
CAPABILITIES = {
    # Its first Pod evicted 200 ms into its run (the Eviction API), its second runs to the end.
    "sim.evicted": {
        "worker": "sim", "image": "sim:1", "backoffLimit": 0,
        "annotations": {SIM + "duration-ms": "1500", SIM + "evict-attempts": "1", SIM + "evict-after-ms": "200"},
    },
    "sim.quick": {"worker": "sim", "image": "sim:1", "annotations": {SIM + "result": '{"v": 1}'}},
    # Runs 2 minutes; a Pod of it that fails (deleted) is run again: its Job runs on.
    "sim.long": {"worker": "sim", "image": "sim:1", "backoffLimit": 3, "annotations": {SIM + "duration-ms": "120000"}},
    # Each Pod fails (exit 1) after 3 s; the Job runs it again 20 times, minutes in all.
    "sim.retried": {
        "worker": "sim", "image": "sim:1", "backoffLimit": 20,
        "annotations": {SIM + "duration-ms": "3000", SIM + "outcome": "fail"},
    },
    # A map of 3 items: item 0's Pod returns {"i": 0} at once, the others run on.
    "sim.map": {
        "worker": "sim", "image": "sim:1", "backoffLimit": 0,
        "annotations": {
            SIM + "duration-ms": "120000",
            SIM + "by-index": json.dumps({"0": {"duration-ms": "200", "result": {"i": 0}}}),
        },
    },
}  # fmt: skip


def _story(d: Any, dispatch_id: str) -> list[tuple[str, dict[str, Any]]]:
    with transaction(d.sessions) as session:
        return [(e.type, e.payload) for e in dispatches.events_for(session, dispatch_id)]


def _pods(d: Any, dispatch_id: str) -> list[dict[str, Any]]:
    return d.kube.list_pods(d.namespace, label_selector=f"batch.kubernetes.io/job-name={job_name(dispatch_id)}")


def _held(d: Any, dispatch_id: str, phase: str) -> list[dict[str, Any]]:
    """The dispatch's Pods being deleted, ended in `phase`, that our finalizer keeps."""
    return [
        p
        for p in _pods(d, dispatch_id)
        if p["metadata"].get("deletionTimestamp")
        and FINALIZER in p["metadata"].get("finalizers", [])
        and p["status"].get("phase") == phase
    ]


def test_an_evicted_pod_is_recorded_once_and_let_go_by_the_stopping_worker(deploy, any_cluster):
    d = deploy(any_cluster, capabilities=CAPABILITIES)
    worker = d.start_worker("w1")
    [dispatch_id] = d.schedule_batch("sim.evicted", 1)
    [evicted] = d.wait(lambda: _held(d, dispatch_id, "Failed"), timeout_s=60, what="the evicted Pod held")
    assert [t for t, _ in _story(d, dispatch_id)] == [EventType.WORKER_SCHEDULED]  # no beat: nobody read it

    assert worker.stop() == 0
    uid = evicted["metadata"]["uid"]
    assert uid not in {p["metadata"]["uid"] for p in _pods(d, dispatch_id)}  # let go before the worker exited
    story = _story(d, dispatch_id)
    assert [t for t, _ in story] == [EventType.WORKER_SCHEDULED, EventType.WORKER_DISRUPTED]
    assert (story[1][1]["pod_uid"], story[1][1]["reason"]) == (uid, "EvictionByEvictionAPI")
    assert "last pass: 1 pod(s) of ours were being deleted: 1 disrupted" in worker.log()

    # The Job's next Pod runs (no attempt spent); a worker and beat deliver it, once.
    d.start_worker("w2")
    d.start_beat()
    events = d.wait_terminal([dispatch_id], timeout_s=90 if any_cluster.is_real else 40)
    assert [t for t, _ in events[dispatch_id]] == [EventType.WORKER_COMPLETED]
    assert [t for t, _ in _story(d, dispatch_id)] == [
        EventType.WORKER_SCHEDULED, EventType.WORKER_DISRUPTED, EventType.WORKER_COMPLETED,
    ]  # fmt: skip
    assert d.wait_notified([dispatch_id]) == [dispatch_id]
    d.wait_no_jobs()


def test_a_finished_jobs_pod_being_deleted_has_its_result_recorded_once_by_the_stopping_worker(deploy, any_cluster):
    d = deploy(any_cluster, capabilities=CAPABILITIES)
    worker = d.start_worker("w1")
    [dispatch_id] = d.schedule_batch("sim.quick", 1)
    [pod] = d.wait(lambda: [p for p in _pods(d, dispatch_id) if p["status"].get("phase") == "Succeeded"], timeout_s=60)
    with any_cluster.api_client() as api:  # as a drain, PodGC or a person would
        client.CoreV1Api(api).delete_namespaced_pod(pod["metadata"]["name"], d.namespace)
    d.wait(lambda: _held(d, dispatch_id, "Succeeded"), timeout_s=30, what="the finished Pod held")

    assert worker.stop() == 0
    assert _pods(d, dispatch_id) == []  # let go once its result was recorded
    assert d.terminal_events([dispatch_id]) == {dispatch_id: [(EventType.WORKER_COMPLETED, {"output": {"v": 1}})]}
    assert d.notifications() == [dispatch_id]
    d.wait(lambda: not d.kube.list_pods(d.namespace, label_selector=job_labels.selector()), what="no Pod left")
    d.wait_no_jobs()


def _still_held(d: Any, uid: str) -> bool:
    return any(
        p["metadata"]["uid"] == uid and FINALIZER in p["metadata"].get("finalizers", [])
        for p in d.kube.list_pods(d.namespace, label_selector=job_labels.selector())
    )


def _delete(any_cluster: Any, d: Any, pod: dict[str, Any]) -> None:
    with any_cluster.api_client() as api_client:  # as a drain, PodGC or a person would
        client.CoreV1Api(api_client).delete_namespaced_pod(pod["metadata"]["name"], d.namespace)
    d.wait(lambda: _deleting(d, pod), timeout_s=30, what=f"{pod['metadata']['name']} held being deleted")


def _deleting(d: Any, pod: dict[str, Any]) -> bool:
    return any(
        p["metadata"]["uid"] == pod["metadata"]["uid"] and p["metadata"].get("deletionTimestamp")
        for p in d.kube.list_pods(d.namespace, label_selector=job_labels.selector())
    )


def _stop(worker: Any) -> float:
    """Stop the worker (it exits 0); how long that took."""
    started = time.monotonic()
    assert worker.stop() == 0
    return time.monotonic() - started


def _cancel_and_clear(d: Any, dispatch_id: str) -> None:
    """Leave nothing running: a worker's cancel task removes the Job (already cancelled or not)."""
    d.start_worker("w2")
    d.send(names.CANCEL_TASK, dispatch_id)
    d.wait_no_jobs(timeout_s=60)


def test_a_pod_of_a_dispatch_that_has_ended_is_let_go_at_once_by_the_stopping_worker(deploy, any_cluster):
    d = deploy(any_cluster, capabilities=CAPABILITIES)
    worker = d.start_worker("w1")
    [dispatch_id] = d.schedule_batch("sim.long", 1)
    [pod] = d.wait(lambda: [p for p in _pods(d, dispatch_id) if p["status"].get("phase") == "Running"], timeout_s=60)
    with transaction(d.sessions) as session:  # an engine's cancel whose message a broker flush lost
        event = dispatches.TerminalEvent(dispatch_id, EventType.WORKER_CANCELLED, {"reason": "Cancelled"})
        assert terminal.record(session, [event]) == {dispatch_id}
    _delete(any_cluster, d, pod)  # its grace period is 30 s: waiting for it would hold the stop 45 s

    took = _stop(worker)
    assert not _still_held(d, pod["metadata"]["uid"])  # let go: nothing it holds is wanted
    assert "0 finished delivered, 1 of ended dispatches and 0 retried let go, 0 left" in worker.log(), took
    assert [t for t, _ in _story(d, dispatch_id)] == [EventType.WORKER_SCHEDULED, EventType.WORKER_CANCELLED]
    _cancel_and_clear(d, dispatch_id)


def test_a_running_maps_finished_pod_has_its_item_recorded_and_is_let_go_by_the_stopping_worker(deploy, any_cluster):
    d = deploy(any_cluster, capabilities=CAPABILITIES)
    worker = d.start_worker("w1")
    with transaction(d.sessions) as session:
        case_id = f"case-{uuid.uuid4().hex[:10]}"
        api.create_case(session, case_id=case_id, tenancy_id="tenant-a")
        map_id = api.schedule_map_in_session(
            session, case_id=case_id, tenancy_id="tenant-a", capability="sim.map",
            items=[{"n": i} for i in range(3)], idempotency_key=f"map-{uuid.uuid4().hex}",
            router=CapabilityResolver.from_settings(d.settings), max_input_bytes=d.settings.max_input_bytes,
            via=d.producer, parallelism=3,
        ).dispatch_id  # fmt: skip
    [pod] = d.wait(
        lambda: [
            p
            for p in _pods(d, map_id)
            if p["metadata"]["labels"].get("batch.kubernetes.io/job-completion-index") == "0"
            and p["status"].get("phase") == "Succeeded"
        ],
        timeout_s=60,
        what="item 0's Pod finished",
    )
    with transaction(d.sessions) as session:
        assert api.item_outcomes(session, map_id) == []  # no beat: nobody read it
    _delete(any_cluster, d, pod)

    _stop(worker)
    assert not _still_held(d, pod["metadata"]["uid"])  # let go once its item was recorded
    with transaction(d.sessions) as session:
        outcomes = api.item_outcomes(session, map_id)
    assert [(o.index, o.event, o.payload) for o in outcomes] == [
        (0, api.ItemEventType.ITEM_COMPLETED, {"item": 0, "output": {"i": 0}})
    ]
    assert not d.all_terminal([map_id])  # the map runs on
    assert "1 finished delivered" in worker.log()
    _cancel_and_clear(d, map_id)


def test_a_failed_pod_its_job_runs_again_is_let_go_by_the_stopping_worker(deploy, any_cluster):
    d = deploy(any_cluster, capabilities=CAPABILITIES)
    worker = d.start_worker("w1")
    [dispatch_id] = d.schedule_batch("sim.retried", 1)
    failed = d.wait(
        lambda: [p for p in _pods(d, dispatch_id) if p["status"].get("phase") == "Failed"],
        timeout_s=60,
        what="the first Pod failed",
    )[0]
    _delete(any_cluster, d, failed)

    _stop(worker)
    assert not _still_held(d, failed["metadata"]["uid"])  # the Job's end is told by a later Pod
    assert "1 retried let go, 0 left" in worker.log()
    assert [t for t, _ in _story(d, dispatch_id)] == [EventType.WORKER_SCHEDULED]  # nothing recorded for it
    _cancel_and_clear(d, dispatch_id)


# --- the pure part ----------------------------------------------------------------------------


def _pod(
    name: str,
    *,
    deleting: bool = True,
    ours: bool = True,
    phase: str = "Running",
    evicted: bool = False,
    grace: int | None = 30,
    exit_code: int | None = None,
    dispatch: DispatchRef | None = None,
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "uid": f"uid-{name}", "labels": {"batch.kubernetes.io/job-name": "j"}}
    metadata["ownerReferences"] = [{"kind": "Job", "name": "j", "uid": "job-uid", "controller": True}]
    if dispatch is not None:
        labels, annotations = job_labels.encode(dispatch, deployment="d")
        metadata["labels"] |= labels
        metadata["annotations"] = annotations
    if deleting:
        metadata["deletionTimestamp"] = "2026-12-02T14:00:00Z"
        metadata["deletionGracePeriodSeconds"] = grace
    if ours:
        metadata["finalizers"] = ["batch.kubernetes.io/job-tracking", FINALIZER]
    status: dict[str, Any] = {"phase": phase}
    if evicted:
        status["conditions"] = [{"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}]
    if exit_code is not None:
        status["containerStatuses"] = [{"name": "worker", "state": {"terminated": {"exitCode": exit_code}}}]
    return {"metadata": metadata, "status": status}


@pytest.mark.parametrize(
    ("pod", "sorted_as"),
    [
        (_pod("a", deleting=False), None),  # running on: none of the pass's business
        (_pod("b", ours=False), None),  # our finalizer already off: nothing to let go
        (_pod("c"), "running"),  # being deleted, not ended: waited for
        (_pod("d", phase="Pending"), "running"),
        (_pod("e", phase="Failed", evicted=True), "disrupted"),
        (_pod("f", phase="Succeeded", evicted=True), "finished"),  # its result counts, not the eviction
        (_pod("g", phase="Failed"), "finished"),  # a failure: its Job says what it comes to
        (_pod("h", phase="Succeeded"), "finished"),
    ],
)
def test_which_pods_the_last_pass_takes_and_how(pod: dict[str, Any], sorted_as: str | None) -> None:
    found = shutdown.leaving([pod])
    kinds = {"disrupted": found.disrupted, "finished": [p for ps in found.finished.values() for p in ps],
             "running": found.running}  # fmt: skip
    assert {k for k, pods in kinds.items() if pods} == ({sorted_as} if sorted_as else set())
    if sorted_as == "finished":
        assert list(found.finished) == ["j"]


@pytest.mark.parametrize(
    ("grace", "waited"), [(30, 30 + shutdown.SETTLE_S), (0, shutdown.SETTLE_S), (None, shutdown.SETTLE_S)]
)
def test_a_pod_is_waited_for_its_grace_period_and_the_settling_time(grace: int | None, waited: float) -> None:
    assert shutdown.waited_s(_pod("a", grace=grace)) == waited


def _ref(dispatch_id: str, tenancy: str = "tenant-a") -> DispatchRef:
    from k8s_dispatch.workers.types import CapabilityName, CaseId, DispatchId, IdempotencyKey, TenancyId, WorkerName

    return DispatchRef(
        DispatchId(dispatch_id), CaseId("case-1"), TenancyId(tenancy), CapabilityName("sim.quick"),
        WorkerName("sim"), IdempotencyKey("key-1"),
    )  # fmt: skip


ENDED_ID, RUNNING_ID = str(uuid.UUID(int=1)), str(uuid.UUID(int=2))


@pytest.mark.parametrize(
    ("pod", "sorted_as"),
    [
        (_pod("a", dispatch=_ref(ENDED_ID)), "ended"),  # running, its dispatch ended: let go at once
        (_pod("b", phase="Failed", evicted=True, dispatch=_ref(ENDED_ID)), "ended"),  # nothing to record either
        (_pod("c", phase="Succeeded", dispatch=_ref(ENDED_ID)), "ended"),
        (_pod("d", dispatch=_ref(RUNNING_ID)), "running"),  # its dispatch runs on
        (_pod("e", dispatch=_ref(ENDED_ID, tenancy="tenant-b")), "running"),  # labels disagree with the row
        (_pod("f", deleting=False, dispatch=_ref(ENDED_ID)), None),  # not being deleted: not the pass's
        (_pod("g", ours=False, dispatch=_ref(ENDED_ID)), None),
    ],
)
def test_the_pods_of_dispatches_that_have_ended_are_let_go(pod: dict[str, Any], sorted_as: str | None) -> None:
    found = shutdown.leaving([pod], ended={_ref(ENDED_ID)})
    kinds = {"ended": found.ended, "disrupted": found.disrupted, "running": found.running,
             "finished": [p for ps in found.finished.values() for p in ps]}  # fmt: skip
    assert {k for k, pods in kinds.items() if pods} == ({sorted_as} if sorted_as else set())


def _job(*, failed: int = 0, uncounted: int = 0, limit: int | None = 3, rules: list[Any] | None = None) -> Any:
    spec: dict[str, Any] = {"podFailurePolicy": {"rules": rules if rules is not None else POLICY}}
    if limit is not None:
        spec["backoffLimit"] = limit
    status: dict[str, Any] = {"failed": failed, "uncountedTerminatedPods": {"failed": ["x"] * uncounted}}
    return {"metadata": {"name": "j", "uid": "job-uid"}, "spec": spec, "status": status}


POLICY = [  # as workers.failure_policy makes it for failOnExitCodes [2] and retryOnExitCodes [3]
    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
    {"action": "FailJob", "onExitCodes": {"containerName": "worker", "operator": "In", "values": [2]}},
    {"action": "Count", "onExitCodes": {"containerName": "worker", "operator": "In", "values": [3]}},
]
FAILED = _pod("p", phase="Failed", exit_code=1)


@pytest.mark.parametrize(
    ("job", "pod", "may_end"),
    [
        (_job(failed=0), FAILED, False),  # not counted yet: 1 failure of 3 allowed, it runs again
        (_job(failed=1), FAILED, False),  # counted: 1 of 3
        (_job(failed=1, uncounted=1), FAILED, False),  # 2 of 3: the Job runs it again
        (_job(failed=2, uncounted=1), FAILED, True),  # 3 of 3: the next failure ends it, this may be it
        (_job(failed=4), FAILED, True),  # over the limit: the Job ends on it
        (_job(limit=0), FAILED, True),  # no backoff at all: its first failure ends it
        (_job(limit=None, failed=5), FAILED, False),  # the API's default, 6
        (_job(limit=None, failed=6), FAILED, True),
        (_job(), _pod("p", phase="Failed", exit_code=2), True),  # FailJob: ends the Job at once
        (_job(), _pod("p", phase="Failed", exit_code=3), False),  # Count, with backoff left
        (_job(failed=3), _pod("p", phase="Failed", exit_code=3), True),  # Count, with none left
        (_job(failed=9), _pod("p", phase="Failed", exit_code=1, evicted=True), False),  # Ignored: never counted
        (_job(rules=[{"action": "FailJob", "onExitCodes": {"operator": "NotIn", "values": [1]}}]), FAILED, False),
        (_job(rules=[{"action": "FailJob", "onExitCodes": {"operator": "NotIn", "values": [5]}}]), FAILED, True),
        (_job(rules=[{"action": "SomethingNew", "onExitCodes": {"operator": "In", "values": [1]}}]), FAILED, True),
        ({**_job(), "metadata": {"name": "j", "uid": "another-uid"}}, FAILED, True),  # an earlier Job's Pod
    ],
)
def test_a_failed_pod_is_waited_for_only_while_its_job_may_end_on_it(job: Any, pod: Any, may_end: bool) -> None:
    assert shutdown.may_end_job(job, pod) is may_end
