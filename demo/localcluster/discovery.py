"""Legacy (plain JSON) discovery documents kubectl and client-go read: /api, /apis, the group and
the group-version resource lists, and /version (pure)."""

from __future__ import annotations

import hashlib
from typing import Any

from k8s_dispatch.demo.localcluster.resources import BY_GROUP_VERSION, VERBS, Resource

KUBE_VERSION = {
    "major": "1",
    "minor": "32",
    "gitVersion": "v1.32.0-localcluster",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2024-12-11T00:00:00Z",
    "goVersion": "go1.23.3",
    "compiler": "gc",
    "platform": "linux/amd64",
}

_SUBRESOURCE_VERBS = {
    "status": ["get", "patch", "update"],
    "log": ["get"],
    "binding": ["create"],
    "eviction": ["create"],
}
# A subresource whose kind is another group's, as kube-apiserver lists it.
_SUBRESOURCE_KINDS = {"eviction": {"group": "policy", "version": "v1", "kind": "Eviction"}}


def api_versions(server_address: str) -> dict[str, Any]:
    return {
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}],
    }


def _group(name: str) -> dict[str, Any]:
    gv = {"groupVersion": f"{name}/v1", "version": "v1"}
    return {"name": name, "versions": [gv], "preferredVersion": gv}


def api_group_list() -> dict[str, Any]:
    groups = sorted({g for g, _ in BY_GROUP_VERSION if g})
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [_group(g) for g in groups]}


def api_group(name: str) -> dict[str, Any] | None:
    if (name, "v1") not in BY_GROUP_VERSION:
        return None
    return {"kind": "APIGroup", "apiVersion": "v1", **_group(name)}


def _resource(r: Resource) -> list[dict[str, Any]]:
    main: dict[str, Any] = {
        "name": r.plural,
        "singularName": r.singular,
        "namespaced": r.namespaced,
        "kind": r.kind,
        "verbs": list(VERBS)
        if r.plural != "namespaces"
        else ["create", "delete", "get", "list", "patch", "update", "watch"],
        "storageVersionHash": hashlib.sha256(f"{r.api_version}/{r.kind}".encode()).hexdigest()[:12],
    }
    if r.short_names:
        main["shortNames"] = list(r.short_names)
    if r.categories:
        main["categories"] = list(r.categories)
    subs = [
        {
            "name": f"{r.plural}/{sub}",
            "singularName": "",
            "namespaced": r.namespaced,
            "kind": r.kind,
            "verbs": _SUBRESOURCE_VERBS[sub],
            **_SUBRESOURCE_KINDS.get(sub, {}),
        }
        for sub in r.subresources
    ]
    return [main, *subs]


def resource_list(group: str, version: str) -> dict[str, Any] | None:
    resources = BY_GROUP_VERSION.get((group, version))
    if resources is None:
        return None
    items = [item for r in resources.values() for item in _resource(r)]
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": f"{group}/{version}" if group else version,
        "resources": sorted(items, key=lambda i: i["name"]),
    }
