"""Pods that will never run, end to end with real `celery -A k8s_dispatch.tasks worker|beat`
processes, PostgreSQL, Redis and each cluster (localcluster's kubelet, and the real control plane
with our node agent, both honouring localcluster's waiting-reason and unschedulable annotations):
each dispatch ends once, WORKER_FAILED with the real cause as reason and the kubelet's or the
scheduler's message, when its clock says (measured with the database's clock: from the row's
`job_created_at` to its `finished_at`), its Job deleted and no Pod left. A Job whose container
runs is never touched by these clocks. And the queue clock: a Job refused for quota waits, is
retried, and ends `QueueTimeout`.
"""

from __future__ import annotations

import time
import uuid
from datetime import timedelta
from typing import Any

import kubernetes

from k8s_dispatch import celeryconfig as names
from k8s_dispatch.demo.localcluster import startfaults
from k8s_dispatch.demo.localcluster.quota import QUOTA_JOBS
from k8s_dispatch.store import dispatches
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import DispatchState, EventType
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.manifest import FINALIZER, job_name
from k8s_dispatch.workers.pod_health import CHECK_GRACE

SIM = "localcluster.k8s-dispatch.io/"
SWEEP_S = 1.0
# What a sweep's round trips and a worker's turn may add on 2 cores shared with other test runs,
# beyond "the clock + one sweep interval".
SLACK_S = 4.0


def capability(**fields: Any) -> dict[str, Any]:
    annotations = fields.pop("annotations", {})
    return {
        "worker": "sim",
        "image": fields.pop("image", "registry.invalid/foo:1"),
        "annotations": {SIM + "outcome": "hang", **annotations},
        **fields,
    }


def deploy_started(deploy: Any, cluster: Any, capabilities: dict[str, Any]) -> Any:
    d = deploy(cluster, capabilities=capabilities, sweep_interval_s=str(SWEEP_S), sweep_grace_s="1")
    d.start_worker("w1")
    d.start_beat()
    return d


def ended(d: Any, dispatch_id: str, *, timeout_s: float) -> tuple[dict[str, Any], timedelta]:
    """The dispatch's one terminal event's payload (it must be WORKER_FAILED) and how long after
    its Job was recorded created it was written, both by the database's clock."""
    [(event, payload)] = d.wait_terminal([dispatch_id], timeout_s=timeout_s)[dispatch_id]
    assert event == EventType.WORKER_FAILED.value, payload
    with transaction(d.sessions) as session:
        row = dispatches.get_dispatch(session, dispatch_id)
        assert row is not None and row.state is DispatchState.FAILED
        assert row.job_created_at is not None and row.finished_at is not None
        return payload, row.finished_at - row.job_created_at


def assert_nothing_left(d: Any) -> None:
    """No Job of ours, and no Pod of ours holding our finalizer (the Pending ones were freed)."""
    d.wait_no_jobs(timeout_s=30)

    def held() -> list[str]:
        pods = d.kube.list_pods(d.namespace, label_selector=job_labels.selector())
        return [p["metadata"]["name"] for p in pods if FINALIZER in (p["metadata"].get("finalizers") or [])]

    d.wait(lambda: not held(), timeout_s=30, what="no Pod holding our finalizer")


def set_job_quota(d: Any, limit: int) -> None:
    """localcluster's namespace annotation that answers as a ResourceQuota `count/jobs.batch`."""
    api = kubernetes.config.new_client_from_config(config_file=str(d.cluster.kubeconfig))
    try:
        core = kubernetes.client.CoreV1Api(api)
        try:
            core.create_namespace({"metadata": {"name": d.namespace}})
        except kubernetes.client.ApiException as e:
            if e.status != 409:
                raise
        core.patch_namespace(d.namespace, {"metadata": {"annotations": {QUOTA_JOBS: str(limit)}}})
    finally:
        api.close()


def test_a_bad_image_ends_image_pull_back_off_within_its_timeout_and_one_sweep(deploy, any_cluster):
    pull_s = 4
    d = deploy_started(
        deploy,
        any_cluster,
        {
            "sim.pull": capability(
                imagePullTimeoutSeconds=pull_s, annotations={SIM + "waiting-reason": "ImagePullBackOff"}
            )
        },
    )
    [dispatch_id] = d.schedule_batch("sim.pull", 1)
    payload, took = ended(d, dispatch_id, timeout_s=pull_s + SWEEP_S + SLACK_S + 20)
    reason, message, detail = payload.pop("reason"), payload.pop("message"), payload.pop("detail")
    assert (
        payload == {} and reason == "ImagePullBackOff" and message == 'Back-off pulling image "registry.invalid/foo:1"'
    )
    # The detail names the Pod that waited (its name is the Job's and a suffix); no container ran.
    assert detail["pod"].startswith(job_name(dispatch_id) + "-") and "exit_code" not in detail, detail
    assert timedelta(seconds=pull_s) <= took <= timedelta(seconds=pull_s + SWEEP_S + SLACK_S), took
    d.wait_notified([dispatch_id])  # at least once: a sweep may notify it again before it is marked
    assert_nothing_left(d)


def test_an_invalid_image_name_fails_at_once_and_a_config_error_after_its_grace(deploy, any_cluster):
    config_s = 6
    d = deploy_started(
        deploy,
        any_cluster,
        {
            "sim.badname": capability(image="Foo:1", annotations={SIM + "waiting-reason": "InvalidImageName"}),
            "sim.nosecret": capability(
                configErrorTimeoutSeconds=config_s, annotations={SIM + "waiting-reason": "CreateContainerConfigError"}
            ),
        },
    )
    [bad_name] = d.schedule_batch("sim.badname", 1)
    [no_secret] = d.schedule_batch("sim.nosecret", 1)
    payload, took = ended(d, bad_name, timeout_s=60)
    assert payload["reason"] == "InvalidImageName"
    assert payload["message"] == startfaults.waiting({"spec": {"containers": [{"image": "Foo:1"}]},
                                                       "metadata": {"annotations": {startfaults.WAITING_REASON: "InvalidImageName"}}})[1]  # fmt: skip
    # at once: as soon as its Pods are read at all (the grace, then the next sweep), not after any timeout
    assert took <= CHECK_GRACE + timedelta(seconds=SWEEP_S + SLACK_S), took
    payload, took = ended(d, no_secret, timeout_s=60)
    assert payload["reason"] == "CreateContainerConfigError"
    assert payload["message"].startswith('secret "') and payload["message"].endswith('" not found')
    assert timedelta(seconds=config_s) <= took <= timedelta(seconds=config_s + SWEEP_S + SLACK_S), took
    assert_nothing_left(d)


def test_an_unschedulable_pod_fails_at_the_start_clock_while_a_running_one_is_left_alone(deploy, any_cluster):
    start_s = 8
    d = deploy_started(
        deploy,
        any_cluster,
        {
            "sim.nofit": capability(startTimeoutSeconds=start_s, annotations={SIM + "unschedulable": "true"}),
            "sim.runs": capability(startTimeoutSeconds=start_s),  # hangs, but its container runs
        },
    )
    [nofit] = d.schedule_batch("sim.nofit", 1)
    [runs] = d.schedule_batch("sim.runs", 1)
    payload, took = ended(d, nofit, timeout_s=start_s + SWEEP_S + SLACK_S + 30)
    assert payload.pop("detail")["pod"].startswith(job_name(nofit) + "-"), payload
    assert payload == {"reason": "Unschedulable", "message": startfaults.SCHEDULER_MESSAGE}
    assert timedelta(seconds=start_s) <= took <= timedelta(seconds=start_s + SWEEP_S + SLACK_S), took
    time.sleep(2 * SWEEP_S + 1)  # a couple more sweeps, all past the running one's start clock too
    with transaction(d.sessions) as session:
        row = dispatches.get_dispatch(session, runs)
        assert row is not None and row.state is DispatchState.CREATED  # past the same clock, running
    # the failed one's Job deleted just after its event was written; the running one's kept
    d.wait(lambda: [j["metadata"]["name"] for j in d.jobs()] == [f"kd-{runs}"], what="only the running Job left")
    assert d.terminal_events([runs]) == {runs: []}
    d.send(names.CANCEL_TASK, runs)
    assert d.wait_terminal([runs])[runs][0][0] == EventType.WORKER_CANCELLED.value
    assert_nothing_left(d)


def test_a_job_refused_for_quota_waits_is_retried_then_ends_queue_timeout(deploy, sim_cluster):
    queue_s = 5
    d = deploy(
        sim_cluster,
        capabilities={"sim.queued": capability(queueTimeoutSeconds=queue_s, image="sim:1")},
        sweep_interval_s=str(SWEEP_S),
        sweep_grace_s="1",
    )
    set_job_quota(d, 0)  # the namespace's quota allows no Job at all
    d.start_worker("w1")
    d.start_beat()
    started = time.monotonic()
    [dispatch_id] = d.schedule_batch("sim.queued", 1)
    d.wait(lambda: _create_error(d, dispatch_id), timeout_s=20, what="the create refused and retried")
    [(event, payload)] = d.wait_terminal([dispatch_id], timeout_s=queue_s + SLACK_S + 30)[dispatch_id]
    assert time.monotonic() - started >= queue_s
    assert event == EventType.WORKER_FAILED.value and payload["reason"] == "QueueTimeout"
    assert payload["message"].startswith(f"the Job could not be created within queueTimeoutSeconds ({queue_s} s): ")
    assert "QuotaExceeded: " in payload["message"] and "exceeded quota" in payload["message"]
    with transaction(d.sessions) as session:
        row = dispatches.get_dispatch(session, dispatch_id)
        assert row is not None and row.job_created_at is None  # it never had a Job
        assert row.finished_at - row.created_at >= timedelta(seconds=queue_s)
    assert d.jobs() == []


def _create_error(d: Any, dispatch_id: str) -> bool:
    with transaction(d.sessions) as session:
        row = dispatches.get_dispatch(session, dispatch_id)
        return row is not None and row.state is DispatchState.SCHEDULED and bool(row.create_error)


def test_a_job_whose_pods_admission_refuses_ends_failed_create_with_the_controllers_message(deploy, real_cluster):
    """The real control plane, a namespace enforcing the `restricted` Pod Security profile, a
    capability that overrides it: kube-apiserver refuses every Pod the real Job controller makes,
    the controller says why in a FailedCreate Warning Event, and the start clock's give-up ends
    the dispatch with that reason and message instead of a bare StartTimeout."""
    namespace = f"kd-refused-{uuid.uuid4().hex[:6]}"
    labels = {
        "pod-security.kubernetes.io/enforce": "restricted",
        "pod-security.kubernetes.io/enforce-version": "latest",
    }
    with real_cluster.api_client() as api:
        kubernetes.client.CoreV1Api(api).create_namespace({"metadata": {"name": namespace, "labels": labels}})
    start_s = 6
    d = deploy_started(
        deploy,
        real_cluster,
        {
            "sim.root": capability(
                namespace=namespace,
                startTimeoutSeconds=start_s,
                runAsUser=0,
                securityOverrides={"runAsNonRoot": "test: a Pod the namespace's admission refuses"},
            )
        },
    )
    [dispatch_id] = d.schedule_batch("sim.root", 1)
    payload, took = ended(d, dispatch_id, timeout_s=start_s + SWEEP_S + SLACK_S + 30)
    assert payload["reason"] == "FailedCreate", payload
    assert 'violates PodSecurity "restricted:latest"' in payload["message"], payload
    assert [e["reason"] for e in payload["detail"]["events"]][-1] == "FailedCreate", payload
    assert timedelta(seconds=start_s) <= took, took
    d.wait(lambda: not d.jobs(namespace), timeout_s=30, what="the refused Job deleted")
