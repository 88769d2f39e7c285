"""The garbage collector and namespace controller: carries out deletion propagation.

Background: when a Job leaves the store, its Pods are deleted. Foreground: a Job with the
`foregroundDeletion` finalizer has its Pods deleted, and loses the finalizer once none is left.
Orphan: a Job with the `orphan` finalizer has its Pods' ownerReferences to it removed, then
loses the finalizer. A Secret or ConfigMap owned by Jobs goes with them, and at once if it is
written after its owners left (no Job with the uid it names). A deleting Namespace has its
contents deleted and goes once it is empty.
"""

from __future__ import annotations

import asyncio
import contextlib

from k8s_dispatch.demo.localcluster.apierrors import ApiError
from k8s_dispatch.demo.localcluster.registry import (
    FOREGROUND_FINALIZER,
    NAMESPACE_FINALIZER,
    ORPHAN_FINALIZER,
    DeleteOptions,
    Registry,
)
from k8s_dispatch.demo.localcluster.resources import BY_PLURAL, CONFIGMAPS, JOBS, NAMESPACES, PODS, SECRETS
from k8s_dispatch.demo.localcluster.store import DELETED, Entry, Event


class GarbageCollector:
    def __init__(self, registry: Registry, *, loop: asyncio.AbstractEventLoop) -> None:
        self.registry = registry
        self.store = registry.store
        self._loop = loop
        self._gone_owners: dict[str, None] = {}  # uids of owners that left the store
        self._owners: dict[tuple[str, str], None] = {}  # deleting jobs to process
        self._namespaces: dict[str, None] = {}
        self._written: dict[tuple[str, str, str], None] = {}  # (plural, ns, name) of owned Secrets, ConfigMaps
        self._scheduled = False
        self.store.subscribe(self._on_event)

    def start(self) -> None:
        for job in self.store.list(JOBS):
            if job.meta.get("deletionTimestamp"):
                self._owners[(job.namespace, job.name)] = None
        for ns in self.store.list(NAMESPACES):
            if ns.meta.get("deletionTimestamp"):
                self._namespaces[ns.name] = None
        for resource in (SECRETS, CONFIGMAPS):
            for entry in self.store.list(resource):
                if entry.meta.get("ownerReferences"):
                    self._written[(resource.plural, entry.namespace, entry.name)] = None
        self._schedule()

    def _on_event(self, event: Event) -> None:
        entry = event.entry
        if entry.resource is JOBS:
            if event.type == DELETED:
                self._gone_owners[entry.uid] = None
            elif entry.meta.get("deletionTimestamp"):
                self._owners[(entry.namespace, entry.name)] = None
            else:
                return
        elif entry.resource is PODS:
            if event.type != DELETED:
                return
            for ref in entry.meta.get("ownerReferences") or []:
                if ref.get("kind") == "Job":
                    self._owners[(entry.namespace, ref.get("name", ""))] = None
        elif entry.resource is NAMESPACES:
            if event.type == DELETED or not entry.meta.get("deletionTimestamp"):
                return
            self._namespaces[entry.name] = None
        elif entry.resource is SECRETS or entry.resource is CONFIGMAPS:
            if event.type != DELETED and entry.meta.get("ownerReferences"):
                self._written[(entry.resource.plural, entry.namespace, entry.name)] = None
        else:
            return
        if event.type == DELETED and entry.namespace and entry.resource is not NAMESPACES:
            ns = self.store.get(NAMESPACES, "", entry.namespace)
            if ns is not None and ns.meta.get("deletionTimestamp"):
                self._namespaces[entry.namespace] = None
        self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._scheduled = False
        while self._gone_owners:
            uid = next(iter(self._gone_owners))
            del self._gone_owners[uid]
            self._delete_dependents(uid)
        while self._owners:
            key = next(iter(self._owners))
            del self._owners[key]
            job = self.store.get(JOBS, *key)
            if job is not None and job.meta.get("deletionTimestamp"):
                self._process_deleting_owner(job)
        while self._written:
            plural, ns, name = next(iter(self._written))
            del self._written[(plural, ns, name)]
            entry = self.store.get(BY_PLURAL[plural], ns, name)
            if entry is not None and not self._any_owner_alive(entry):
                self._delete(entry)
        while self._namespaces:
            name = next(iter(self._namespaces))
            del self._namespaces[name]
            self._process_namespace(name)

    def _dependents(self, uid: str) -> list[Entry]:
        out = []
        for plural, ns, name in self.store.owned_by(uid):
            entry = self.store.get(BY_PLURAL[plural], ns, name)
            if entry is not None:
                out.append(entry)
        return out

    def _delete(self, entry: Entry, policy: str = "Background") -> None:
        if entry.meta.get("deletionTimestamp"):
            return
        with contextlib.suppress(ApiError):
            self.registry.delete(
                entry.resource,
                entry.namespace,
                entry.name,
                DeleteOptions(propagation_policy=policy, preconditions={"uid": entry.uid}),
            )

    def _delete_dependents(self, uid: str) -> None:
        for dep in self._dependents(uid):
            owners = dep.meta.get("ownerReferences") or []
            alive = [r for r in owners if r.get("uid") != uid and self._owner_alive(dep.namespace, r)]
            if not alive:
                self._delete(dep)

    def _any_owner_alive(self, entry: Entry) -> bool:
        return any(self._owner_alive(entry.namespace, r) for r in entry.meta.get("ownerReferences") or [])

    def _owner_alive(self, namespace: str, ref: dict[str, str]) -> bool:
        if ref.get("kind") != "Job":
            return True
        job = self.store.get(JOBS, namespace, ref.get("name", ""))
        return job is not None and job.uid == ref.get("uid")

    def _process_deleting_owner(self, job: Entry) -> None:
        finalizers = job.meta.get("finalizers") or []
        if ORPHAN_FINALIZER in finalizers:
            for dep in self._dependents(job.uid):
                refs = [r for r in dep.meta.get("ownerReferences") or [] if r.get("uid") != job.uid]
                meta = dict(dep.meta)
                if refs:
                    meta["ownerReferences"] = refs
                else:
                    meta.pop("ownerReferences", None)
                self.registry.write(dep, {**dep.obj, "metadata": meta})
            self.registry.remove_finalizer(job, ORPHAN_FINALIZER)
            return
        if FOREGROUND_FINALIZER in finalizers:
            remaining = self._dependents(job.uid)
            for dep in remaining:
                self._delete(dep, "Foreground" if dep.resource is JOBS else "Background")
            if not self._dependents(job.uid):
                self.registry.remove_finalizer(job, FOREGROUND_FINALIZER)

    def _process_namespace(self, name: str) -> None:
        ns = self.store.get(NAMESPACES, "", name)
        if ns is None or not ns.meta.get("deletionTimestamp"):
            return
        left = 0
        for resource in (JOBS, PODS, SECRETS, CONFIGMAPS):
            for entry in self.store.list(resource, name):
                left += 1
                self._delete(entry)
        if left == 0 and NAMESPACE_FINALIZER in ((ns.obj.get("spec") or {}).get("finalizers") or []):
            spec = {**(ns.obj.get("spec") or {}), "finalizers": []}
            self.registry.write(ns, {**ns.obj, "spec": spec})
