"""Defaulting as the API server applies it on create (pkg/apis/*/v1/defaults.go and the Job
strategy): pod spec and container defaults, Job spec defaults, the generated Job selector and
controller-uid labels. Functions take a fresh (unshared) dict and fill it in place.
"""

from __future__ import annotations

from typing import Any

from k8s_dispatch.demo.localcluster import failurepolicy

CONTROLLER_UID = "controller-uid"
BATCH_CONTROLLER_UID = "batch.kubernetes.io/controller-uid"
JOB_NAME = "job-name"
BATCH_JOB_NAME = "batch.kubernetes.io/job-name"
DEFAULT_BACKOFF_LIMIT = 6
MAX_INT32 = 2**31 - 1  # the backoffLimit of a Job with backoffLimitPerIndex: no global limit


def _image_pull_policy(image: str) -> str:
    last = image.rsplit("/", 1)[-1]
    if "@" in last:
        return "IfNotPresent"
    tag = last.split(":", 1)[1] if ":" in last else "latest"
    return "Always" if tag == "latest" else "IfNotPresent"


def default_container(c: dict[str, Any]) -> None:
    c.setdefault("terminationMessagePath", "/dev/termination-log")
    c.setdefault("terminationMessagePolicy", "File")
    c.setdefault("imagePullPolicy", _image_pull_policy(c.get("image") or ""))
    c.setdefault("resources", {})


def default_pod_spec(spec: dict[str, Any]) -> None:
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("securityContext", {})
    spec.setdefault("schedulerName", "default-scheduler")
    for c in spec.get("containers") or []:
        default_container(c)
    for c in spec.get("initContainers") or []:
        default_container(c)


def default_pod(pod: dict[str, Any]) -> None:
    spec = pod.setdefault("spec", {})
    default_pod_spec(spec)
    # what the ServiceAccount and Priority admission plugins add
    spec.setdefault("serviceAccountName", "default")
    spec.setdefault("serviceAccount", spec["serviceAccountName"])
    spec.setdefault("enableServiceLinks", True)
    spec.setdefault("priority", 0)
    spec.setdefault("preemptionPolicy", "PreemptLowerPriority")


def default_job(job: dict[str, Any]) -> None:
    spec = job.setdefault("spec", {})
    if spec.get("completions") is None and spec.get("parallelism") is None:
        spec["completions"] = 1
        spec["parallelism"] = 1
    spec.setdefault("parallelism", 1)
    spec.setdefault("completionMode", "NonIndexed")
    spec.setdefault(
        "backoffLimit", MAX_INT32 if spec.get("backoffLimitPerIndex") is not None else DEFAULT_BACKOFF_LIMIT
    )
    spec.setdefault("suspend", False)
    spec.setdefault("manualSelector", None)
    if spec.get("manualSelector") is None:
        spec.pop("manualSelector")
    failurepolicy.default(spec)  # podReplacementPolicy Failed with a policy
    spec.setdefault("podReplacementPolicy", "TerminatingOrFailed")
    template = spec.setdefault("template", {})
    template.setdefault("metadata", {})
    default_pod_spec(template.setdefault("spec", {}))


def generate_job_selector(job: dict[str, Any], uid: str) -> None:
    """The Job strategy's PrepareForCreate: selector and labels keyed on the Job's uid, then the
    defaulting that copies the template's labels to a Job that has none."""
    spec = job["spec"]
    name = job["metadata"]["name"]
    tmeta = spec["template"].setdefault("metadata", {})
    if not spec.get("manualSelector"):
        labels = dict(tmeta.get("labels") or {})
        labels.update(
            {
                BATCH_CONTROLLER_UID: uid,
                BATCH_JOB_NAME: name,
                CONTROLLER_UID: uid,
                JOB_NAME: name,
            }
        )
        tmeta["labels"] = labels
        selector = dict(spec.get("selector") or {})
        selector["matchLabels"] = {**(selector.get("matchLabels") or {}), BATCH_CONTROLLER_UID: uid}
        spec["selector"] = selector
    if not job["metadata"].get("labels") and tmeta.get("labels"):
        job["metadata"]["labels"] = dict(tmeta["labels"])
