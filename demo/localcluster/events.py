"""core/v1 Events as the controllers and the kubelet record them (client-go's EventRecorder):
one Event per object, reason and message, its `count` and `lastTimestamp` bumped on a repeat
(the recorder's aggregation), named `<object>.<hash>` so a repeat finds it.

Only the events a reader of ours looks at are recorded (Warnings: a Job's failure, a Pod's
eviction); the real cluster's Normal ones (SuccessfulCreate, Completed) would cost localcluster
an object per Pod for nothing. Like kube-apiserver's, they outlive their object (there its
--event-ttl, one hour, removes them; here the server's life does).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from k8s_dispatch.demo.localcluster.resources import EVENTS
from k8s_dispatch.demo.localcluster.store import Entry
from k8s_dispatch.demo.localcluster.timestamps import now, rfc3339

if TYPE_CHECKING:
    from k8s_dispatch.demo.localcluster.registry import Registry

WARNING = "Warning"
NORMAL = "Normal"
JOB_CONTROLLER = "job-controller"
KUBELET = "kubelet"
MAX_MESSAGE = 1024  # the recorder truncates messages to 1 KiB


def event_name(involved: dict[str, Any], reason: str, message: str) -> str:
    """The Event's name for an object's (reason, message): a repeat names the same one (pure)."""
    meta = involved.get("metadata") or {}
    digest = hashlib.sha256(f"{meta.get('uid', '')}\0{reason}\0{message}".encode()).hexdigest()[:16]
    return f"{meta.get('name', '')}.{digest}"


def event_object(
    involved: dict[str, Any], *, type: str, reason: str, message: str, component: str, host: str = ""
) -> dict[str, Any]:
    """A new core/v1 Event about `involved` (pure but for the time)."""
    meta = involved.get("metadata") or {}
    ts = rfc3339(now())
    message = message[:MAX_MESSAGE]
    source: dict[str, Any] = {"component": component}
    if host:
        source["host"] = host
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": event_name(involved, reason, message), "namespace": meta.get("namespace", "")},
        "involvedObject": {
            "kind": involved.get("kind", ""),
            "namespace": meta.get("namespace", ""),
            "name": meta.get("name", ""),
            "uid": meta.get("uid", ""),
            "apiVersion": involved.get("apiVersion", ""),
            "resourceVersion": meta.get("resourceVersion", ""),
        },
        "reason": reason,
        "message": message,
        "source": source,
        "firstTimestamp": ts,
        "lastTimestamp": ts,
        "count": 1,
        "type": type,
        "eventTime": None,
        "reportingComponent": component,
        "reportingInstance": host,
    }


def record(registry: Registry, involved: Entry, *, type: str, reason: str, message: str, component: str) -> Entry:
    """Record (or count again) an Event about `involved` in localcluster's own store."""
    new = event_object(involved.obj, type=type, reason=reason, message=message, component=component)
    old = registry.store.get(EVENTS, involved.namespace, new["metadata"]["name"])
    if old is not None:
        return registry.write(
            old, {**old.obj, "count": int(old.obj.get("count") or 1) + 1, "lastTimestamp": new["lastTimestamp"]}
        )
    return registry.create_internal(EVENTS, new)
