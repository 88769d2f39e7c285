"""The resources this server serves (batch/v1 Jobs, core/v1 Pods, Namespaces, Events, Secrets and
ConfigMaps, and for an external node agent core/v1 Nodes and coordination.k8s.io/v1 Leases): names, kinds, scopes and
the fields each one supports in field selectors.

Everything that needs to know "what is a job" (paths, discovery, errors, tables) reads it here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")


def _meta(obj: dict[str, Any]) -> dict[str, Any]:
    return obj.get("metadata") or {}


def _job_fields(obj: dict[str, Any]) -> dict[str, str]:
    return {
        "metadata.name": _meta(obj).get("name", ""),
        "metadata.namespace": _meta(obj).get("namespace", ""),
        "status.successful": str((obj.get("status") or {}).get("succeeded", 0)),
    }


def _pod_fields(obj: dict[str, Any]) -> dict[str, str]:
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    return {
        "metadata.name": _meta(obj).get("name", ""),
        "metadata.namespace": _meta(obj).get("namespace", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.restartPolicy": spec.get("restartPolicy", ""),
        "spec.schedulerName": spec.get("schedulerName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "spec.hostNetwork": str(bool(spec.get("hostNetwork", False))).lower(),
        "status.phase": status.get("phase", ""),
        "status.podIP": status.get("podIP", ""),
        "status.nominatedNodeName": status.get("nominatedNodeName", ""),
    }


def _namespace_fields(obj: dict[str, Any]) -> dict[str, str]:
    return {
        "metadata.name": _meta(obj).get("name", ""),
        "status.phase": (obj.get("status") or {}).get("phase", ""),
    }


def _node_fields(obj: dict[str, Any]) -> dict[str, str]:
    return {
        "metadata.name": _meta(obj).get("name", ""),
        "spec.unschedulable": str(bool((obj.get("spec") or {}).get("unschedulable", False))).lower(),
    }


def _event_fields(obj: dict[str, Any]) -> dict[str, str]:
    """The field selectors kube-apiserver supports on core/v1 Events (pkg/registry/core/event)."""
    involved = obj.get("involvedObject") or {}
    source = obj.get("source") or {}
    return {
        "metadata.name": _meta(obj).get("name", ""),
        "metadata.namespace": _meta(obj).get("namespace", ""),
        **{f"involvedObject.{k}": str(involved.get(k, "")) for k in _INVOLVED},
        "reason": obj.get("reason", ""),
        "reportingComponent": obj.get("reportingComponent", ""),
        "source": source.get("component", "") or obj.get("reportingComponent", ""),
        "type": obj.get("type", ""),
    }


_INVOLVED = ("kind", "namespace", "name", "uid", "apiVersion", "resourceVersion", "fieldPath")


def _meta_fields(obj: dict[str, Any]) -> dict[str, str]:
    return {"metadata.name": _meta(obj).get("name", ""), "metadata.namespace": _meta(obj).get("namespace", "")}


def _secret_fields(obj: dict[str, Any]) -> dict[str, str]:
    return {**_meta_fields(obj), "type": obj.get("type", "")}


@dataclass(frozen=True)
class Resource:
    plural: str
    singular: str
    kind: str
    group: str
    version: str
    namespaced: bool
    fields: Callable[[dict[str, Any]], dict[str, str]] = field(compare=False)
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    subresources: tuple[str, ...] = ()

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        """`jobs.batch` or `pods`: how errors name the resource."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def qualified_kind(self) -> str:
        """`Job.batch` or `Pod`: how 422 Invalid errors name the kind."""
        return f"{self.kind}.{self.group}" if self.group else self.kind

    @property
    def list_kind(self) -> str:
        return f"{self.kind}List"

    @property
    def prefix(self) -> str:
        return f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"


JOBS = Resource(
    "jobs",
    "job",
    "Job",
    "batch",
    "v1",
    True,
    _job_fields,
    categories=("all",),
    subresources=("status",),
)
PODS = Resource(
    "pods",
    "pod",
    "Pod",
    "",
    "v1",
    True,
    _pod_fields,
    short_names=("po",),
    categories=("all",),
    subresources=("status", "log", "binding", "eviction"),
)
NAMESPACES = Resource(
    "namespaces",
    "namespace",
    "Namespace",
    "",
    "v1",
    False,
    _namespace_fields,
    short_names=("ns",),
    subresources=("status",),
)

NODES = Resource(
    "nodes",
    "node",
    "Node",
    "",
    "v1",
    False,
    _node_fields,
    short_names=("no",),
    subresources=("status",),
)
LEASES = Resource("leases", "lease", "Lease", "coordination.k8s.io", "v1", True, _meta_fields)
EVENTS = Resource("events", "event", "Event", "", "v1", True, _event_fields, short_names=("ev",))
SECRETS = Resource("secrets", "secret", "Secret", "", "v1", True, _secret_fields)
CONFIGMAPS = Resource("configmaps", "configmap", "ConfigMap", "", "v1", True, _meta_fields, short_names=("cm",))

ALL = (JOBS, PODS, NAMESPACES, NODES, LEASES, EVENTS, SECRETS, CONFIGMAPS)
BY_GROUP_VERSION: dict[tuple[str, str], dict[str, Resource]] = {
    ("", "v1"): {
        "pods": PODS,
        "namespaces": NAMESPACES,
        "nodes": NODES,
        "events": EVENTS,
        "secrets": SECRETS,
        "configmaps": CONFIGMAPS,
    },
    ("batch", "v1"): {"jobs": JOBS},
    ("coordination.k8s.io", "v1"): {"leases": LEASES},
}
BY_PLURAL: dict[str, Resource] = {r.plural: r for r in ALL}
