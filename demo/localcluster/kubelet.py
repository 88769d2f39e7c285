"""The kubelet's decisions for the Pods of one node, wherever they are stored: runs each Pod's
first container through a runner (exec or simulate), reports Pod status, enforces the Pod's
activeDeadlineSeconds, restarts containers of restartPolicy OnFailure pods, stops containers of
deleting pods, evicts the Pods the annotation `evict-attempts` asks for (through the host's
Eviction API, as a drain does) and, after a restart, treats pods left running without a process as lost.
A container whose env reads a missing Secret, ConfigMap or key waits (CreateContainerConfigError)
and starts once the host says that source changed (`source_changed`).

Where the Pods live is a `PodHost`: `StoreHost` here (localcluster's own store, in process) or
the node agent's remote API server (demo/localcluster/node.py). Hosts feed changes in with `mark` and
`forget`; the Kubelet reacts through a deferred queue, never writing inside an event callback.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any, Protocol

from k8s_dispatch.demo.localcluster import containerenv, eviction, podstatus, simrunner, startfaults
from k8s_dispatch.demo.localcluster.apierrors import ApiError
from k8s_dispatch.demo.localcluster.execrunner import ExecRunner
from k8s_dispatch.demo.localcluster.podstatus import NODE_NAME, ContainerResult
from k8s_dispatch.demo.localcluster.registry import Registry, is_terminal_pod
from k8s_dispatch.demo.localcluster.resources import CONFIGMAPS, PODS, SECRETS
from k8s_dispatch.demo.localcluster.simrunner import SimRunner
from k8s_dispatch.demo.localcluster.store import DELETED, Entry, Event
from k8s_dispatch.demo.localcluster.timestamps import now, parse_rfc3339

Key = tuple[str, str]
DEADLINE_MESSAGE = "Pod was active on the node longer than the specified deadline"
LOST_MESSAGE = "The container could not be located when the pod was terminated"
SHUTDOWN_MESSAGE = "Pod was terminated in response to imminent node shutdown."
CONFIG_ERROR = "CreateContainerConfigError"


class PodHost(Protocol):
    """Where the Pods are: what the Kubelet reads, and where its bindings and reports go."""

    node_name: str

    def keys(self) -> list[Key]: ...

    def pod(self, key: Key) -> dict[str, Any] | None:
        """The Pod as this node knows it (its status as last reported here), or None."""

    def bind(self, pod: dict[str, Any]) -> dict[str, Any] | None:
        """Bind an unbound Pod to this node: the bound Pod to run now, or None when the binding
        completes later (the bound Pod then comes back through `mark`)."""

    def report(self, pod: dict[str, Any], status: dict[str, Any]) -> None:
        """Store `pod` (as returned by `pod` or `bind`) with this status."""

    def evict(self, pod: dict[str, Any]) -> None:
        """Evict `pod` through the API's Eviction subresource (as a drain does); the Pod's
        deletion then comes back through `mark`."""

    def env_source(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The Secret or ConfigMap (`kind`) a container's env reads, as known here, or None; a
        change to one comes back through the Kubelet's `source_changed`."""


def has_started(pod: dict[str, Any]) -> bool:
    """Whether a container of this Pod ever started (so a Pod with no process is lost, not new)."""
    status = pod.get("status") or {}
    if status.get("phase") == "Running":
        return True
    cs = (status.get("containerStatuses") or [{}])[0]
    state = cs.get("state") or {}
    return "running" in state or "terminated" in state or bool(cs.get("lastState"))


@dataclass
class _PodRun:
    key: Key
    uid: str
    restart_count: int = 0
    stopping: bool = False
    started_at: float | None = None
    reason: str | None = None  # pod-level failure reason (DeadlineExceeded, Terminated)
    deadline: asyncio.TimerHandle | None = None
    restart: asyncio.TimerHandle | None = None
    eviction: asyncio.TimerHandle | None = None
    last_state: dict[str, Any] | None = None
    env: dict[str, str] | None = None  # resolved at admission, used again by a restart


class Kubelet:
    def __init__(
        self,
        host: PodHost,
        runner: ExecRunner | SimRunner,
        *,
        loop: asyncio.AbstractEventLoop,
        restart_backoff: float = 0.2,
    ) -> None:
        self.host = host
        self.runner = runner
        self._loop = loop
        self._restart_backoff = restart_backoff
        self._runs: dict[str, _PodRun] = {}  # by pod uid
        self._by_key: dict[Key, str] = {}
        self._dirty: dict[Key, None] = {}
        self._scheduled = False
        self._idle = asyncio.Event()
        self._evicted: dict[str, int] = {}  # Job uid -> its Pods this node has evicted (evict-attempts)
        self._blocked: dict[str, tuple[Key, containerenv.Source]] = {}  # pod uid -> its key, what it waits for

    def start(self) -> None:
        """Look at every pod once (after a restart: pending pods start, running ones are lost)."""
        for key in self.host.keys():  # noqa: SIM118 - a PodHost, not a dict
            self.mark(key)

    # --- event intake ----------------------------------------------------------------

    def mark(self, key: Key) -> None:
        """The Pod at `key` changed: look at it again soon."""
        self._dirty[key] = None
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._scheduled = False
        budget = 2000
        while self._dirty and budget:
            key = next(iter(self._dirty))
            del self._dirty[key]
            budget -= 1
            self._sync(key)
        if self._dirty and not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._drain)

    def source_changed(self, kind: str, namespace: str, name: str) -> None:
        """A Secret or ConfigMap was written: look again at the Pods whose container waits for it."""
        for key, source in list(self._blocked.values()):
            if source == (kind, namespace, name):
                self.mark(key)

    def forget(self, uid: str) -> None:
        """The pod is gone from the host: stop what still runs and drop its logs."""
        self._blocked.pop(uid, None)
        run = self._runs.pop(uid, None)
        if run is not None:
            self._drop(run)
        if self.runner.running(uid):
            self.runner.stop(uid, 0)
        self.runner.forget(uid)

    def _drop(self, run: _PodRun) -> None:
        self._runs.pop(run.uid, None)
        if self._by_key.get(run.key) == run.uid:
            del self._by_key[run.key]
        for handle in (run.deadline, run.restart, run.eviction):
            if handle is not None:
                handle.cancel()
        if not self._runs:
            self._idle.set()

    # --- reconcile one pod -----------------------------------------------------------

    def _sync(self, key: Key) -> None:
        obj = self.host.pod(key)
        if obj is None:
            return
        uid = obj["metadata"].get("uid", "")
        run = self._runs.get(uid)
        if is_terminal_pod(obj):
            return
        node = (obj.get("spec") or {}).get("nodeName")
        if obj["metadata"].get("deletionTimestamp"):
            if run is not None:
                if not run.stopping:
                    run.stopping = True
                    if run.restart is not None:
                        run.restart.cancel()
                        self._finish(run, ContainerResult(137, "Error", "", run.started_at, now()))
                        return
                    grace = obj["metadata"].get("deletionGracePeriodSeconds") or 0
                    self.runner.stop(uid, grace)
            elif node == self.host.node_name:
                self.host.report(
                    obj,
                    podstatus.terminated(
                        obj, ContainerResult(137, "ContainerStatusUnknown", LOST_MESSAGE, None, now()), container_id=""
                    ),
                )
            return
        if run is not None:
            return
        if not node and startfaults.unschedulable(obj):
            # No node fits (the annotation says): this node, acting as the scheduler, binds
            # nothing and says so once, as kube-scheduler does.
            if not startfaults.shows_unschedulable(obj):
                self.host.report(obj, startfaults.unschedulable_status(obj, now()))
            return
        if not node:
            bound = self.host.bind(obj)
            if bound is not None:
                self._admit(key, uid, bound)
        elif node == self.host.node_name:
            if has_started(obj):
                self._recover(key, uid, obj)
            else:
                self._admit(key, uid, obj)

    def _new_run(self, key: Key, uid: str) -> _PodRun:
        run = _PodRun(key, uid)
        self._runs[uid] = run
        self._by_key[key] = uid
        self._idle.clear()
        return run

    def _admit(self, key: Key, uid: str, pod: dict[str, Any]) -> None:
        stuck = startfaults.waiting(pod)
        if stuck is not None:  # its container never starts: Pending, waiting, reported once
            if not startfaults.shows_waiting(pod, stuck[0]):
                self.host.report(pod, startfaults.waiting_status(pod, now(), *stuck))
            return
        container = ((pod.get("spec") or {}).get("containers") or [{}])[0]
        try:
            env = containerenv.container_env(pod, container, self.host.env_source)
        except containerenv.ConfigError as e:  # waits, reported once per message, until its source changes
            self._blocked[uid] = (key, e.source)
            if (startfaults.waiting_message(pod) or (None, None)) != (CONFIG_ERROR, e.message):
                self.host.report(pod, startfaults.waiting_status(pod, now(), CONFIG_ERROR, e.message))
            return
        self._blocked.pop(uid, None)
        run = self._new_run(key, uid)
        run.env = env
        started = self.runner.start(uid, pod, env=env)
        if started is not None:
            run.started_at = started
            status = podstatus.running(pod, started, container_id=self.runner.container_id(uid))
            self._arm_deadline(run, pod)
        else:
            status = podstatus.waiting(pod, now())
        self.host.report(pod, status)

    def _recover(self, key: Key, uid: str, obj: dict[str, Any]) -> None:
        """A pod bound to this node before a restart: resume a simulated container; a process is gone."""
        if isinstance(self.runner, SimRunner):
            run = self._new_run(key, uid)
            started_at = None
            state = ((obj.get("status") or {}).get("containerStatuses") or [{}])[0].get("state") or {}
            if "running" in state:
                try:
                    started_at = parse_rfc3339(state["running"]["startedAt"])
                except (KeyError, TypeError, ValueError):
                    started_at = None
            run.started_at = self.runner.start(uid, obj, started_at=started_at)
            if "running" not in state:
                self.host.report(
                    obj, podstatus.running(obj, run.started_at, container_id=self.runner.container_id(uid))
                )
            self._arm_deadline(run, obj)
            return
        result = ContainerResult(137, "ContainerStatusUnknown", LOST_MESSAGE, None, now())
        status = podstatus.terminated(
            obj, result, container_id="", disruption="DeletionByPodGC", pod_message="PodGC: node no longer exists"
        )
        self.host.report(obj, status)

    def _arm_eviction(self, run: _PodRun, pod: dict[str, Any]) -> None:
        """The first `evict-attempts` Pods of a Job are evicted `evict-after-ms` into their run."""
        if run.eviction is not None or run.started_at is None:
            return
        want = simrunner.eviction_plan(pod)
        job = simrunner.job_uid(pod)
        if want is None or not job or self._evicted.get(job, 0) >= want.attempts:
            return
        self._evicted[job] = self._evicted.get(job, 0) + 1
        delay = max(0.0, run.started_at + want.after - now())
        run.eviction = self._loop.call_later(delay, self._evict, run.uid)

    def _evict(self, uid: str) -> None:
        run = self._runs.get(uid)
        if run is None or run.stopping:
            return
        run.eviction = None
        obj = self._current(run)
        if obj is not None and not obj["metadata"].get("deletionTimestamp"):
            self.host.evict(obj)

    def _arm_deadline(self, run: _PodRun, pod: dict[str, Any]) -> None:
        self._arm_eviction(run, pod)
        deadline = (pod.get("spec") or {}).get("activeDeadlineSeconds")
        if deadline and run.started_at is not None and run.deadline is None:
            delay = max(0.0, run.started_at + deadline - now())
            run.deadline = self._loop.call_later(delay, self._deadline_exceeded, run.uid)

    def _deadline_exceeded(self, uid: str) -> None:
        self._terminate(uid, "DeadlineExceeded", 0)

    def _terminate(self, uid: str, reason: str, grace: float) -> None:
        """End a Pod for a reason of the node's (its deadline, the node's shutdown)."""
        run = self._runs.get(uid)
        if run is None or run.stopping:
            return
        run.reason = reason
        run.stopping = True
        if run.restart is not None:
            run.restart.cancel()
            self._finish(run, ContainerResult(137, "Error", "", run.started_at, now()))
            return
        self.runner.stop(uid, grace)

    def _current(self, run: _PodRun) -> dict[str, Any] | None:
        obj = self.host.pod(run.key)
        return obj if obj is not None and obj["metadata"].get("uid") == run.uid else None

    # --- runner callbacks ------------------------------------------------------------

    def started(self, uid: str, started_at: float, container_id: str) -> None:
        run = self._runs.get(uid)
        if run is None:
            return
        run.started_at = started_at
        obj = self._current(run)
        if obj is None or is_terminal_pod(obj):
            return
        self.host.report(
            obj,
            podstatus.running(
                obj, started_at, container_id=container_id, restart_count=run.restart_count, last_state=run.last_state
            ),
        )
        self._arm_deadline(run, obj)

    def finished(self, uid: str, result: ContainerResult) -> None:
        run = self._runs.get(uid)
        if run is None:
            return
        obj = self._current(run)
        if obj is None:
            self._drop(run)
            return
        policy = (obj.get("spec") or {}).get("restartPolicy")
        restart = result.exit_code != 0 and not run.stopping and policy in ("OnFailure", "Always")
        if restart:
            run.restart_count += 1
            run.last_state = {"terminated": podstatus.terminated_state(result, self.runner.container_id(uid))}
            delay = min(self._restart_backoff * 2 ** (run.restart_count - 1), 10.0)
            run.restart = self._loop.call_later(delay, self._restart, uid)
            cs = podstatus.running(
                obj, result.finished_at, container_id="", restart_count=run.restart_count, last_state=run.last_state
            )
            cs["containerStatuses"][0].update(
                {"state": {"waiting": {"reason": "CrashLoopBackOff"}}, "ready": False, "started": False}
            )
            cs["containerStatuses"][0].pop("containerID", None)
            self.host.report(obj, cs)
            return
        self._finish(run, result)

    def _restart(self, uid: str) -> None:
        run = self._runs.get(uid)
        if run is None:
            return
        run.restart = None
        obj = self._current(run)
        if obj is None or run.stopping:
            return
        started = self.runner.start(uid, obj, env=run.env)
        if started is not None:
            self.started(uid, started, self.runner.container_id(uid))

    def _finish(self, run: _PodRun, result: ContainerResult) -> None:
        self._drop(run)
        obj = self._current(run)
        if obj is None or is_terminal_pod(obj):
            return
        message = {"DeadlineExceeded": DEADLINE_MESSAGE, "Terminated": SHUTDOWN_MESSAGE}.get(run.reason or "")
        status = podstatus.terminated(
            obj,
            result,
            container_id=self.runner.container_id(run.uid) if result.started_at else "",
            restart_count=run.restart_count,
            pod_reason=run.reason,
            pod_message=message,
            disruption="TerminationByKubelet" if run.reason == "Terminated" else None,
        )
        self.host.report(obj, status)

    # --- logs ------------------------------------------------------------------------

    def logs(self, entry: Entry) -> bytes:
        return self.runner.logs(entry.uid)

    async def shutdown(self, *, timeout: float) -> None:
        """The node shuts down: stop every container with its Pod's grace period (the runner caps
        it) and report its Pod Failed (reason Terminated, a DisruptionTarget condition), as a
        kubelet's graceful node shutdown does."""
        for uid, run in list(self._runs.items()):
            pod = self._current(run) or {}
            grace = (pod.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
            self._terminate(uid, "Terminated", grace)
        if self._runs:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), timeout)

    async def close(self) -> None:
        for run in self._runs.values():
            for handle in (run.deadline, run.restart):
                if handle is not None:
                    handle.cancel()
        await self.runner.close()


class StoreHost:
    """localcluster's own store as the Kubelet's host: reads are the store's, a binding is written
    with the Pod's first status report, and every store event on a Pod reaches the Kubelet."""

    node_name = NODE_NAME

    def __init__(self, registry: Registry, *, loop: asyncio.AbstractEventLoop) -> None:
        self.registry = registry
        self.store = registry.store
        self._loop = loop
        self._writing = False
        self.kubelet: Kubelet | None = None
        self.store.subscribe(self._on_event)

    def _on_event(self, event: Event) -> None:
        if self.kubelet is None:
            return
        entry = event.entry
        if entry.resource is SECRETS or entry.resource is CONFIGMAPS:
            if event.type != DELETED:
                self.kubelet.source_changed(entry.resource.kind, entry.namespace, entry.name)
            return
        if event.entry.resource is not PODS:
            return
        if event.type == DELETED:
            self._loop.call_soon(self.kubelet.forget, event.entry.uid)
            return
        if self._writing:
            return  # our own status report: what it changed is already in hand
        self.kubelet.mark((event.entry.namespace, event.entry.name))

    def keys(self) -> list[Key]:
        return [(e.namespace, e.name) for e in self.store.list(PODS)]

    def pod(self, key: Key) -> dict[str, Any] | None:
        entry = self.store.get(PODS, *key)
        return entry.obj if entry is not None else None

    def env_source(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        entry = self.store.get(SECRETS if kind == "Secret" else CONFIGMAPS, namespace, name)
        return entry.obj if entry is not None else None

    def bind(self, pod: dict[str, Any]) -> dict[str, Any]:
        return {**pod, "spec": {**pod["spec"], "nodeName": NODE_NAME}}

    def evict(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        body = {"kind": "Eviction", "deleteOptions": {"preconditions": {"uid": meta.get("uid")}}}
        with contextlib.suppress(ApiError):  # gone, or replaced, meanwhile
            eviction.evict(self.registry, meta.get("namespace", ""), meta["name"], body)

    def report(self, pod: dict[str, Any], status: dict[str, Any]) -> None:
        meta = pod["metadata"]
        entry = self.store.get(PODS, meta.get("namespace", ""), meta["name"])
        if entry is None or entry.uid != meta.get("uid"):
            return
        self._writing = True
        try:
            self.registry.write(entry, {**pod, "status": status})
        finally:
            self._writing = False
