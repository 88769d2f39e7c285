"""Server-side printing (`as=Table`) for `kubectl get`: the columns and cells the real API server
prints for Jobs (NAME STATUS COMPLETIONS DURATION AGE), Pods (NAME READY STATUS RESTARTS AGE),
Namespaces (NAME STATUS AGE) and Secrets (NAME TYPE DATA AGE), with kubectl's human durations (pure).
"""

from __future__ import annotations

from typing import Any

from k8s_dispatch.demo.localcluster.resources import JOBS, PODS, Resource
from k8s_dispatch.demo.localcluster.selectors import format_label_selector
from k8s_dispatch.demo.localcluster.timestamps import parse_rfc3339


def human_duration(seconds: float) -> str:
    """k8s.io/apimachinery/pkg/util/duration.HumanDuration."""
    if seconds < -1:
        return "<invalid>"
    s = int(max(seconds, 0))
    if s < 120:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        rem = s % 60
        return f"{minutes}m{rem}s" if rem else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    hours = s // 3600
    if hours < 8:
        rem = minutes % 60
        return f"{hours}h{rem}m" if rem else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if hours < 192:
        rem = hours % 24
        return f"{hours // 24}d{rem}h" if rem else f"{hours // 24}d"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    years = hours // (24 * 365)
    if years < 8:
        days = (hours // 24) % 365
        return f"{years}y{days}d" if days else f"{years}y"
    return f"{years}y"


def _since(ts: str | None, now: float) -> str:
    if not ts:
        return "<unknown>"
    try:
        return human_duration(now - parse_rfc3339(ts))
    except ValueError:
        return "<unknown>"


def _col(name: str, kind: str, description: str, *, priority: int = 0, fmt: str = "") -> dict[str, Any]:
    return {"name": name, "type": kind, "format": fmt, "description": description, "priority": priority}


COLUMNS: dict[str, list[dict[str, Any]]] = {
    "jobs": [
        _col("Name", "string", "Name must be unique within a namespace.", fmt="name"),
        _col("Status", "string", "Status of the job."),
        _col("Completions", "string", "The desired number of successfully finished pods the job should be run with."),
        _col("Duration", "string", "Time required to complete the job."),
        _col(
            "Age",
            "string",
            "CreationTimestamp is a timestamp representing the server time when this object was created.",
        ),
        _col("Containers", "string", "Names of each container in the template.", priority=1),
        _col("Images", "string", "Images referenced by each container in the template.", priority=1),
        _col("Selector", "string", "A label query over pods that should match the pod count.", priority=1),
    ],
    "pods": [
        _col("Name", "string", "Name must be unique within a namespace.", fmt="name"),
        _col("Ready", "string", "The aggregate readiness state of this pod for accepting traffic."),
        _col("Status", "string", "The aggregate status of the containers in this pod."),
        _col(
            "Restarts",
            "string",
            "The number of times the containers in this pod have been restarted and when the last container in this pod has restarted.",
        ),
        _col(
            "Age",
            "string",
            "CreationTimestamp is a timestamp representing the server time when this object was created.",
        ),
        _col("IP", "string", "IP address allocated to the pod.", priority=1),
        _col("Node", "string", "Name of the node this pod is running on.", priority=1),
        _col("Nominated Node", "string", "Name of the node this pod is nominated to run on.", priority=1),
        _col("Readiness Gates", "string", "Readiness gates of the pod.", priority=1),
    ],
    "namespaces": [
        _col("Name", "string", "Name must be unique within a namespace.", fmt="name"),
        _col("Status", "string", "The status of the namespace"),
        _col(
            "Age",
            "string",
            "CreationTimestamp is a timestamp representing the server time when this object was created.",
        ),
    ],
    "nodes": [
        _col("Name", "string", "Name must be unique within a namespace.", fmt="name"),
        _col("Status", "string", "The status of the node"),
        _col(
            "Age",
            "string",
            "CreationTimestamp is a timestamp representing the server time when this object was created.",
        ),
        _col("Version", "string", "Kubelet Version reported by the node."),
    ],
    "events": [
        _col("Last Seen", "string", "The time at which the most recent occurrence of this event was recorded."),
        _col("Type", "string", "Type of this event (Normal, Warning)."),
        _col("Reason", "string", "This should be a short, machine understandable string."),
        _col("Object", "string", "The object that this event is about."),
        _col("Message", "string", "A human-readable description of the status of this operation."),
    ],
    "leases": [
        _col("Name", "string", "Name must be unique within a namespace.", fmt="name"),
        _col("Holder", "string", "Name of the Lease holder"),
        _col(
            "Age",
            "string",
            "CreationTimestamp is a timestamp representing the server time when this object was created.",
        ),
    ],
    "secrets": [
        _col("Name", "string", "Name must be unique within a namespace.", fmt="name"),
        _col("Type", "string", "Used to facilitate programmatic handling of secret data."),
        _col("Data", "integer", "Data contains the secret data."),
        _col(
            "Age",
            "string",
            "CreationTimestamp is a timestamp representing the server time when this object was created.",
        ),
    ],
    "configmaps": [
        _col("Name", "string", "Name must be unique within a namespace.", fmt="name"),
        _col("Data", "integer", "Data contains the configuration data."),
        _col(
            "Age",
            "string",
            "CreationTimestamp is a timestamp representing the server time when this object was created.",
        ),
    ],
}


def _has(conds: list[dict[str, Any]], kind: str) -> bool:
    return any(c.get("type") == kind and c.get("status") == "True" for c in conds)


def job_cells(job: dict[str, Any], now: float) -> list[Any]:
    meta, spec, status = job["metadata"], job.get("spec") or {}, job.get("status") or {}
    conds = status.get("conditions") or []
    if _has(conds, "Complete"):
        state = "Complete"
    elif _has(conds, "Failed"):
        state = "Failed"
    elif meta.get("deletionTimestamp"):
        state = "Terminating"
    elif _has(conds, "Suspended"):
        state = "Suspended"
    elif _has(conds, "FailureTarget"):
        state = "FailureTarget"
    elif _has(conds, "SuccessCriteriaMet"):
        state = "SuccessCriteriaMet"
    else:
        state = "Running"
    succeeded = status.get("succeeded", 0)
    completions = spec.get("completions")
    if completions is not None:
        done = f"{succeeded}/{completions}"
    else:
        parallelism = spec.get("parallelism", 0)
        done = f"{succeeded}/1 of {parallelism}" if parallelism > 1 else f"{succeeded}/1"
    duration = ""
    if status.get("startTime"):
        try:
            start = parse_rfc3339(status["startTime"])
            end = parse_rfc3339(status["completionTime"]) if status.get("completionTime") else now
            duration = human_duration(end - start)
        except ValueError:
            duration = ""
    containers = ((spec.get("template") or {}).get("spec") or {}).get("containers") or []
    return [
        meta["name"],
        state,
        done,
        duration,
        _since(meta.get("creationTimestamp"), now),
        ",".join(c.get("name", "") for c in containers),
        ",".join(c.get("image", "") for c in containers),
        format_label_selector(spec.get("selector") or {}),
    ]


def pod_cells(pod: dict[str, Any], now: float) -> list[Any]:
    meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
    total = len(spec.get("containers") or [])
    statuses = status.get("containerStatuses") or []
    ready = sum(1 for cs in statuses if cs.get("ready"))
    restarts = sum(cs.get("restartCount", 0) for cs in statuses)
    reason = status.get("reason") or status.get("phase") or "Pending"
    for cs in reversed(statuses):
        state = cs.get("state") or {}
        if (state.get("waiting") or {}).get("reason"):
            reason = state["waiting"]["reason"]
        elif state.get("terminated"):
            term = state["terminated"]
            reason = term.get("reason") or (
                f"Signal:{term['signal']}" if term.get("signal") else f"ExitCode:{term.get('exitCode', 0)}"
            )
    if status.get("reason"):
        reason = status["reason"]
    if meta.get("deletionTimestamp"):
        reason = "Terminating" if status.get("phase") not in ("Succeeded", "Failed") else reason
    return [
        meta["name"],
        f"{ready}/{total}",
        reason,
        str(restarts),
        _since(meta.get("creationTimestamp"), now),
        status.get("podIP") or "<none>",
        spec.get("nodeName") or "<none>",
        status.get("nominatedNodeName") or "<none>",
        "<none>",
    ]


def namespace_cells(ns: dict[str, Any], now: float) -> list[Any]:
    meta = ns["metadata"]
    return [meta["name"], (ns.get("status") or {}).get("phase", "Active"), _since(meta.get("creationTimestamp"), now)]


def node_cells(node: dict[str, Any], now: float) -> list[Any]:
    meta = node["metadata"]
    status = node.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    return [
        meta["name"],
        "Ready" if ready else "NotReady",
        _since(meta.get("creationTimestamp"), now),
        (status.get("nodeInfo") or {}).get("kubeletVersion", ""),
    ]


def lease_cells(lease: dict[str, Any], now: float) -> list[Any]:
    meta = lease["metadata"]
    return [
        meta["name"],
        (lease.get("spec") or {}).get("holderIdentity", ""),
        _since(meta.get("creationTimestamp"), now),
    ]


def row(resource: Resource, obj: dict[str, Any], now: float, *, include_object: str) -> dict[str, Any]:
    if resource is JOBS:
        cells = job_cells(obj, now)
    elif resource is PODS:
        cells = pod_cells(obj, now)
    elif resource.plural == "nodes":
        cells = node_cells(obj, now)
    elif resource.plural == "leases":
        cells = lease_cells(obj, now)
    elif resource.plural == "secrets":
        data = obj.get("data") or {}
        cells = [
            obj["metadata"]["name"],
            obj.get("type", ""),
            len(data),
            _since(obj["metadata"].get("creationTimestamp"), now),
        ]
    elif resource.plural == "configmaps":
        data = {**(obj.get("data") or {}), **(obj.get("binaryData") or {})}
        cells = [obj["metadata"]["name"], len(data), _since(obj["metadata"].get("creationTimestamp"), now)]
    elif resource.plural == "events":
        involved = obj.get("involvedObject") or {}
        cells = [
            _since(obj.get("lastTimestamp") or obj.get("eventTime") or obj["metadata"].get("creationTimestamp"), now),
            obj.get("type", ""),
            obj.get("reason", ""),
            f"{str(involved.get('kind', '')).lower()}/{involved.get('name', '')}",
            obj.get("message", ""),
        ]
    else:
        cells = namespace_cells(obj, now)
    out: dict[str, Any] = {"cells": cells}
    if include_object == "Object":
        out["object"] = obj
    elif include_object != "None":
        out["object"] = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj["metadata"]}
    return out


def table(
    resource: Resource,
    objects: list[dict[str, Any]],
    now: float,
    *,
    list_meta: dict[str, Any],
    include_object: str = "Metadata",
    headers: bool = True,
) -> dict[str, Any]:
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": list_meta,
        "columnDefinitions": COLUMNS[resource.plural] if headers else [],
        "rows": [row(resource, o, now, include_object=include_object) for o in objects],
    }
