"""The API semantics of each verb over the store, as the API server's registry strategies apply
them: decoding with fieldValidation, defaulting, server-set metadata, validation, optimistic
concurrency, status subresources, and deletion with finalizers and propagation policies.

Both the HTTP handlers and the in-process controllers write through here.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Any

from k8s_dispatch.demo.localcluster import apierrors, configdata, defaults, quota, schema, validation
from k8s_dispatch.demo.localcluster.apierrors import ApiError
from k8s_dispatch.demo.localcluster.patching import PatchError, json_patch, merge_patch, strategic_merge_patch
from k8s_dispatch.demo.localcluster.resources import CONFIGMAPS, JOBS, NAMESPACES, PODS, SECRETS, Resource
from k8s_dispatch.demo.localcluster.selectors import SelectorError, from_label_selector_object
from k8s_dispatch.demo.localcluster.store import Entry, Store
from k8s_dispatch.demo.localcluster.timestamps import now, rfc3339

BINDING = Resource("pods/binding", "", "Binding", "", "v1", True, lambda obj: {})  # how binding errors name it
ORPHAN_FINALIZER = "orphan"
FOREGROUND_FINALIZER = "foregroundDeletion"
NAMESPACE_FINALIZER = "kubernetes"
ORPHAN_WARNING = (
    "child pods are preserved by default when jobs are deleted; set propagationPolicy=Background to "
    "remove them or set propagationPolicy=Orphan to suppress this warning"
)
_NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
MAX_GENERATED_BASE = 58  # names generated from generateName stay within 63 characters
FIELD_VALIDATION = ("Ignore", "Warn", "Strict")

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
PATCH_TYPES = (MERGE_PATCH, STRATEGIC_PATCH, JSON_PATCH)


@dataclass
class DeleteOptions:
    propagation_policy: str | None = None
    grace_period_seconds: int | None = None
    preconditions: dict[str, Any] = field(default_factory=dict)
    dry_run: bool = False


@dataclass
class DeleteResult:
    entry: Entry
    removed: bool  # gone from the store (else it waits on finalizers or a graceful pod stop)
    warnings: list[str]


def is_terminal_pod(obj: dict[str, Any]) -> bool:
    return (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def should_vanish(resource: Resource, obj: dict[str, Any]) -> bool:
    """Whether a deleting object has nothing left holding it (finalizers, a running pod)."""
    meta = obj["metadata"]
    if not meta.get("deletionTimestamp") or meta.get("finalizers"):
        return False
    if resource is PODS:
        return (
            is_terminal_pod(obj)
            or not (obj.get("spec") or {}).get("nodeName")
            or meta.get("deletionGracePeriodSeconds") == 0
        )
    if resource is NAMESPACES:
        return not (obj.get("spec") or {}).get("finalizers")
    return True


def new_uid() -> str:
    """A random (version 4) UUID as text, as str(uuid.uuid4()) without building a UUID object."""
    h = os.urandom(16).hex()
    return f"{h[:8]}-{h[8:12]}-4{h[13:16]}-{'89ab'[int(h[16], 16) & 3]}{h[17:20]}-{h[20:]}"


def _random_suffix(n: int = 5) -> str:
    return "".join(random.choices(_NAME_ALPHABET, k=n))


class Registry:
    def __init__(self, store: Store) -> None:
        self.store = store

    # --- decoding --------------------------------------------------------------------

    def decode(
        self, resource: Resource, body: Any, *, field_validation: str | None, patch: bool = False
    ) -> tuple[dict[str, Any], list[str]]:
        """Typed decoding of a request body: unknown fields dropped (Warn/Ignore) or rejected
        (Strict), wrong JSON types rejected. Returns the object and warnings."""
        mode = field_validation or "Warn"
        if mode not in FIELD_VALIDATION:
            raise apierrors.bad_request(f"fieldValidation parameter unsupported: {mode}")
        prefix = f'{resource.kind} in version "{resource.version}" cannot be handled as a {resource.kind}'
        if not isinstance(body, dict):
            raise apierrors.bad_request(
                f"{prefix}: json: cannot unmarshal {type(body).__name__} into Go value of type struct"
            )
        kind, api_version = body.get("kind"), body.get("apiVersion")
        if kind and kind != resource.kind:
            raise apierrors.bad_request(
                f'{kind} in version "{resource.version}" cannot be handled as a {resource.kind}: no kind "{kind}" is registered'
            )
        if api_version and api_version != resource.api_version:
            raise apierrors.bad_request(
                f"the API version in the data ({api_version}) does not match the expected API version ({resource.api_version})"
            )
        decoded = schema.decode(body, resource.kind)
        if decoded.type_errors:
            raise apierrors.bad_request(f"{prefix}: {decoded.type_errors[0]}")
        warnings = [f'unknown field "{p}"' for p in decoded.unknown]
        if warnings and mode == "Strict":
            raise apierrors.bad_request(f"{prefix}: strict decoding error: " + ", ".join(warnings))
        obj = decoded.obj
        if resource is SECRETS or resource is CONFIGMAPS:
            error = configdata.decode(obj, resource.kind)
            if error is not None:
                raise apierrors.bad_request(f"{prefix}: {error}")
        obj["apiVersion"] = resource.api_version
        obj["kind"] = resource.kind
        if not isinstance(obj.get("metadata"), dict):
            obj["metadata"] = {}
        return obj, (warnings if mode == "Warn" else [])

    # --- namespaces ------------------------------------------------------------------

    def ensure_namespace(self, name: str) -> None:
        """Namespaces come into being on first use (a convenience of this local cluster)."""
        entry = self.store.get(NAMESPACES, "", name)
        if entry is None:
            if not validation.validate_name(name, label=True):
                self._insert_new(NAMESPACES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
            return
        if entry.meta.get("deletionTimestamp"):
            raise apierrors.forbidden_request(
                NAMESPACES, name, f"unable to create new content in namespace {name} because it is being terminated"
            )

    # --- create ----------------------------------------------------------------------

    def create(
        self,
        resource: Resource,
        namespace: str,
        body: Any,
        *,
        field_validation: str | None = None,
        dry_run: bool = False,
    ) -> tuple[Entry | dict[str, Any], list[str]]:
        obj, warnings = self.decode(resource, body, field_validation=field_validation)
        meta = obj["metadata"]
        if resource.namespaced:
            if meta.get("namespace") and meta["namespace"] != namespace:
                raise apierrors.bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request"
                )
            meta["namespace"] = namespace
        if meta.get("resourceVersion"):
            raise apierrors.bad_request("resourceVersion should not be set on objects to be created")
        if dry_run:
            self._prepare_create(resource, obj)
            return obj, warnings
        if resource.namespaced:
            self.ensure_namespace(namespace)
        if resource is JOBS:
            self._check_job_quota(namespace, meta.get("name") or meta.get("generateName") or "")
        return self._insert_new(resource, obj), warnings

    def _check_job_quota(self, namespace: str, name: str) -> None:
        entry = self.store.get(NAMESPACES, "", namespace)
        if entry is None:
            return
        refusal = quota.job_create_refusal(entry.meta, name=name, used=self.store.count(JOBS, namespace))
        if refusal is not None:
            raise refusal

    def create_internal(self, resource: Resource, obj: dict[str, Any]) -> Entry:
        """Create from a controller: no decoding, and no validation (it builds from validated objects)."""
        if resource.namespaced:
            self.ensure_namespace(obj["metadata"]["namespace"])
        return self._insert_new(resource, obj, validate=False)

    def _prepare_create(self, resource: Resource, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        if not meta.get("name") and meta.get("generateName"):
            for _ in range(8):
                meta["name"] = meta["generateName"][:MAX_GENERATED_BASE] + _random_suffix()
                if self.store.get(resource, meta.get("namespace", ""), meta["name"]) is None:
                    break
        uid = new_uid()
        for k in ("deletionTimestamp", "deletionGracePeriodSeconds", "managedFields", "selfLink"):
            meta.pop(k, None)
        meta["uid"] = uid
        meta["creationTimestamp"] = rfc3339(now())
        if resource is JOBS:
            meta["generation"] = 1
            obj["status"] = {}
            defaults.default_job(obj)
            if meta.get("name"):
                defaults.generate_job_selector(obj, uid)
        elif resource is PODS:
            obj["status"] = {"phase": "Pending", "qosClass": "BestEffort"}
            defaults.default_pod(obj)
        elif resource is NAMESPACES:
            obj["spec"] = {"finalizers": [NAMESPACE_FINALIZER]}
            obj["status"] = {"phase": "Active"}
            labels = dict(meta.get("labels") or {})
            labels["kubernetes.io/metadata.name"] = meta.get("name", "")
            meta["labels"] = labels

    def _validate(self, resource: Resource, obj: dict[str, Any]) -> list[apierrors.FieldError]:
        if resource is JOBS:
            spec = obj.get("spec") or {}
            try:
                selects = from_label_selector_object(spec.get("selector")).matches(
                    ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
                )
            except SelectorError:
                selects = False
            return validation.validate_job(obj, selector_matches=selects)
        if resource is PODS:
            return validation.validate_pod(obj)
        if resource is NAMESPACES:
            return validation.validate_namespace(obj)
        errs = validation.validate_metadata(obj.get("metadata") or {}, namespaced=resource.namespaced)
        if resource is SECRETS:
            errs += configdata.validate_secret(obj)
        elif resource is CONFIGMAPS:
            errs += configdata.validate_config_map(obj)
        return errs

    def _insert_new(self, resource: Resource, obj: dict[str, Any], *, validate: bool = True) -> Entry:
        self._prepare_create(resource, obj)
        meta = obj["metadata"]
        errs = self._validate(resource, obj) if validate else []
        if errs:
            raise apierrors.invalid(resource, meta.get("name") or meta.get("generateName") or "", errs)
        if self.store.get(resource, meta.get("namespace", "") if resource.namespaced else "", meta["name"]) is not None:
            raise apierrors.already_exists(resource, meta["name"])
        return self.store.insert(resource, obj)

    # --- read ------------------------------------------------------------------------

    def get(self, resource: Resource, namespace: str, name: str) -> Entry:
        entry = self.store.get(resource, namespace if resource.namespaced else "", name)
        if entry is None:
            raise apierrors.not_found(resource, name)
        return entry

    # --- update and patch ------------------------------------------------------------

    def update(
        self,
        resource: Resource,
        namespace: str,
        name: str,
        body: Any,
        *,
        subresource: str | None = None,
        field_validation: str | None = None,
    ) -> tuple[Entry, list[str]]:
        old = self.get(resource, namespace, name)
        new, warnings = self.decode(resource, body, field_validation=field_validation)
        return self._update(old, new, subresource=subresource), warnings

    def patch(
        self,
        resource: Resource,
        namespace: str,
        name: str,
        patch_type: str,
        patch: Any,
        *,
        subresource: str | None = None,
        field_validation: str | None = None,
    ) -> tuple[Entry, list[str]]:
        old = self.get(resource, namespace, name)
        try:
            if patch_type == MERGE_PATCH:
                if not isinstance(patch, dict):
                    raise PatchError("merge patch must be a JSON object")
                patched = merge_patch(old.obj, patch)
            elif patch_type == STRATEGIC_PATCH:
                patched = strategic_merge_patch(old.obj, patch, resource.kind)
            elif patch_type == JSON_PATCH:
                patched = json_patch(old.obj, patch)
            else:
                raise apierrors.unsupported_media_type(patch_type)
        except PatchError as e:
            if patch_type == JSON_PATCH:
                raise ApiError(422, "Invalid", str(e)) from e
            raise apierrors.bad_request(str(e)) from e
        new, warnings = self.decode(resource, patched, field_validation=field_validation)
        return self._update(old, new, subresource=subresource), warnings

    def _update(self, old: Entry, new: dict[str, Any], *, subresource: str | None) -> Entry:
        resource = old.resource
        nmeta = new["metadata"]
        if nmeta.get("name") and nmeta["name"] != old.name:
            raise apierrors.bad_request(
                f"the name of the object ({nmeta['name']}) does not match the name on the URL ({old.name})"
            )
        if resource.namespaced and nmeta.get("namespace") and nmeta["namespace"] != old.namespace:
            raise apierrors.bad_request(
                "the namespace of the provided object does not match the namespace sent on the request"
            )
        if nmeta.get("resourceVersion") and nmeta["resourceVersion"] != old.meta["resourceVersion"]:
            raise apierrors.conflict(resource, old.name, apierrors.STALE_WRITE)
        meta = dict(nmeta)
        for k in (
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "generation",
            "namespace",
            "name",
        ):
            if k in old.meta:
                meta[k] = old.meta[k]
            else:
                meta.pop(k, None)
        if subresource == "status":
            # As kube-apiserver's status strategies: the spec stays, metadata changes are kept
            # (a Pod's owner references excepted: old kubelets corrupted them).
            obj = {**old.obj, "metadata": meta, "status": new.get("status") or {}}
            if resource is PODS:
                meta.pop("ownerReferences", None)
                if "ownerReferences" in old.meta:
                    meta["ownerReferences"] = old.meta["ownerReferences"]
            errs = validation.validate_labels(meta.get("labels"), "metadata.labels")
            errs += validation.validate_annotations(meta.get("annotations"), "metadata.annotations")
            errs += validation.validate_metadata_update(old.obj, obj)
            if resource is JOBS:
                errs += validation.validate_job_status(obj, old.obj)
            if errs:
                raise apierrors.invalid(resource, old.name, errs)
        else:
            obj = dict(new)
            if "status" in old.obj:
                obj["status"] = old.obj["status"]
            else:
                obj.pop("status", None)
            if resource is JOBS and old.obj.get("spec") != obj.get("spec"):
                meta["generation"] = old.meta.get("generation", 1) + 1
            obj["metadata"] = meta
            if resource is NAMESPACES:
                obj["spec"] = old.obj.get("spec") or {}
            errs = self._validate_update(old, obj)
            if errs:
                raise apierrors.invalid(resource, old.name, errs)
        return self.write(old, obj)

    def _validate_update(self, old: Entry, obj: dict[str, Any]) -> list[apierrors.FieldError]:
        resource = old.resource
        meta = obj["metadata"]
        errs = validation.validate_labels(meta.get("labels"), "metadata.labels")
        errs += validation.validate_annotations(meta.get("annotations"), "metadata.annotations")
        errs += validation.validate_metadata_update(old.obj, obj)
        if resource is JOBS:
            errs += self._validate(resource, obj)
            errs += validation.validate_job_update(old.obj, obj)
        elif resource is PODS:
            errs += validation.validate_pod_update(old.obj, obj)
        elif resource is SECRETS or resource is CONFIGMAPS:
            errs += configdata.validate_update(old.obj, obj, resource.kind)
            check = configdata.validate_secret if resource is SECRETS else configdata.validate_config_map
            errs += check(obj)
        return errs

    def write(self, old: Entry, obj: dict[str, Any]) -> Entry:
        """Store a new version of `old` (no validation). A deleting object whose last finalizer
        is gone leaves the store here, with one DELETED event."""
        if should_vanish(old.resource, obj):
            return self.store.remove(old, obj)
        return self.store.replace(old, obj)

    # --- delete ----------------------------------------------------------------------

    def delete(
        self, resource: Resource, namespace: str, name: str, options: DeleteOptions | None = None
    ) -> DeleteResult:
        options = options or DeleteOptions()
        old = self.get(resource, namespace, name)
        pre = options.preconditions or {}
        if pre.get("uid") and pre["uid"] != old.uid:
            raise apierrors.conflict(
                resource, name, f"Precondition failed: UID in precondition: {pre['uid']}, UID in object meta: {old.uid}"
            )
        if pre.get("resourceVersion") and pre["resourceVersion"] != old.meta["resourceVersion"]:
            raise apierrors.conflict(
                resource,
                name,
                f"Precondition failed: ResourceVersion in precondition: {pre['resourceVersion']}, ResourceVersion in object meta: {old.meta['resourceVersion']}",
            )
        policy = options.propagation_policy
        if policy not in (None, "Orphan", "Background", "Foreground"):
            raise apierrors.invalid(
                resource,
                name,
                [apierrors.not_supported("propagationPolicy", policy, ["Foreground", "Background", "Orphan", "nil"])],
            )
        warnings: list[str] = []
        if policy is None:
            if resource is JOBS:
                policy = "Orphan"
                warnings.append(ORPHAN_WARNING)
            else:
                policy = "Background"
        if options.dry_run:
            return DeleteResult(old, False, warnings)
        meta = old.meta
        finalizers = list(meta.get("finalizers") or [])
        if resource is JOBS:
            if policy == "Orphan" and ORPHAN_FINALIZER not in finalizers:
                finalizers.append(ORPHAN_FINALIZER)
            if policy == "Foreground" and FOREGROUND_FINALIZER not in finalizers:
                finalizers.append(FOREGROUND_FINALIZER)
        grace = 0
        if resource is PODS:
            requested = options.grace_period_seconds
            if requested is None:
                requested = (old.obj.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
            grace = max(0, requested)
        already = bool(meta.get("deletionTimestamp"))
        if already:
            new_meta = (
                {**meta, "finalizers": finalizers}
                if finalizers
                else {k: v for k, v in meta.items() if k != "finalizers"}
            )
            if resource is PODS and grace < (meta.get("deletionGracePeriodSeconds") or 0):
                new_meta["deletionGracePeriodSeconds"] = grace
            obj = {**old.obj, "metadata": new_meta}
            if obj == old.obj:
                return DeleteResult(old, False, warnings)
            entry = self.write(old, obj)
            return DeleteResult(entry, self.store.get(resource, old.namespace, name) is None, warnings)
        ts = now()
        new_meta = dict(meta)
        new_meta["deletionTimestamp"] = rfc3339(ts + grace)
        new_meta["deletionGracePeriodSeconds"] = grace
        if finalizers:
            new_meta["finalizers"] = finalizers
        if resource is JOBS:
            new_meta["generation"] = meta.get("generation", 1) + 1
        obj = {**old.obj, "metadata": new_meta}
        if resource is NAMESPACES:
            obj["status"] = {**(old.obj.get("status") or {}), "phase": "Terminating"}
        if should_vanish(resource, obj):
            final = self.store.remove(old, obj if resource is not NAMESPACES else old.obj)
            return DeleteResult(final, True, warnings)
        return DeleteResult(self.store.replace(old, obj), False, warnings)

    # --- pods/binding ----------------------------------------------------------------

    def bind(self, namespace: str, name: str, body: Any) -> Entry:
        """POST pods/NAME/binding, as the scheduler binds: sets spec.nodeName and PodScheduled=True
        on a Pod that has no node yet; the Binding's metadata.uid, if set, must be the Pod's."""
        if not isinstance(body, dict) or body.get("kind") not in (None, "Binding"):
            raise apierrors.bad_request("the body of the request must be a v1 Binding")
        target = body.get("target") or {}
        node = target.get("name") if isinstance(target, dict) else None
        if not node or not isinstance(node, str):  # kube-apiserver answers this one with a 500
            raise ApiError(500, "InternalError", "target.name: Required value")
        if isinstance(target, dict) and target.get("kind") not in (None, "", "Node"):
            raise apierrors.invalid(
                BINDING, name, [apierrors.not_supported("target.kind", target.get("kind"), ["Node", "<empty>"])]
            )
        old = self.get(PODS, namespace, name)
        uid = (body.get("metadata") or {}).get("uid")
        if uid and uid != old.uid:
            raise apierrors.conflict(
                PODS,
                name,
                (
                    f"StorageError: invalid object, Code: 4, Key: /registry/pods/{namespace}/{name}, ResourceVersion: 0, "
                    f"AdditionalErrorMsg: Precondition failed: UID in precondition: {uid}, UID in object meta: {old.uid}"
                ),
            )
        if old.meta.get("deletionTimestamp"):
            raise apierrors.conflict(BINDING, name, f"pod {name} is being deleted, cannot be assigned to a host")
        assigned = (old.obj.get("spec") or {}).get("nodeName")
        if assigned:
            raise apierrors.conflict(BINDING, name, f'pod {name} is already assigned to node "{assigned}"')
        status = dict(old.obj.get("status") or {})
        scheduled = {
            "type": "PodScheduled",
            "status": "True",
            "lastProbeTime": None,
            "lastTransitionTime": rfc3339(now()),
        }
        status["conditions"] = [c for c in status.get("conditions") or [] if c.get("type") != "PodScheduled"] + [
            scheduled
        ]
        return self.write(old, {**old.obj, "spec": {**old.obj["spec"], "nodeName": node}, "status": status})

    # --- helpers for controllers -----------------------------------------------------

    def remove_finalizer(self, entry: Entry, finalizer: str) -> Entry:
        fins = [f for f in entry.meta.get("finalizers") or [] if f != finalizer]
        meta = dict(entry.meta)
        if fins:
            meta["finalizers"] = fins
        else:
            meta.pop("finalizers", None)
        return self.write(entry, {**entry.obj, "metadata": meta})

    def set_status(self, entry: Entry, status: dict[str, Any]) -> Entry:
        return self.write(entry, {**entry.obj, "status": status})
