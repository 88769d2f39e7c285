"""The cluster without HTTP: store, registry, kubelet with its runner, Job controller, garbage
collector and optional persistence, wired together on one event loop. With kubelet=False no
node runs in process: an external node agent (`localcluster node`) binds and runs the Pods."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path

from k8s_dispatch.demo.localcluster import persist
from k8s_dispatch.demo.localcluster.audit import Audit
from k8s_dispatch.demo.localcluster.controller import JobController
from k8s_dispatch.demo.localcluster.execrunner import ExecRunner
from k8s_dispatch.demo.localcluster.faults import Faults
from k8s_dispatch.demo.localcluster.garbage import GarbageCollector
from k8s_dispatch.demo.localcluster.kubelet import Kubelet, StoreHost
from k8s_dispatch.demo.localcluster.paging import Pager
from k8s_dispatch.demo.localcluster.podstatus import ContainerResult
from k8s_dispatch.demo.localcluster.registry import Registry
from k8s_dispatch.demo.localcluster.simrunner import SimRunner
from k8s_dispatch.demo.localcluster.store import Store

MODES = ("exec", "simulate")


def default_max_running() -> int:
    return max(2, 2 * (os.cpu_count() or 1))


class ClusterCore:
    def __init__(
        self,
        *,
        loop: asyncio.AbstractEventLoop,
        mode: str = "exec",
        state_path: Path | None = None,
        fault_rate: float = 0.0,
        latency_ms: int = 0,
        max_running: int | None = None,
        retry_backoff: float = 0.1,
        event_log_size: int = 50_000,
        persist_debounce: float = 0.1,
        pod_batch: float = 0.05,
        kubelet: bool = True,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.loop = loop
        self.mode = mode
        self.store = Store(event_log_size=event_log_size)
        self.faults = Faults()
        self.audit = Audit()
        self.faults.set(fault_rate, latency_ms)
        self.pager = Pager()
        self.state_path = Path(state_path) if state_path else None
        if self.state_path is not None:
            rv, objects = persist.load(self.state_path)
            self.store.restore(rv, objects)
        self.registry = Registry(self.store)
        for ns in ("default", "kube-system", "kube-public", "kube-node-lease"):
            self.registry.ensure_namespace(ns)
        self.workdir = Path(tempfile.mkdtemp(prefix="localcluster-"))
        runner: ExecRunner | SimRunner
        if mode == "exec":
            runner = ExecRunner(self, loop=loop, workdir=self.workdir, max_running=max_running or default_max_running())
        else:
            runner = SimRunner(self, loop=loop)
        self.kubelet: Kubelet | None = None
        if kubelet:
            host = StoreHost(self.registry, loop=loop)
            self.kubelet = host.kubelet = Kubelet(host, runner, loop=loop)
        self.controller = JobController(self.registry, loop=loop, backoff_base=retry_backoff, pod_batch=pod_batch)
        self.gc = GarbageCollector(self.registry, loop=loop)
        self.persister = (
            persist.Persister(self.store, self.state_path, loop=loop, debounce=persist_debounce)
            if self.state_path is not None
            else None
        )

    # the runner reports to the kubelet (the runner is built before it)
    def started(self, uid: str, started_at: float, container_id: str) -> None:
        if self.kubelet is not None:
            self.kubelet.started(uid, started_at, container_id)

    def finished(self, uid: str, result: ContainerResult) -> None:
        if self.kubelet is not None:
            self.kubelet.finished(uid, result)

    def start(self) -> None:
        if self.kubelet is not None:
            self.kubelet.start()
        self.controller.start()
        self.gc.start()

    async def close(self) -> None:
        self.store.close_watchers()
        self.controller.close()
        if self.kubelet is not None:
            await self.kubelet.close()
        if self.persister is not None:
            await self.persister.close()
        shutil.rmtree(self.workdir, ignore_errors=True)
