"""The typed shape of the objects served: which fields exist, their JSON types, and how lists
merge in a strategic merge patch (patchStrategy/patchMergeKey).

One table feeds three things: decoding (unknown fields are dropped, or rejected with
fieldValidation=Strict; wrong scalar types are 400s), strategic merge patches, and the OpenAPI
v3 documents kubectl reads. Deep corners of PodSpec (affinity, probes...) are typed `ANY`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class T:
    kind: str  # string | integer | boolean | number | object | map | array | any
    struct: str | None = None
    item: T | None = None
    merge_key: str | None = None
    merge: bool = False  # patchStrategy "merge"


S = T("string")
INT = T("integer")
B = T("boolean")
ANY = T("any")
MAP_S = T("map", item=S)


def obj(name: str) -> T:
    return T("object", struct=name)


def arr(item: T, *, key: str | None = None, merge: bool = False) -> T:
    return T("array", item=item, merge_key=key, merge=merge or key is not None)


STRUCTS: dict[str, dict[str, T]] = {
    "ObjectMeta": {
        "name": S,
        "generateName": S,
        "namespace": S,
        "selfLink": S,
        "uid": S,
        "resourceVersion": S,
        "generation": INT,
        "creationTimestamp": S,
        "deletionTimestamp": S,
        "deletionGracePeriodSeconds": INT,
        "labels": MAP_S,
        "annotations": MAP_S,
        "ownerReferences": arr(obj("OwnerReference"), key="uid"),
        "finalizers": arr(S, merge=True),
        "managedFields": arr(ANY),
    },
    "OwnerReference": {
        "apiVersion": S,
        "kind": S,
        "name": S,
        "uid": S,
        "controller": B,
        "blockOwnerDeletion": B,
    },
    "Job": {
        "apiVersion": S,
        "kind": S,
        "metadata": obj("ObjectMeta"),
        "spec": obj("JobSpec"),
        "status": obj("JobStatus"),
    },
    "JobSpec": {
        "parallelism": INT,
        "completions": INT,
        "activeDeadlineSeconds": INT,
        "podFailurePolicy": ANY,
        "successPolicy": ANY,
        "backoffLimit": INT,
        "backoffLimitPerIndex": INT,
        "maxFailedIndexes": INT,
        "selector": ANY,
        "manualSelector": B,
        "template": obj("PodTemplateSpec"),
        "ttlSecondsAfterFinished": INT,
        "completionMode": S,
        "suspend": B,
        "podReplacementPolicy": S,
        "managedBy": S,
    },
    "JobStatus": {
        "conditions": arr(obj("Condition"), key="type"),
        "startTime": S,
        "completionTime": S,
        "active": INT,
        "succeeded": INT,
        "failed": INT,
        "terminating": INT,
        "completedIndexes": S,
        "failedIndexes": S,
        "uncountedTerminatedPods": ANY,
        "ready": INT,
    },
    "Condition": {
        "type": S,
        "status": S,
        "lastProbeTime": S,
        "lastTransitionTime": S,
        "reason": S,
        "message": S,
        "observedGeneration": INT,
    },
    "PodTemplateSpec": {"metadata": obj("ObjectMeta"), "spec": obj("PodSpec")},
    "PodSpec": {
        "volumes": arr(ANY, key="name"),
        "initContainers": arr(obj("Container"), key="name"),
        "containers": arr(obj("Container"), key="name"),
        "ephemeralContainers": arr(ANY, key="name"),
        "restartPolicy": S,
        "terminationGracePeriodSeconds": INT,
        "activeDeadlineSeconds": INT,
        "dnsPolicy": S,
        "nodeSelector": MAP_S,
        "serviceAccountName": S,
        "serviceAccount": S,
        "automountServiceAccountToken": B,
        "nodeName": S,
        "hostNetwork": B,
        "hostPID": B,
        "hostIPC": B,
        "shareProcessNamespace": B,
        "securityContext": ANY,
        "imagePullSecrets": arr(ANY, key="name"),
        "hostname": S,
        "subdomain": S,
        "affinity": ANY,
        "schedulerName": S,
        "tolerations": arr(ANY),
        "hostAliases": arr(ANY, key="ip"),
        "priorityClassName": S,
        "priority": INT,
        "dnsConfig": ANY,
        "readinessGates": arr(ANY),
        "runtimeClassName": S,
        "enableServiceLinks": B,
        "preemptionPolicy": S,
        "overhead": ANY,
        "topologySpreadConstraints": arr(ANY),
        "setHostnameAsFQDN": B,
        "os": ANY,
        "hostUsers": B,
        "schedulingGates": arr(ANY, key="name"),
        "resourceClaims": arr(ANY, key="name"),
        "resources": ANY,
    },
    "Container": {
        "name": S,
        "image": S,
        "command": arr(S),
        "args": arr(S),
        "workingDir": S,
        "ports": arr(ANY, key="containerPort"),
        "envFrom": arr(ANY),
        "env": arr(obj("EnvVar"), key="name"),
        "resources": ANY,
        "resizePolicy": arr(ANY),
        "restartPolicy": S,
        "volumeMounts": arr(ANY, key="mountPath"),
        "volumeDevices": arr(ANY, key="devicePath"),
        "livenessProbe": ANY,
        "readinessProbe": ANY,
        "startupProbe": ANY,
        "lifecycle": ANY,
        "terminationMessagePath": S,
        "terminationMessagePolicy": S,
        "imagePullPolicy": S,
        "securityContext": ANY,
        "stdin": B,
        "stdinOnce": B,
        "tty": B,
    },
    "EnvVar": {"name": S, "value": S, "valueFrom": ANY},
    "PodStatus": {
        "phase": S,
        "conditions": arr(obj("Condition"), key="type"),
        "message": S,
        "reason": S,
        "nominatedNodeName": S,
        "hostIP": S,
        "hostIPs": arr(ANY),
        "podIP": S,
        "podIPs": arr(ANY, key="ip"),
        "startTime": S,
        "initContainerStatuses": arr(ANY),
        "containerStatuses": arr(ANY),
        "qosClass": S,
        "ephemeralContainerStatuses": arr(ANY),
        "resize": S,
        "resourceClaimStatuses": arr(ANY),
        "observedGeneration": INT,
    },
    "Pod": {
        "apiVersion": S,
        "kind": S,
        "metadata": obj("ObjectMeta"),
        "spec": obj("PodSpec"),
        "status": obj("PodStatus"),
    },
    "Namespace": {
        "apiVersion": S,
        "kind": S,
        "metadata": obj("ObjectMeta"),
        "spec": obj("NamespaceSpec"),
        "status": obj("NamespaceStatus"),
    },
    "NamespaceSpec": {"finalizers": arr(S)},
    "Node": {"apiVersion": S, "kind": S, "metadata": obj("ObjectMeta"), "spec": ANY, "status": ANY},
    "Lease": {"apiVersion": S, "kind": S, "metadata": obj("ObjectMeta"), "spec": obj("LeaseSpec")},
    "LeaseSpec": {
        "holderIdentity": S,
        "leaseDurationSeconds": INT,
        "acquireTime": S,
        "renewTime": S,
        "leaseTransitions": INT,
        "strategy": S,
        "preferredHolder": S,
    },
    "NamespaceStatus": {"phase": S, "conditions": arr(obj("Condition"), key="type")},
    "Event": {
        "apiVersion": S,
        "kind": S,
        "metadata": obj("ObjectMeta"),
        "involvedObject": obj("ObjectReference"),
        "reason": S,
        "message": S,
        "source": obj("EventSource"),
        "firstTimestamp": S,
        "lastTimestamp": S,
        "count": INT,
        "type": S,
        "eventTime": S,
        "series": ANY,
        "action": S,
        "related": obj("ObjectReference"),
        "reportingComponent": S,
        "reportingInstance": S,
    },
    "ObjectReference": {
        "kind": S,
        "namespace": S,
        "name": S,
        "uid": S,
        "apiVersion": S,
        "resourceVersion": S,
        "fieldPath": S,
    },
    "EventSource": {"component": S, "host": S},
    "Secret": {
        "apiVersion": S,
        "kind": S,
        "metadata": obj("ObjectMeta"),
        "immutable": B,
        "data": MAP_S,
        "stringData": MAP_S,
        "type": S,
    },
    "ConfigMap": {
        "apiVersion": S,
        "kind": S,
        "metadata": obj("ObjectMeta"),
        "immutable": B,
        "data": MAP_S,
        "binaryData": MAP_S,
    },
}

_GO_TYPES = {"string": "string", "integer": "int64", "boolean": "bool", "number": "float64"}


@dataclass(frozen=True)
class Decoded:
    obj: dict[str, Any]
    unknown: list[str]  # dotted paths of dropped unknown fields
    type_errors: list[str]  # messages for values of the wrong JSON type


_PY_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "boolean": (bool,),
    "integer": (int,),
    "number": (int, float),
}


def _scalar_ok(kind: str, value: Any) -> bool:
    if type(value) is bool:
        return kind == "boolean"
    if kind == "integer" and type(value) is float:
        return value.is_integer()
    return isinstance(value, _PY_TYPES[kind])


def _error(struct_name: str, path: list[str], value: Any, go_type: str) -> str:
    where = ".".join(path)
    return f"json: cannot unmarshal {_json_kind(value)} into Go struct field {struct_name}.{where} of type {go_type}"


def _walk(value: Any, t: T, path: list[str], struct_name: str, unknown: list[str], errors: list[str]) -> Any:
    """Keep the known fields of `value` (typed `t`); `path` is the dotted location, kept as parts."""
    kind = t.kind
    if value is None or kind == "any":
        return value
    if kind == "object":
        if type(value) is not dict:
            errors.append(_error(struct_name, path, value, t.struct or ""))
            return value
        fields = STRUCTS[t.struct or ""]
        out = {}
        for k, v in value.items():
            ft = fields.get(k)
            if ft is None:
                unknown.append(".".join([*path, k]))
                continue
            # the common cases inline: strings, untyped values, well-formed string maps
            if ft is S:
                if v is not None and type(v) is not str:
                    errors.append(_error(t.struct or "", [*path, k], v, "string"))
                out[k] = v
                continue
            if v is None or ft is ANY or (ft is MAP_S and type(v) is dict and all(type(x) is str for x in v.values())):
                out[k] = v
                continue
            path.append(k)
            out[k] = _walk(v, ft, path, t.struct or "", unknown, errors)
            path.pop()
        return out
    if kind == "map":
        if type(value) is not dict:
            errors.append(_error(struct_name, path, value, "map[string]string"))
            return value
        for v in value.values():
            if type(v) is not str:
                errors.append(_error(struct_name, path, v, "string"))
        return value
    if kind == "array":
        if type(value) is not list:
            errors.append(_error(struct_name, path, value, "[]"))
            return value
        item = t.item
        assert item is not None
        if item.kind in ("string", "integer", "boolean", "number"):
            for v in value:
                if not _scalar_ok(item.kind, v):
                    errors.append(_error(struct_name, path, v, _GO_TYPES[item.kind]))
            return value
        out_list = []
        for i, v in enumerate(value):
            path.append(str(i))
            out_list.append(_walk(v, item, path, struct_name, unknown, errors))
            path.pop()
        return out_list
    if not _scalar_ok(kind, value):
        errors.append(_error(struct_name, path, value, _GO_TYPES[kind]))
    elif kind == "integer" and type(value) is float:
        return int(value)
    return value


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "null"


def decode(body: dict[str, Any], kind: str) -> Decoded:
    """Keep the known fields of a `kind` object, reporting unknown paths and type errors."""
    unknown: list[str] = []
    errors: list[str] = []
    out = _walk(body, obj(kind), [], kind, unknown, errors)
    return Decoded(out, unknown, errors)


def field_type(struct: str, key: str) -> T | None:
    return STRUCTS[struct].get(key)
