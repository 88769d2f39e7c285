"""The Job controller: keeps each Job's Pods and status in line with its spec by applying the
decisions of jobsync.plan_job: counts finished Pods (then drops their tracking finalizer),
creates Pods from the template (generateName, ownerReferences, the template's finalizers and
its own tracking one), deletes Pods that must stop, writes status, deletes Jobs whose TTL ran
out, and looks again when a deadline, backoff or TTL falls due (loop.call_at, one timer per Job).
A Job that fails gets a Warning Event with its condition's reason, as the real controller records.

It also releases the tracking finalizer of finished Pods whose Job is gone (orphans).

An Indexed Job is decided by demo/localcluster/indexedjob.py and enacted in the real controller's
order: deletes and creates, the status with the newly finished Pods (failed ones' uids in
uncountedTerminatedPods), their tracking finalizers off, then the status with them counted.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from typing import Any

from k8s_dispatch.demo.localcluster import events
from k8s_dispatch.demo.localcluster.apierrors import ApiError
from k8s_dispatch.demo.localcluster.indexedjob import BackoffRecord, IndexedPod, add_index, indexed_pod, plan_indexed
from k8s_dispatch.demo.localcluster.jobsync import TRACKING_FINALIZER, is_finished, plan_job, pod_view
from k8s_dispatch.demo.localcluster.registry import DeleteOptions, Registry, is_terminal_pod
from k8s_dispatch.demo.localcluster.resources import JOBS, PODS
from k8s_dispatch.demo.localcluster.store import DELETED, Entry, Event
from k8s_dispatch.demo.localcluster.timestamps import now

Key = tuple[str, str]


def controller_ref(obj: dict[str, Any]) -> dict[str, Any] | None:
    refs: list[dict[str, Any]] = obj["metadata"].get("ownerReferences") or []
    for ref in refs:
        if ref.get("controller"):
            return ref
    return None


def pod_from_template(job: Entry) -> dict[str, Any]:
    template = job.obj["spec"]["template"]
    tmeta = template.get("metadata") or {}
    meta: dict[str, Any] = {
        "generateName": f"{job.name}-",
        "namespace": job.namespace,
        "labels": dict(tmeta.get("labels") or {}),
        "ownerReferences": [
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "name": job.name,
                "uid": job.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
        # the template's finalizers, then the controller's own (pkg/controller/job appends it)
        "finalizers": [*(f for f in tmeta.get("finalizers") or [] if f != TRACKING_FINALIZER), TRACKING_FINALIZER],
    }
    if tmeta.get("annotations"):
        meta["annotations"] = dict(tmeta["annotations"])
    # stored objects are never mutated: share the template's insides, copying the levels defaulting touches
    spec = dict(template.get("spec") or {})
    for key in ("containers", "initContainers"):
        if key in spec:
            spec[key] = [dict(c) for c in spec[key]]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


class JobController:
    def __init__(
        self,
        registry: Registry,
        *,
        loop: asyncio.AbstractEventLoop,
        backoff_base: float = 0.1,
        backoff_max: float = 10.0,
        coalesce: float = 0.002,
        pod_batch: float = 0.05,
    ) -> None:
        self.registry = registry
        self.store = registry.store
        self._loop = loop
        self._backoff_base = backoff_base
        self._backoff_max = backoff_max
        self._dirty: dict[Key, None] = {}  # to sync at the next drain
        self._batched: dict[Key, float] = {}  # to sync at the loop time given (Pod events)
        self._batch_queue: deque[tuple[float, Key]] = deque()  # the same, in due order
        self._batch_timer: asyncio.TimerHandle | None = None
        self._pod_batch = pod_batch
        self._orphans: dict[Key, None] = {}
        self._scheduled = False
        self._timers: dict[Key, tuple[float, asyncio.TimerHandle]] = {}
        self._start_at: dict[str, float] = {}
        self._finished_at: dict[str, float] = {}
        self._last_failure: dict[str, float] = {}
        self._backoff: dict[str, BackoffRecord] = {}  # an Indexed Job's failures since its last success
        # an Indexed Job's Pods as last seen (uid -> resourceVersion, view): a big Job's thousands
        # of finished Pods are looked at by every sync, and most have not changed since the last
        self._views: dict[str, dict[str, tuple[str, IndexedPod]]] = {}
        self._syncing = False
        self._coalesce = coalesce
        self.store.subscribe(self._on_event)

    def start(self) -> None:
        for entry in self.store.list(JOBS):
            self._mark((entry.namespace, entry.name))
        for entry in self.store.list(PODS):
            self._on_pod(entry)

    # --- intake ----------------------------------------------------------------------

    def _on_event(self, event: Event) -> None:
        if self._syncing:
            return  # our own writes: the sync that makes them has accounted for them
        entry = event.entry
        if entry.resource is JOBS:
            if event.type == DELETED:
                self._loop.call_soon(self._forget, (entry.namespace, entry.name), entry.uid)
            else:
                self._mark((entry.namespace, entry.name))
        elif entry.resource is PODS:
            self._on_pod(entry)

    def _on_pod(self, pod: Entry) -> None:
        ref = controller_ref(pod.obj)
        if ref is not None and ref.get("kind") == "Job":
            job = self.store.get(JOBS, pod.namespace, ref.get("name", ""))
            if job is not None and job.uid == ref.get("uid"):
                self._mark_batched((pod.namespace, job.name))
                return
        if TRACKING_FINALIZER in (pod.meta.get("finalizers") or []):
            self._orphans[(pod.namespace, pod.name)] = None
            self._schedule()

    def _mark(self, key: Key) -> None:
        self._batched.pop(key, None)
        self._dirty[key] = None
        self._schedule()

    def _mark_batched(self, key: Key) -> None:
        """Sync `key` one batch period from now, unless a sync is already due sooner."""
        if key in self._dirty or key in self._batched:
            return
        if self._pod_batch <= 0:
            self._mark(key)
            return
        due = self._loop.time() + self._pod_batch
        self._batched[key] = due
        self._batch_queue.append((due, key))
        if self._batch_timer is None:
            self._batch_timer = self._loop.call_at(due, self._release)

    def _release(self) -> None:
        """Move the batched Jobs whose time has come to the next drain."""
        self._batch_timer = None
        t = self._loop.time()
        queue = self._batch_queue
        while queue and queue[0][0] <= t:
            due, key = queue.popleft()
            if self._batched.get(key) == due:
                del self._batched[key]
                self._dirty[key] = None
        if self._dirty:
            self._schedule()
        if queue:
            self._batch_timer = self._loop.call_at(queue[0][0], self._release)

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            # a short pause lets the kubelet bind and start new pods first: one sync sees both
            self._loop.call_later(self._coalesce, self._drain)

    def _drain(self) -> None:
        self._scheduled = False
        budget = 1000
        while self._dirty and budget:
            key = next(iter(self._dirty))
            del self._dirty[key]
            budget -= 1
            self._syncing = True
            try:
                self._sync(key)
            finally:
                self._syncing = False
        while self._orphans and budget:
            key = next(iter(self._orphans))
            del self._orphans[key]
            budget -= 1
            self._syncing = True
            try:
                self._sync_orphan(key)
            finally:
                self._syncing = False
        if self._dirty or self._orphans:
            self._schedule()

    def _forget(self, key: Key, uid: str) -> None:
        self._batched.pop(key, None)
        for table in (self._start_at, self._finished_at, self._last_failure, self._backoff, self._views):
            table.pop(uid, None)
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer[1].cancel()
        for plural, ns, name in self.store.owned_by(uid):
            if plural == "pods":
                self._orphans[(ns, name)] = None
        self._schedule()

    def _wake(self, key: Key) -> None:
        self._timers.pop(key, None)
        self._mark(key)

    def _requeue(self, key: Key, when: float) -> None:
        current = self._timers.get(key)
        if current is not None:
            if current[0] <= when:
                return
            current[1].cancel()
        delay = max(0.0, when - now()) + 0.001
        self._timers[key] = (when, self._loop.call_later(delay, self._wake, key))

    # --- sync ------------------------------------------------------------------------

    def _pods_of(self, job: Entry) -> list[Entry]:
        pods = []
        for plural, ns, name in self.store.owned_by(job.uid):
            if plural != "pods":
                continue
            pod = self.store.get(PODS, ns, name)
            ref = controller_ref(pod.obj) if pod is not None else None
            if pod is not None and ref is not None and ref.get("uid") == job.uid:
                pods.append(pod)
        return pods

    def _sync(self, key: Key) -> None:
        job = self.store.get(JOBS, *key)
        if job is None:
            return
        t = now()
        pods = self._pods_of(job)
        if (job.obj.get("spec") or {}).get("completionMode") == "Indexed" and not is_finished(job.obj):
            self._sync_indexed(key, job, pods, t)
            return
        plan = plan_job(
            job.obj,
            [pod_view(p.obj, (job.obj.get("spec") or {}).get("podFailurePolicy")) for p in pods],
            t,
            start_at=self._start_at.get(job.uid),
            finished_at=self._finished_at.get(job.uid),
            last_failure_at=self._last_failure.get(job.uid),
            backoff_base=self._backoff_base,
            backoff_max=self._backoff_max,
        )
        if plan.new_failures:
            self._last_failure[job.uid] = t
        if plan.started:
            self._start_at[job.uid] = t
        if plan.finished:
            self._finished_at[job.uid] = t
        if plan.status != job.obj.get("status"):
            job = self.registry.set_status(job, plan.status)
        if plan.finished:
            failed = next((c for c in plan.status.get("conditions") or [] if c.get("type") == "Failed"), None)
            if failed is not None:  # as the Job controller does: a Warning with the condition's reason
                events.record(
                    self.registry, job, type=events.WARNING, reason=failed.get("reason", ""),
                    message=failed.get("message", ""), component=events.JOB_CONTROLLER,
                )  # fmt: skip
        for view in plan.count:
            pod = self.store.get(PODS, view.namespace, view.name)
            if pod is not None and pod.uid == view.uid:
                self.registry.remove_finalizer(pod, TRACKING_FINALIZER)
        for view in plan.delete:
            self._delete_pod(view.namespace, view.name, view.uid)
        for view in plan.uncount:
            self._delete_pod(view.namespace, view.name, view.uid, uncounted=True)
        for _ in range(plan.create):
            self.registry.create_internal(PODS, pod_from_template(job))
        if plan.delete_job:
            with contextlib.suppress(ApiError):
                self.registry.delete(
                    JOBS,
                    job.namespace,
                    job.name,
                    DeleteOptions(propagation_policy="Background", preconditions={"uid": job.uid}),
                )
            if self.store.get(JOBS, *key) is None:
                self._forget(key, job.uid)
        if plan.requeue_at is not None:
            self._requeue(key, plan.requeue_at)
        elif key in self._timers:
            self._timers.pop(key)[1].cancel()  # nothing left to look at later (a finished Job without TTL)
        if plan.finished and (job.obj.get("spec") or {}).get("ttlSecondsAfterFinished") is not None:
            self._mark(key)  # the finished Job's TTL sync follows; our write's event is not heard

    def _sync_indexed(self, key: Key, job: Entry, pods: list[Entry], t: float) -> None:
        """One sync of an unfinished Indexed Job (a finished one goes through plan_job: its TTL)."""
        policy = (job.obj.get("spec") or {}).get("podFailurePolicy")
        seen = self._views.get(job.uid, {})
        views: dict[str, tuple[str, IndexedPod]] = {}
        for p in pods:
            rv = p.meta.get("resourceVersion", "")
            known = seen.get(p.uid)
            views[p.uid] = known if known is not None and known[0] == rv else (rv, indexed_pod(p.obj, policy))
        self._views[job.uid] = views
        plan = plan_indexed(
            job.obj,
            [view for _, view in views.values()],
            t,
            backoff=self._backoff.get(job.uid, BackoffRecord()),
            backoff_base=self._backoff_base,
            backoff_max=self._backoff_max,
        )
        for view in plan.delete:
            self._delete_pod(view.namespace, view.name, view.uid)
        for view in plan.delete_uncounted:
            self._delete_pod(view.namespace, view.name, view.uid, uncounted=True)
        for new in plan.create:
            pod = pod_from_template(job)
            add_index(pod, job.name, new)
            self.registry.create_internal(PODS, pod)
        if plan.first is not None and plan.first != job.obj.get("status"):
            job = self.registry.set_status(job, plan.first)
        if plan.backoff is not None:
            self._backoff[job.uid] = plan.backoff
        for view in plan.remove_finalizer:
            held = self.store.get(PODS, view.namespace, view.name)
            if held is not None and held.uid == view.uid:
                self.registry.remove_finalizer(held, TRACKING_FINALIZER)
        if plan.final is not None and plan.final != job.obj.get("status"):
            job = self.registry.set_status(job, plan.final)
        if plan.finished is not None:
            self._finished_at[job.uid] = t
            self._backoff.pop(job.uid, None)
            self._views.pop(job.uid, None)
            if plan.finished["type"] == "Failed":
                events.record(
                    self.registry, job, type=events.WARNING, reason=plan.finished.get("reason", ""),
                    message=plan.finished.get("message", ""), component=events.JOB_CONTROLLER,
                )  # fmt: skip
            self._mark(key)  # the finished Job's TTL, if any, is looked at by the next sync
        if plan.requeue_at is not None:
            self._requeue(key, plan.requeue_at)
        elif key in self._timers:
            self._timers.pop(key)[1].cancel()
        if plan.delete or plan.delete_uncounted or plan.remove_finalizer:
            self._mark_batched(key)  # our own writes are not heard: look again at what they changed

    def _delete_pod(self, namespace: str, name: str, uid: str, *, uncounted: bool = False) -> None:
        """Delete a Pod the Job no longer wants. `uncounted` (suspended, past its parallelism): its
        tracking finalizer first, as the Job controller's deleteJobPods does, so that the Pod's end
        is not counted as a failure (a suspend, Kueue's preemption, costs no backoffLimit)."""
        pod = self.store.get(PODS, namespace, name)
        if (
            uncounted
            and pod is not None
            and pod.uid == uid
            and TRACKING_FINALIZER in (pod.meta.get("finalizers") or [])
        ):
            with contextlib.suppress(ApiError):
                self.registry.remove_finalizer(pod, TRACKING_FINALIZER)
        with contextlib.suppress(ApiError):
            self.registry.delete(
                PODS, namespace, name, DeleteOptions(propagation_policy="Background", preconditions={"uid": uid})
            )

    def _sync_orphan(self, key: Key) -> None:
        """A Pod with the tracking finalizer and no live Job: let it go once it stopped."""
        pod = self.store.get(PODS, *key)
        if pod is None or TRACKING_FINALIZER not in (pod.meta.get("finalizers") or []):
            return
        ref = controller_ref(pod.obj)
        if ref is not None:
            job = self.store.get(JOBS, pod.namespace, ref.get("name", ""))
            if job is not None and job.uid == ref.get("uid"):
                self._mark((pod.namespace, job.name))
                return
        # A running one comes back here when the kubelet reports its end; one never bound (no node
        # fits) being deleted never ends, and kube-controller-manager lets it go as well.
        unbound_deleting = pod.meta.get("deletionTimestamp") and not (pod.obj.get("spec") or {}).get("nodeName")
        if is_terminal_pod(pod.obj) or unbound_deleting:
            self.registry.remove_finalizer(pod, TRACKING_FINALIZER)

    def close(self) -> None:
        for _, handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        if self._batch_timer is not None:
            self._batch_timer.cancel()
            self._batch_timer = None
