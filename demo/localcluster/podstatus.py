"""Pod status documents as the kubelet reports them (pure): scheduled/pending, running and
terminated, with conditions and container statuses the Python client's models accept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from k8s_dispatch.demo.localcluster.timestamps import rfc3339

NODE_NAME = "localcluster"
HOST_IP = "127.0.0.1"


@dataclass(frozen=True)
class ContainerResult:
    exit_code: int
    reason: str  # Completed | Error | StartError | ContainerStatusUnknown | DeadlineExceeded ...
    message: str
    started_at: float | None
    finished_at: float


def _cond(kind: str, status: bool, ts: float, reason: str | None = None) -> dict[str, Any]:
    c: dict[str, Any] = {
        "type": kind,
        "status": "True" if status else "False",
        "lastProbeTime": None,
        "lastTransitionTime": rfc3339(ts),
    }
    if reason:
        c["reason"] = reason
    return c


def with_foreign_conditions(status: dict[str, Any], server: dict[str, Any] | None) -> dict[str, Any]:
    """`status` with the conditions others wrote on the Pod (the Eviction API's DisruptionTarget)
    that it lacks: a kubelet's status manager keeps them when it writes its own (pure)."""
    own = {c.get("type") for c in status.get("conditions") or []}
    foreign = [c for c in (server or {}).get("conditions") or [] if c.get("type") not in own]
    return {**status, "conditions": [*(status.get("conditions") or []), *foreign]} if foreign else status


def _container(pod: dict[str, Any]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = (pod.get("spec") or {}).get("containers") or [{}]
    return containers[0]


def _base(pod: dict[str, Any]) -> dict[str, Any]:
    status = dict(pod.get("status") or {})
    status.setdefault("qosClass", "BestEffort")
    return status


def waiting(pod: dict[str, Any], ts: float, *, reason: str = "ContainerCreating") -> dict[str, Any]:
    c = _container(pod)
    status = _base(pod)
    status.update(
        {
            "phase": "Pending",
            "hostIP": HOST_IP,
            "hostIPs": [{"ip": HOST_IP}],
            "startTime": rfc3339(ts),
            "conditions": [
                _cond("PodReadyToStartContainers", False, ts),
                _cond("Initialized", True, ts),
                _cond("Ready", False, ts, "ContainersNotReady"),
                _cond("ContainersReady", False, ts, "ContainersNotReady"),
                _cond("PodScheduled", True, ts),
            ],
            "containerStatuses": [
                {
                    "name": c.get("name", ""),
                    "image": c.get("image", ""),
                    "imageID": "",
                    "ready": False,
                    "restartCount": 0,
                    "started": False,
                    "state": {"waiting": {"reason": reason}},
                    "lastState": {},
                }
            ],
        }
    )
    return status


def running(
    pod: dict[str, Any],
    started_at: float,
    *,
    container_id: str,
    restart_count: int = 0,
    last_state: dict[str, Any] | None = None,
) -> dict[str, Any]:
    c = _container(pod)
    status = _base(pod)
    status.update(
        {
            "phase": "Running",
            "hostIP": HOST_IP,
            "hostIPs": [{"ip": HOST_IP}],
            "podIP": HOST_IP,
            "podIPs": [{"ip": HOST_IP}],
            "startTime": status.get("startTime") or rfc3339(started_at),
            "conditions": [
                _cond("PodReadyToStartContainers", True, started_at),
                _cond("Initialized", True, started_at),
                _cond("Ready", True, started_at),
                _cond("ContainersReady", True, started_at),
                _cond("PodScheduled", True, started_at),
            ],
            "containerStatuses": [
                {
                    "name": c.get("name", ""),
                    "image": c.get("image", ""),
                    "imageID": f"localcluster://{c.get('image', '')}",
                    "containerID": container_id,
                    "ready": True,
                    "restartCount": restart_count,
                    "started": True,
                    "state": {"running": {"startedAt": rfc3339(started_at)}},
                    "lastState": last_state or {},
                }
            ],
        }
    )
    return status


def terminated_state(result: ContainerResult, container_id: str) -> dict[str, Any]:
    term: dict[str, Any] = {"exitCode": result.exit_code, "reason": result.reason}
    if result.message:
        term["message"] = result.message
    term["startedAt"] = rfc3339(result.started_at) if result.started_at is not None else None
    term["finishedAt"] = rfc3339(result.finished_at)
    if container_id:
        term["containerID"] = container_id
    return term


def terminated(
    pod: dict[str, Any],
    result: ContainerResult,
    *,
    container_id: str,
    restart_count: int = 0,
    pod_reason: str | None = None,
    pod_message: str | None = None,
    disruption: str | None = None,
) -> dict[str, Any]:
    c = _container(pod)
    ts = result.finished_at
    phase = "Succeeded" if result.exit_code == 0 and pod_reason is None else "Failed"
    status = _base(pod)
    conditions = [
        _cond("PodReadyToStartContainers", False, ts),
        _cond("Initialized", True, ts, "PodCompleted"),
        _cond("Ready", False, ts, "PodCompleted"),
        _cond("ContainersReady", False, ts, "PodCompleted"),
        _cond("PodScheduled", True, ts),
    ]
    if disruption:
        cond = _cond("DisruptionTarget", True, ts, disruption)
        cond["message"] = pod_message or ""
        conditions.append(cond)
    own = {c["type"] for c in conditions}
    conditions += [c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") not in own]
    status.update(
        {
            "phase": phase,
            "hostIP": HOST_IP,
            "hostIPs": [{"ip": HOST_IP}],
            "startTime": status.get("startTime") or rfc3339(result.started_at or ts),
            "conditions": conditions,
            "containerStatuses": [
                {
                    "name": c.get("name", ""),
                    "image": c.get("image", ""),
                    "imageID": f"localcluster://{c.get('image', '')}",
                    "containerID": container_id,
                    "ready": False,
                    "restartCount": restart_count,
                    "started": False,
                    "state": {"terminated": terminated_state(result, container_id)},
                    "lastState": {},
                }
            ],
        }
    )
    if not container_id:
        status["containerStatuses"][0].pop("containerID")
    if pod_reason:
        status["reason"] = pod_reason
    if pod_message:
        status["message"] = pod_message
    return status
