"""Pods that never start, on request (pure): the annotations on a Job's Pod template that make
the node report what a real cluster reports for a bad image, a missing Secret or no node that fits.

- `localcluster.k8s-dispatch.io/waiting-reason: ImagePullBackOff|ErrImagePull|InvalidImageName|
  CreateContainerConfigError|CreateContainerError|RunContainerError`: the Pod is bound and stays
  Pending, its container waiting with that reason and the kubelet's kind of message.
- `localcluster.k8s-dispatch.io/unschedulable: "true"`: the Pod is never bound; the node, acting
  as the scheduler, writes `PodScheduled=False` with reason `Unschedulable` and the scheduler's
  kind of message.

Used by the Kubelet (demo/localcluster/kubelet.py) in process and in the node agent alike, so both
clusters show the same statuses. Each report is written once: `shows` says it is there already.
"""

from __future__ import annotations

from typing import Any

from k8s_dispatch.demo.localcluster import podstatus
from k8s_dispatch.demo.localcluster.simrunner import PREFIX
from k8s_dispatch.demo.localcluster.timestamps import rfc3339

WAITING_REASON = PREFIX + "waiting-reason"
UNSCHEDULABLE = PREFIX + "unschedulable"
SCHEDULER_MESSAGE = (
    "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector. "
    "preemption: 0/1 nodes are available: 1 Preemption is not helpful for scheduling."
)


def _messages(image: str, secret: str) -> dict[str, str]:
    """The kubelet's messages for each waiting reason (containerd's wording for pulls)."""
    return {
        "ImagePullBackOff": f'Back-off pulling image "{image}"',
        "ErrImagePull": (
            f'rpc error: code = NotFound desc = failed to pull and unpack image "{image}": '
            f'failed to resolve reference "{image}": not found'
        ),
        "InvalidImageName": (
            f'Failed to apply default image tag "{image}": couldn\'t parse image name "{image}": '
            "invalid reference format"
        ),
        "CreateContainerConfigError": f'secret "{secret}" not found',
        "CreateContainerError": 'failed to reserve container name "worker": name is reserved',
        "RunContainerError": (
            "failed to create containerd task: failed to create shim task: OCI runtime create failed: "
            'exec: "worker": executable file not found in $PATH'
        ),
    }


REASONS = frozenset(_messages("", ""))


def _annotations(pod: dict[str, Any]) -> dict[str, Any]:
    return (pod.get("metadata") or {}).get("annotations") or {}


def _container(pod: dict[str, Any]) -> dict[str, Any]:
    return ((pod.get("spec") or {}).get("containers") or [{}])[0]


def unschedulable(pod: dict[str, Any]) -> bool:
    """Whether no node may take this Pod."""
    return str(_annotations(pod).get(UNSCHEDULABLE, "")).lower() == "true"


def waiting(pod: dict[str, Any]) -> tuple[str, str] | None:
    """(reason, message) the Pod's container waits with for ever, or None (it starts)."""
    reason = _annotations(pod).get(WAITING_REASON)
    if reason not in REASONS:
        return None
    container = _container(pod)
    return reason, _messages(str(container.get("image", "")), _secret_of(container))[reason]


def _secret_of(container: dict[str, Any]) -> str:
    """The first Secret the container refers to (what a CreateContainerConfigError names)."""
    for var in container.get("env") or []:
        ref = ((var.get("valueFrom") or {}).get("secretKeyRef") or {}).get("name")
        if ref:
            return str(ref)
    for source in container.get("envFrom") or []:
        ref = (source.get("secretRef") or {}).get("name")
        if ref:
            return str(ref)
    return "worker-credentials"


def waiting_status(pod: dict[str, Any], ts: float, reason: str, message: str) -> dict[str, Any]:
    """A bound Pod whose sandbox is up but whose container cannot start: Pending, waiting."""
    status = podstatus.waiting(pod, ts, reason=reason)
    for condition in status["conditions"]:
        if condition["type"] == "PodReadyToStartContainers":
            condition["status"] = "True"  # the sandbox exists: the pull or the config failed after it
        if condition["type"] in ("Ready", "ContainersReady"):
            condition["message"] = f"containers with unready status: [{_container(pod).get('name', '')}]"
    status["containerStatuses"][0]["state"] = {"waiting": {"reason": reason, "message": message}}
    return status


def unschedulable_status(pod: dict[str, Any], ts: float) -> dict[str, Any]:
    """A Pod no node fits, as kube-scheduler leaves it: Pending, PodScheduled=False."""
    status = dict(pod.get("status") or {})
    status.setdefault("qosClass", "BestEffort")
    status["phase"] = "Pending"
    status["conditions"] = [
        {
            "type": "PodScheduled",
            "status": "False",
            "lastProbeTime": None,
            "lastTransitionTime": rfc3339(ts),
            "reason": "Unschedulable",
            "message": SCHEDULER_MESSAGE,
        }
    ]
    return status


def shows_waiting(pod: dict[str, Any], reason: str) -> bool:
    """Whether the Pod's status reports its container waiting with `reason` already."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or [{}]
    return ((statuses[0].get("state") or {}).get("waiting") or {}).get("reason") == reason


def waiting_message(pod: dict[str, Any]) -> tuple[str, str] | None:
    """(reason, message) of the Pod's container as its status reports it waiting, or None."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or [{}]
    waiting = (statuses[0].get("state") or {}).get("waiting")
    return (waiting.get("reason", ""), waiting.get("message", "")) if waiting else None


def shows_unschedulable(pod: dict[str, Any]) -> bool:
    """Whether the Pod's status says it is unschedulable already."""
    return any(
        c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable"
        for c in (pod.get("status") or {}).get("conditions") or []
    )
