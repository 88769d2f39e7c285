"""The one node: binds each new Pod to itself, runs its first container through a runner (exec
or simulate), reports Pod status, enforces the Pod's activeDeadlineSeconds, restarts containers
of restartPolicy OnFailure pods, stops containers of deleting pods and, after a server restart,
treats pods left running without a process as lost with their node.

It reacts to store events through a deferred queue, never writing inside an event callback.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from localcluster import podstatus
from localcluster.execrunner import ExecRunner
from localcluster.podstatus import NODE_NAME, ContainerResult
from localcluster.registry import Registry, is_terminal_pod
from localcluster.resources import PODS
from localcluster.simrunner import SimRunner
from localcluster.store import DELETED, Entry, Event
from localcluster.timestamps import now, parse_rfc3339

Key = tuple[str, str]
DEADLINE_MESSAGE = "Pod was active on the node longer than the specified deadline"
LOST_MESSAGE = "The container could not be located when the pod was terminated"


@dataclass
class _PodRun:
    key: Key
    uid: str
    restart_count: int = 0
    stopping: bool = False
    started_at: float | None = None
    reason: str | None = None  # pod-level failure reason (DeadlineExceeded)
    deadline: asyncio.TimerHandle | None = None
    restart: asyncio.TimerHandle | None = None
    last_state: dict[str, Any] | None = None


class Kubelet:
    def __init__(self, registry: Registry, runner: ExecRunner | SimRunner, *, loop: asyncio.AbstractEventLoop,
                 restart_backoff: float = 0.2) -> None:
        self.registry = registry
        self.store = registry.store
        self.runner = runner
        self._loop = loop
        self._restart_backoff = restart_backoff
        self._runs: dict[str, _PodRun] = {}  # by pod uid
        self._by_key: dict[Key, str] = {}
        self._dirty: dict[Key, None] = {}
        self._scheduled = False
        self._writing = False
        self.store.subscribe(self._on_event)

    def start(self) -> None:
        """Look at every pod once (after a restore: pending pods start, bound ones are lost)."""
        for entry in self.store.list(PODS):
            self._mark((entry.namespace, entry.name))

    # --- event intake ----------------------------------------------------------------

    def _on_event(self, event: Event) -> None:
        if event.entry.resource is not PODS:
            return
        if event.type == DELETED:
            self._loop.call_soon(self._forget, event.entry.uid)
            return
        if self._writing:
            return  # our own status report: what it changed is already in hand
        self._mark((event.entry.namespace, event.entry.name))

    def _mark(self, key: Key) -> None:
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

    def _forget(self, uid: str) -> None:
        """The pod is gone from the store: stop what still runs and drop its logs."""
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
        for handle in (run.deadline, run.restart):
            if handle is not None:
                handle.cancel()

    # --- reconcile one pod -----------------------------------------------------------

    def _sync(self, key: Key) -> None:
        entry = self.store.get(PODS, *key)
        if entry is None:
            return
        obj = entry.obj
        run = self._runs.get(entry.uid)
        if is_terminal_pod(obj):
            return
        if obj["metadata"].get("deletionTimestamp"):
            if run is not None:
                if not run.stopping:
                    run.stopping = True
                    if run.restart is not None:
                        run.restart.cancel()
                        self._finish(run, ContainerResult(137, "Error", "", run.started_at, now()))
                        return
                    grace = obj["metadata"].get("deletionGracePeriodSeconds") or 0
                    self.runner.stop(entry.uid, grace)
            else:
                self._write(entry, podstatus.terminated(obj, ContainerResult(137, "ContainerStatusUnknown", LOST_MESSAGE, None, now()), container_id=""))
            return
        if run is not None:
            return
        if (obj.get("spec") or {}).get("nodeName"):
            self._recover(entry)
        else:
            self._admit(entry)

    def _admit(self, entry: Entry) -> None:
        obj = entry.obj
        run = _PodRun((entry.namespace, entry.name), entry.uid)
        self._runs[entry.uid] = run
        self._by_key[run.key] = entry.uid
        spec = {**obj["spec"], "nodeName": NODE_NAME}
        bound = {**obj, "spec": spec}
        started = self.runner.start(entry.uid, bound)
        if started is not None:
            run.started_at = started
            status = podstatus.running(bound, started, container_id=self.runner.container_id(entry.uid))
            self._arm_deadline(run, bound)
        else:
            status = podstatus.waiting(bound, now())
        self._store(entry, {**bound, "status": status})

    def _recover(self, entry: Entry) -> None:
        """A pod bound to this node before a restart: resume a simulated container; a process is gone."""
        obj = entry.obj
        if isinstance(self.runner, SimRunner):
            run = _PodRun((entry.namespace, entry.name), entry.uid)
            self._runs[entry.uid] = run
            self._by_key[run.key] = entry.uid
            started_at = None
            state = (((obj.get("status") or {}).get("containerStatuses") or [{}])[0].get("state") or {})
            if "running" in state:
                try:
                    started_at = parse_rfc3339(state["running"]["startedAt"])
                except (KeyError, TypeError, ValueError):
                    started_at = None
            run.started_at = self.runner.start(entry.uid, obj, started_at=started_at)
            if "running" not in state:
                self._write(entry, podstatus.running(obj, run.started_at, container_id=self.runner.container_id(entry.uid)))
            self._arm_deadline(run, obj)
            return
        result = ContainerResult(137, "ContainerStatusUnknown", LOST_MESSAGE, None, now())
        status = podstatus.terminated(obj, result, container_id="", disruption="DeletionByPodGC",
                                      pod_message="PodGC: node no longer exists")
        self._write(entry, status)

    def _arm_deadline(self, run: _PodRun, pod: dict[str, Any]) -> None:
        deadline = (pod.get("spec") or {}).get("activeDeadlineSeconds")
        if deadline and run.started_at is not None and run.deadline is None:
            delay = max(0.0, run.started_at + deadline - now())
            run.deadline = self._loop.call_later(delay, self._deadline_exceeded, run.uid)

    def _deadline_exceeded(self, uid: str) -> None:
        run = self._runs.get(uid)
        if run is None or run.stopping:
            return
        run.reason = "DeadlineExceeded"
        run.stopping = True
        if run.restart is not None:
            run.restart.cancel()
            self._finish(run, ContainerResult(137, "Error", "", run.started_at, now()))
            return
        self.runner.stop(uid, 0)

    def _write(self, entry: Entry, status: dict[str, Any]) -> None:
        self._store(entry, {**entry.obj, "status": status})

    def _store(self, entry: Entry, obj: dict[str, Any]) -> None:
        self._writing = True
        try:
            self.registry.write(entry, obj)
        finally:
            self._writing = False

    def _current(self, run: _PodRun) -> Entry | None:
        entry = self.store.get(PODS, *run.key)
        return entry if entry is not None and entry.uid == run.uid else None

    # --- runner callbacks ------------------------------------------------------------

    def started(self, uid: str, started_at: float, container_id: str) -> None:
        run = self._runs.get(uid)
        if run is None:
            return
        run.started_at = started_at
        entry = self._current(run)
        if entry is None or is_terminal_pod(entry.obj):
            return
        self._write(entry, podstatus.running(entry.obj, started_at, container_id=container_id,
                                             restart_count=run.restart_count, last_state=run.last_state))
        self._arm_deadline(run, entry.obj)

    def finished(self, uid: str, result: ContainerResult) -> None:
        run = self._runs.get(uid)
        if run is None:
            return
        entry = self._current(run)
        if entry is None:
            self._drop(run)
            return
        policy = (entry.obj.get("spec") or {}).get("restartPolicy")
        restart = result.exit_code != 0 and not run.stopping and policy in ("OnFailure", "Always")
        if restart:
            run.restart_count += 1
            run.last_state = {"terminated": podstatus.terminated_state(result, self.runner.container_id(uid))}
            delay = min(self._restart_backoff * 2 ** (run.restart_count - 1), 10.0)
            run.restart = self._loop.call_later(delay, self._restart, uid)
            cs = podstatus.running(entry.obj, result.finished_at, container_id="", restart_count=run.restart_count,
                                   last_state=run.last_state)
            cs["containerStatuses"][0].update(
                {"state": {"waiting": {"reason": "CrashLoopBackOff"}}, "ready": False, "started": False})
            cs["containerStatuses"][0].pop("containerID", None)
            self._write(entry, cs)
            return
        self._finish(run, result)

    def _restart(self, uid: str) -> None:
        run = self._runs.get(uid)
        if run is None:
            return
        run.restart = None
        entry = self._current(run)
        if entry is None or run.stopping:
            return
        started = self.runner.start(uid, entry.obj)
        if started is not None:
            self.started(uid, started, self.runner.container_id(uid))

    def _finish(self, run: _PodRun, result: ContainerResult) -> None:
        self._drop(run)
        entry = self._current(run)
        if entry is None or is_terminal_pod(entry.obj):
            return
        status = podstatus.terminated(
            entry.obj, result, container_id=self.runner.container_id(run.uid) if result.started_at else "",
            restart_count=run.restart_count,
            pod_reason=run.reason, pod_message=DEADLINE_MESSAGE if run.reason == "DeadlineExceeded" else None,
        )
        self._write(entry, status)

    # --- logs ------------------------------------------------------------------------

    def logs(self, entry: Entry) -> bytes:
        return self.runner.logs(entry.uid)

    def is_running(self, entry: Entry) -> bool:
        return entry.uid in self._runs and not is_terminal_pod(entry.obj)

    async def close(self) -> None:
        for run in self._runs.values():
            for handle in (run.deadline, run.restart):
                if handle is not None:
                    handle.cancel()
        await self.runner.close()
