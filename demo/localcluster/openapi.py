"""Minimal OpenAPI v3 documents (/openapi/v3 and one per group-version), generated from
schema.py. kubectl reads them to learn that the server validates fields itself: each kind's
PATCH operation carries x-kubernetes-group-version-kind and a `fieldValidation` parameter.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from k8s_dispatch.demo.localcluster.resources import BY_GROUP_VERSION, Resource
from k8s_dispatch.demo.localcluster.schema import STRUCTS, T

_PKG = {
    "Job": "io.k8s.api.batch.v1",
    "JobSpec": "io.k8s.api.batch.v1",
    "JobStatus": "io.k8s.api.batch.v1",
    "ObjectMeta": "io.k8s.apimachinery.pkg.apis.meta.v1",
    "OwnerReference": "io.k8s.apimachinery.pkg.apis.meta.v1",
}


def schema_name(struct: str) -> str:
    if struct == "Condition":
        return "io.k8s.api.batch.v1.JobCondition"
    return f"{_PKG.get(struct, 'io.k8s.api.core.v1')}.{struct}"


def _prop(t: T) -> dict[str, Any]:
    if t.kind == "object" and t.struct:
        return {"allOf": [{"$ref": f"#/components/schemas/{schema_name(t.struct)}"}], "default": {}}
    if t.kind == "map":
        return {"type": "object", "additionalProperties": _prop(t.item or T("any"))}
    if t.kind == "array":
        out: dict[str, Any] = {"type": "array", "items": _prop(t.item or T("any"))}
        if t.merge_key:
            out["x-kubernetes-patch-merge-key"] = t.merge_key
            out["x-kubernetes-patch-strategy"] = "merge"
            out["x-kubernetes-list-type"] = "map"
            out["x-kubernetes-list-map-keys"] = [t.merge_key]
        elif t.merge:
            out["x-kubernetes-patch-strategy"] = "merge"
            out["x-kubernetes-list-type"] = "set"
        else:
            out["x-kubernetes-list-type"] = "atomic"
        return out
    if t.kind == "any":
        return {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    return {"type": t.kind, **({"format": "int64"} if t.kind == "integer" else {})}


def _schemas(kinds: list[Resource]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, fields in STRUCTS.items():
        out[schema_name(name)] = {"type": "object", "properties": {k: _prop(t) for k, t in fields.items()}}
    for r in kinds:
        out[schema_name(r.kind)]["x-kubernetes-group-version-kind"] = [
            {"group": r.group, "kind": r.kind, "version": r.version}
        ]
    out["io.k8s.apimachinery.pkg.apis.meta.v1.Patch"] = {"type": "object"}
    return out


def _param(name: str, description: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "description": description, "schema": {"type": "string", "uniqueItems": True}}


_WRITE_PARAMS = [
    _param("dryRun", "When present, indicates that modifications should not be persisted."),
    _param("fieldManager", "fieldManager is a name associated with the actor or entity that is making these changes."),
    _param(
        "fieldValidation",
        "fieldValidation instructs the server on how to handle objects in the request containing unknown or duplicate fields.",
    ),
]


def _op(r: Resource, action: str, op_id: str, *, body: bool = False, patch: bool = False) -> dict[str, Any]:
    ref = {"$ref": f"#/components/schemas/{schema_name(r.kind)}"}
    op: dict[str, Any] = {
        "tags": [r.group + "_" + r.version if r.group else "core_v1"],
        "operationId": op_id,
        "responses": {"200": {"description": "OK", "content": {"application/json": {"schema": ref}}}},
        "x-kubernetes-action": action,
        "x-kubernetes-group-version-kind": {"group": r.group, "version": r.version, "kind": r.kind},
    }
    if body or patch:
        op["parameters"] = list(_WRITE_PARAMS) + (
            [_param("force", "Force is going to force Apply requests.")] if patch else []
        )
        types = (
            [
                "application/json-patch+json",
                "application/merge-patch+json",
                "application/strategic-merge-patch+json",
                "application/apply-patch+yaml",
            ]
            if patch
            else ["*/*"]
        )
        schema = {"$ref": "#/components/schemas/io.k8s.apimachinery.pkg.apis.meta.v1.Patch"} if patch else ref
        op["requestBody"] = {"content": {t: {"schema": schema} for t in types}, "required": True}
    return op


def _paths(r: Resource) -> dict[str, Any]:
    kind = r.kind
    ns = "/namespaces/{namespace}" if r.namespaced else ""
    base = f"{r.prefix}{ns}/{r.plural}"
    suffix = "Namespaced" if r.namespaced else ""
    paths = {
        base: {
            "get": _op(r, "list", f"list{suffix}{kind}"),
            "post": _op(r, "post", f"create{suffix}{kind}", body=True),
            "delete": _op(r, "deletecollection", f"deletecollection{suffix}{kind}"),
        },
        base + "/{name}": {
            "get": _op(r, "get", f"read{suffix}{kind}"),
            "put": _op(r, "put", f"replace{suffix}{kind}", body=True),
            "patch": _op(r, "patch", f"patch{suffix}{kind}", patch=True),
            "delete": _op(r, "delete", f"delete{suffix}{kind}"),
        },
    }
    if "status" in r.subresources:
        paths[base + "/{name}/status"] = {
            "get": _op(r, "get", f"read{suffix}{kind}Status"),
            "put": _op(r, "put", f"replace{suffix}{kind}Status", body=True),
            "patch": _op(r, "patch", f"patch{suffix}{kind}Status", patch=True),
        }
    return paths


def document(group: str, version: str) -> dict[str, Any] | None:
    resources = BY_GROUP_VERSION.get((group, version))
    if resources is None:
        return None
    paths: dict[str, Any] = {}
    for r in resources.values():
        paths.update(_paths(r))
    title = "Kubernetes"
    return {
        "openapi": "3.0.0",
        "info": {"title": title, "version": "v1.32.0"},
        "paths": paths,
        "components": {"schemas": _schemas(list(resources.values()))},
    }


def doc_path(group: str, version: str) -> str:
    return f"apis/{group}/{version}" if group else f"api/{version}"


_DOCS: dict[str, bytes] = {}


def document_bytes(path: str) -> bytes | None:
    """The serialised document for `api/v1` or `apis/batch/v1` (cached: it never changes)."""
    if path not in _DOCS:
        for group, version in BY_GROUP_VERSION:
            if doc_path(group, version) == path:
                _DOCS[path] = json.dumps(document(group, version), separators=(",", ":")).encode()
                break
        else:
            return None
    return _DOCS[path]


def index() -> dict[str, Any]:
    paths = {}
    for group, version in BY_GROUP_VERSION:
        path = doc_path(group, version)
        digest = hashlib.sha512(document_bytes(path) or b"").hexdigest()[:32].upper()
        paths[path] = {"serverRelativeURL": f"/openapi/v3/{path}?hash={digest}"}
    return {"paths": paths}
