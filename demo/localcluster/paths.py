"""Parsing a Kubernetes REST path into what it addresses (pure): resource, namespace, name,
subresource, and whether it is a legacy `/watch/` path."""

from __future__ import annotations

from dataclasses import dataclass

from k8s_dispatch.demo.localcluster.resources import BY_GROUP_VERSION, Resource


@dataclass(frozen=True)
class Target:
    resource: Resource
    namespace: str | None  # None: all namespaces, or a cluster-scoped resource
    name: str | None
    subresource: str | None
    watch_path: bool


def parse(path: str) -> Target | None:
    segs = [s for s in path.split("/") if s]
    if len(segs) >= 2 and segs[0] == "api":
        gv, rest = ("", segs[1]), segs[2:]
    elif len(segs) >= 3 and segs[0] == "apis":
        gv, rest = (segs[1], segs[2]), segs[3:]
    else:
        return None
    resources = BY_GROUP_VERSION.get(gv)
    if resources is None or not rest:
        return None
    watch = rest[0] == "watch"
    if watch:
        rest = rest[1:]
        if not rest:
            return None
    namespace: str | None = None
    if rest[0] == "namespaces" and len(rest) >= 3 and rest[2] in resources and resources[rest[2]].namespaced:
        namespace, resource, tail = rest[1], resources[rest[2]], rest[3:]
    elif rest[0] in resources:
        resource, tail = resources[rest[0]], rest[1:]
    else:
        return None
    if len(tail) > 2:
        return None
    name = tail[0] if tail else None
    sub = tail[1] if len(tail) == 2 else None
    if sub is not None and sub not in resource.subresources:
        return None
    if resource.namespaced and namespace is None and name is not None:
        return None
    if watch and sub is not None:
        return None
    return Target(resource, namespace, name, sub, watch)
