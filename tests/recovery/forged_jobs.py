"""Jobs made by someone other than us, for the tests of refusal: our labels and finalizer on a
simulated Job that finishes at once. One definition shared by the recovery tests."""

from __future__ import annotations

from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.manifest import FINALIZER, job_name
from k8s_dispatch.workers.types import DispatchRef

SIM = "localcluster.k8s-dispatch.io/"  # localcluster's simulate-mode annotations


def forge_job(
    kube, namespace: str, ref: DispatchRef, *, deployment: str | None, result: str = '{"forged": true}'
) -> str:
    """Create a Job carrying `ref`'s labels, `deployment`'s (None: none, as a Job made before the
    label existed) and our finalizer; return its name."""
    labels, annotations = job_labels.encode(ref, deployment=deployment)
    name = job_name(ref.dispatch_id)
    kube.create_job(
        namespace,
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": name, "labels": labels, "annotations": annotations, "finalizers": [FINALIZER]},
            "spec": {
                "backoffLimit": 0,
                "template": {
                    "metadata": {"annotations": {SIM + "duration-ms": "10", SIM + "result": result}},
                    "spec": {"restartPolicy": "Never", "containers": [{"name": "worker", "image": "sim:1"}]},
                },
            },
        },
    )
    return name
