"""Pod finalizers and deletion propagation, stated as Kubernetes behaves, through the official
client over HTTP (so that the same tests can run against a real kube-apiserver and Job controller):
the Job controller copies the template's finalizers to its Pods next to its own
`batch.kubernetes.io/job-tracking`; a Pod with a finalizer is only marked when deleted (even
with a grace period of 0, as PodGC deletes) and goes with its last finalizer; Foreground
deletion deletes the dependents first and waits for them, finalizers included; Background
removes the owner at once, then deletes its Pods."""

from __future__ import annotations

import time
from typing import Any

from conftest import Api, job_manifest, wait_for

OURS = "k8s-dispatch.io/result-protection"
TRACKING = "batch.kubernetes.io/job-tracking"
QUICK = {"localcluster.k8s-dispatch.io/duration-ms": "1", "localcluster.k8s-dispatch.io/result": '{"ok":true}'}
HANG = {"localcluster.k8s-dispatch.io/outcome": "hang"}


def with_pod_finalizer(name: str, annotations: dict[str, str]) -> dict[str, Any]:
    manifest = job_manifest(name, annotations=annotations)
    manifest["spec"]["template"]["metadata"]["finalizers"] = [OURS]
    return manifest


def finished_pod(sim: Api, name: str) -> Any:
    """The Job's only Pod once the Job is Complete and the controller has counted it."""
    sim.wait_job(name, "Complete")
    return wait_for(lambda: (lambda pods: pods[0] if len(pods) == 1 and TRACKING not in pods[0].metadata.finalizers else None)(
        sim.pods_of(name)), what=f"the pod of {name} counted")  # fmt: skip


def read_pod(sim: Api, pod: Any) -> Any:
    return sim.core.read_namespaced_pod(pod.metadata.name, sim.namespace)


def free(sim: Api, pod: Any) -> None:
    """Take our finalizer off, as the project does: a JSON patch `test`ing the uid and the index."""
    current = read_pod(sim, pod)
    index = current.metadata.finalizers.index(OURS)
    sim.core.patch_namespaced_pod(pod.metadata.name, sim.namespace, [
        {"op": "test", "path": "/metadata/uid", "value": current.metadata.uid},
        {"op": "test", "path": f"/metadata/finalizers/{index}", "value": OURS},
        {"op": "remove", "path": f"/metadata/finalizers/{index}"},
    ])  # fmt: skip


def stays(read, *, for_s: float = 0.5) -> bool:
    """True if `read` keeps finding its object for `for_s` (a controller has had its chance)."""
    deadline = time.monotonic() + for_s
    while time.monotonic() < deadline:
        read()
        time.sleep(0.05)
    return True


def test_the_job_controller_puts_the_templates_finalizers_on_its_pods_next_to_job_tracking(sim: Api) -> None:
    sim.create_job(with_pod_finalizer("running", HANG))
    pod = wait_for(lambda: sim.pods_of("running"), what="a pod")[0]
    assert pod.metadata.finalizers == [OURS, TRACKING]
    # Once a finished Pod is counted, the controller drops its own finalizer, never the template's.
    sim.create_job(with_pod_finalizer("done", QUICK))
    assert finished_pod(sim, "done").metadata.finalizers == [OURS]


def test_a_pod_with_a_finalizer_is_only_marked_when_deleted_and_goes_with_its_last_finalizer(sim: Api) -> None:
    sim.create_job(with_pod_finalizer("kept", QUICK))
    pod = finished_pod(sim, "kept")
    # A grace period of 0 (what PodGC sends) does not force it out either: the API server deletes
    # an object with finalizers only by marking it.
    sim.core.delete_namespaced_pod(pod.metadata.name, sim.namespace, grace_period_seconds=0)
    marked = read_pod(sim, pod)
    assert marked.metadata.deletion_timestamp is not None and marked.metadata.finalizers == [OURS]
    assert stays(lambda: read_pod(sim, pod))
    # What it holds is still there to read: its phase and its container's termination message.
    kept = read_pod(sim, pod)
    assert kept.status.phase == "Succeeded"
    assert kept.status.container_statuses[0].state.terminated.message == '{"ok":true}'
    assert sim.job("kept").status.succeeded == 1 and not sim.job("kept").status.failed  # nothing re-run

    free(sim, pod)
    wait_for(lambda: sim.gone(lambda: read_pod(sim, pod)), what="the pod gone with its last finalizer")


def test_foreground_deletion_deletes_the_pods_first_and_the_job_waits_for_those_held(sim: Api) -> None:
    sim.create_job(with_pod_finalizer("fg", QUICK))
    pod = finished_pod(sim, "fg")
    sim.batch.delete_namespaced_job("fg", sim.namespace, propagation_policy="Foreground")
    job = sim.job("fg")
    assert job.metadata.deletion_timestamp is not None and "foregroundDeletion" in job.metadata.finalizers
    wait_for(lambda: read_pod(sim, pod).metadata.deletion_timestamp, what="the pod deleted first")
    # The Pod is held by its finalizer, so the Job is held too, its status intact.
    assert stays(lambda: (sim.job("fg"), read_pod(sim, pod)))
    assert "Complete" in [c.type for c in sim.job("fg").status.conditions if c.status == "True"]

    free(sim, pod)
    wait_for(lambda: sim.gone(lambda: read_pod(sim, pod)), what="the pod gone")
    wait_for(lambda: sim.gone(lambda: sim.job("fg")), what="then the job gone")


def test_background_deletion_removes_the_job_first_then_marks_its_pods(sim: Api) -> None:
    sim.create_job(with_pod_finalizer("bg", QUICK))
    pod = finished_pod(sim, "bg")
    sim.batch.delete_namespaced_job("bg", sim.namespace, propagation_policy="Background")
    assert sim.gone(lambda: sim.job("bg"))  # no finalizer on the Job: gone at once
    marked = wait_for(lambda: read_pod(sim, pod).metadata.deletion_timestamp and read_pod(sim, pod),
                      what="its pod deleted after it")  # fmt: skip
    assert marked.metadata.finalizers == [OURS] and marked.status.phase == "Succeeded"
    assert stays(lambda: read_pod(sim, pod))

    free(sim, pod)
    wait_for(lambda: sim.gone(lambda: read_pod(sim, pod)), what="the pod gone with its last finalizer")


def test_a_running_pod_with_a_finalizer_is_stopped_when_deleted_and_kept_until_freed(sim: Api) -> None:
    sim.create_job(with_pod_finalizer("stopped", HANG))
    pod = wait_for(lambda: (lambda pods: pods[0] if pods and pods[0].status.phase == "Running" else None)(
        sim.pods_of("stopped")), what="a running pod")  # fmt: skip
    sim.core.delete_namespaced_pod(pod.metadata.name, sim.namespace, grace_period_seconds=0)
    stopped = wait_for(lambda: (lambda p: p if p.status.phase == "Failed" else None)(read_pod(sim, pod)),
                       what="the pod stopped")  # fmt: skip
    assert stopped.metadata.deletion_timestamp is not None and OURS in stopped.metadata.finalizers
    sim.batch.delete_namespaced_job("stopped", sim.namespace, propagation_policy="Background")
    free(sim, pod)
    wait_for(lambda: sim.gone(lambda: read_pod(sim, pod)), what="the pod gone with its last finalizer")
    for replacement in sim.pods_of("stopped"):  # any the controller made meanwhile: held the same way
        free(sim, replacement)
    wait_for(lambda: not sim.pods_of("stopped"), what="every pod of the job gone")
