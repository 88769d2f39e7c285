"""Pods that never start, on both clusters (localcluster's own kubelet, and the node agent of the
real control plane): the waiting-reason annotation leaves the Pod bound and Pending with the
kubelet's reason and message; the unschedulable one leaves it unbound with `PodScheduled=False`,
reason `Unschedulable`, the scheduler's message. And the Pod field selectors our sweep and the
node agent use (`status.phase`, `metadata.name`, `spec.nodeName`), answered as kube-apiserver does.
Plus the pure pieces of demo/localcluster/startfaults.py."""

from __future__ import annotations

import time

import pytest
from conftest import Api, job_manifest, wait_for

from k8s_dispatch.demo.localcluster import startfaults

SIM = "localcluster.k8s-dispatch.io/"


def pending_pod(sim: Api, name: str, *, ready: object) -> object:
    pods = sim.pods_of(name)
    return pods[0] if pods and ready(pods[0]) else None


def waiting_of(pod: object) -> object:
    statuses = pod.status.container_statuses or []  # type: ignore[attr-defined]
    return statuses[0].state.waiting if statuses and statuses[0].state and statuses[0].state.waiting else None


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        ("ImagePullBackOff", 'Back-off pulling image "registry.invalid/foo:1"'),
        ("ErrImagePull", 'failed to pull and unpack image "registry.invalid/foo:1"'),
        ("InvalidImageName", 'couldn\'t parse image name "registry.invalid/foo:1"'),
        ("CreateContainerConfigError", 'secret "db-password" not found'),
    ],
)
def test_a_waiting_reason_keeps_the_pod_bound_and_pending_with_the_kubelets_reason_and_message(
    sim: Api, reason: str, expected: str
) -> None:
    env = [{"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "db-password", "key": "password"}}}]
    sim.create_job(
        job_manifest(
            "stuck",
            annotations={SIM + "waiting-reason": reason},
            container={"image": "registry.invalid/foo:1", "env": env},
            backoffLimit=0,
        )
    )
    pod = wait_for(lambda: pending_pod(sim, "stuck", ready=waiting_of), timeout=20, what=f"a pod waiting {reason}")
    waiting = waiting_of(pod)
    assert waiting.reason == reason and expected in waiting.message
    assert pod.status.phase == "Pending" and pod.spec.node_name  # bound: the node took it
    scheduled = {c.type: c.status for c in pod.status.conditions}
    assert scheduled["PodScheduled"] == "True" and scheduled["Ready"] == "False"
    time.sleep(1.5)  # it stays so: nothing starts it, nothing rewrites it
    again = sim.pods_of("stuck")[0]
    assert again.status.phase == "Pending" and waiting_of(again).reason == reason
    assert again.metadata.resource_version == pod.metadata.resource_version  # reported once
    job = sim.job("stuck")
    assert not job.status.ready and not job.status.succeeded and not job.status.failed


def test_an_unschedulable_pod_is_never_bound_and_says_why_as_the_scheduler_does(sim: Api) -> None:
    sim.create_job(job_manifest("nofit", annotations={SIM + "unschedulable": "true"}, backoffLimit=0))

    def unschedulable() -> object:
        pods = sim.pods_of("nofit")
        conditions = {c.type: c for c in (pods[0].status.conditions or [])} if pods else {}
        scheduled = conditions.get("PodScheduled")
        return pods[0] if scheduled is not None and scheduled.status == "False" else None

    pod = wait_for(unschedulable, timeout=20, what="PodScheduled=False")
    [condition] = [c for c in pod.status.conditions if c.type == "PodScheduled"]
    assert (condition.reason, condition.message) == ("Unschedulable", startfaults.SCHEDULER_MESSAGE)
    assert pod.status.phase == "Pending" and not pod.spec.node_name
    time.sleep(1.5)
    again = sim.pods_of("nofit")[0]
    assert not again.spec.node_name and again.metadata.resource_version == pod.metadata.resource_version
    # its Job deleted, the Pod goes too: never bound, it never runs, and nothing holds it
    sim.batch.delete_namespaced_job("nofit", sim.namespace, propagation_policy="Background")
    wait_for(lambda: not sim.pods_of("nofit"), timeout=30, what="the unbound pod gone")


def test_pod_field_selectors_on_phase_name_and_node(sim: Api) -> None:
    sim.create_job(job_manifest("runs", annotations={SIM + "duration-ms": "600000"}, backoffLimit=0))
    sim.create_job(job_manifest("waits", annotations={SIM + "waiting-reason": "ImagePullBackOff"}, backoffLimit=0))
    sim.create_job(job_manifest("nofit", annotations={SIM + "unschedulable": "true"}, backoffLimit=0))
    running = wait_for(
        lambda: pending_pod(sim, "runs", ready=lambda p: p.status.phase == "Running"), timeout=20, what="running"
    )
    wait_for(lambda: pending_pod(sim, "waits", ready=waiting_of), timeout=20, what="waiting")
    wait_for(lambda: pending_pod(sim, "nofit", ready=lambda p: p.status.conditions), timeout=20, what="unschedulable")

    def names(**selectors: str) -> list[str]:
        pods = sim.core.list_namespaced_pod(sim.namespace, **selectors).items
        return sorted(p.metadata.labels["batch.kubernetes.io/job-name"] for p in pods)

    assert names(field_selector="status.phase=Pending") == ["nofit", "waits"]
    assert names(field_selector="status.phase!=Pending") == ["runs"]
    assert names(field_selector="status.phase!=Pending,status.phase!=Running") == []
    assert names(field_selector=f"metadata.name={running.metadata.name}") == ["runs"]
    assert names(field_selector="spec.nodeName=") == ["nofit"]
    node = running.spec.node_name
    assert names(field_selector=f"spec.nodeName={node}") == ["runs", "waits"]
    assert names(field_selector=f"spec.nodeName={node},status.phase=Pending") == ["waits"]
    assert names(field_selector="status.phase=Pending", label_selector="batch.kubernetes.io/job-name=waits") == [
        "waits"
    ]
    for name in ("runs", "waits", "nofit"):
        sim.batch.delete_namespaced_job(name, sim.namespace, propagation_policy="Background")


# --- the pure pieces ---------------------------------------------------------------------------


def pod(annotations: dict[str, str], **container: object) -> dict[str, object]:
    return {
        "metadata": {"annotations": annotations},
        "spec": {"containers": [{"name": "worker", "image": "foo:1", **container}]},
    }


@pytest.mark.parametrize(
    ("annotations", "expected"),
    [
        ({}, None),
        ({SIM + "waiting-reason": "Nonsense"}, None),
        ({SIM + "waiting-reason": "ImagePullBackOff"}, ("ImagePullBackOff", 'Back-off pulling image "foo:1"')),
        ({SIM + "waiting-reason": "CreateContainerConfigError"}, ("CreateContainerConfigError", 'secret "worker-credentials" not found')),
    ],
)  # fmt: skip
def test_waiting_reads_the_annotation(annotations: dict[str, str], expected: object) -> None:
    assert startfaults.waiting(pod(annotations)) == expected


def test_a_config_error_names_the_secret_the_container_refers_to() -> None:
    refs = {"envFrom": [{"secretRef": {"name": "api-token"}}]}
    assert startfaults.waiting(pod({SIM + "waiting-reason": "CreateContainerConfigError"}, **refs)) == (
        "CreateContainerConfigError",
        'secret "api-token" not found',
    )


def test_statuses_are_recognised_once_written() -> None:
    p = pod({SIM + "waiting-reason": "ErrImagePull", SIM + "unschedulable": "True"})
    assert startfaults.unschedulable(p) and not startfaults.unschedulable(pod({SIM + "unschedulable": "no"}))
    reason, message = startfaults.waiting(p)  # type: ignore[misc]
    waiting = {**p, "status": startfaults.waiting_status(p, 1_700_000_000.0, reason, message)}
    assert startfaults.shows_waiting(waiting, "ErrImagePull") and not startfaults.shows_waiting(p, "ErrImagePull")
    assert waiting["status"]["phase"] == "Pending"  # type: ignore[index]
    unscheduled = {**p, "status": startfaults.unschedulable_status(p, 1_700_000_000.0)}
    assert startfaults.shows_unschedulable(unscheduled) and not startfaults.shows_unschedulable(waiting)
