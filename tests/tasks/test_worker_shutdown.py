"""A stopping worker's last pass (delivery/shutdown.py), with a real `celery worker` process given
SIGTERM, on localcluster and on the real control plane (kube-apiserver's Eviction API, the real Job
controller, our node agent). No beat runs: nothing but the last pass reads the Pods.

A Pod evicted while it ran, being deleted and held by our finalizer when the worker is told to stop:
its disruption is recorded once and the Pod let go; the Job's next Pod then completes the dispatch
once (no attempt spent). A finished Job's Pod being deleted: its result is recorded once, before our
finalizer comes off. The pure part (which Pods, how long) by table.
"""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client

from k8s_dispatch.delivery import shutdown
from k8s_dispatch.store import dispatches
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import EventType
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.manifest import FINALIZER, job_name

SIM = "localcluster.k8s-dispatch.io/"
CAPABILITIES = {
    # Its first Pod evicted 200 ms into its run (the Eviction API), its second runs to the end.
    "sim.evicted": {
        "worker": "sim", "image": "sim:1", "backoffLimit": 0,
        "annotations": {SIM + "duration-ms": "1500", SIM + "evict-attempts": "1", SIM + "evict-after-ms": "200"},
    },
    "sim.quick": {"worker": "sim", "image": "sim:1", "annotations": {SIM + "result": '{"v": 1}'}},
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
    assert d.notifications() == [dispatch_id]
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


# --- the pure part ----------------------------------------------------------------------------


def _pod(
    name: str,
    *,
    deleting: bool = True,
    ours: bool = True,
    phase: str = "Running",
    evicted: bool = False,
    grace: int | None = 30,
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "uid": f"uid-{name}", "labels": {"batch.kubernetes.io/job-name": "j"}}
    if deleting:
        metadata["deletionTimestamp"] = "2026-12-02T14:00:00Z"
        metadata["deletionGracePeriodSeconds"] = grace
    if ours:
        metadata["finalizers"] = ["batch.kubernetes.io/job-tracking", FINALIZER]
    status: dict[str, Any] = {"phase": phase}
    if evicted:
        status["conditions"] = [{"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}]
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
