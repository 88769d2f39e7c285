"""The resources of one chaos run (`RunState`): its options and result, locks, processes, servers,
cluster and the engine's side, and the few steps every part of the run uses."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis

from k8s_dispatch.lab.chaos.cluster import ChaosCluster
from k8s_dispatch.lab.chaos.fault_plan import BEAT
from k8s_dispatch.lab.chaos.objects import MarkerScan
from k8s_dispatch.lab.chaos.options import ChaosOptions, ChaosResult
from k8s_dispatch.lab.chaos.services import OwnObjectStore, OwnPostgres, OwnRedis, SteppedClock
from k8s_dispatch.lab.chaos.upgrade import PreviousRelease
from k8s_dispatch.lab.chaos.workload import Planned, StoredResult, workload
from k8s_dispatch.ops.processes import ManagedProcess, celery_beat, celery_worker

if TYPE_CHECKING:
    from celery import Celery
    from sqlalchemy.engine import Engine

    from k8s_dispatch.core.settings import Settings
    from k8s_dispatch.workers.kube import KubeClient


class Stopping(Exception):
    """The run is stopping (Ctrl-C, SIGTERM, an error): a fault not yet begun is not begun."""


class RunState:
    """The resources of one run, shared by its feeder, its fault executor and its convergence
    (lab.chaos.run puts them together); what `_set_up` adds is declared here."""

    own_pg: OwnPostgres | None
    own_redis: OwnRedis | None
    own_store: OwnObjectStore | None  # the run's object store (None: the run has none)
    stored: list[StoredResult] | None  # the stored-result dispatches' objects (None: no object store)
    admin_url: str
    redis_url: str
    redis: redis.Redis
    release: PreviousRelease | None
    db_url: str
    idle: tuple[str, ...]
    all_namespaces: tuple[str, ...]
    env: dict[str, str]
    values: dict[str, str]
    settings: Settings
    limits: Any
    kube: KubeClient
    engine: Engine
    sessions: Any
    producer: Celery

    def __init__(
        self, options: ChaosOptions, result: ChaosResult, *, tag: str, progress: Callable[[str], None]
    ) -> None:
        self.options = options
        self.result = result
        self.tag = tag
        self.progress = progress
        self.prefix = result.prefix
        self.object_prefix = f"chaos-{tag}"  # the run's objects, under it in the object store
        self.dir = result.work_dir
        self.stack = ExitStack()
        self.stop = threading.Event()
        self.proc_lock = threading.RLock()
        # The cluster's own lock: a kube-apiserver restart takes seconds, and the other faults
        # (kills, the rolling restart of the namespace change) go on meanwhile, on schedule.
        self.cluster_lock = threading.RLock()
        self.procs: dict[str, ManagedProcess] = {}
        self.planned = workload(options.seed, options.dispatches, tag=tag, maps=options.map_count,
                                stored=options.large_count, secrets=options.secret_count)  # fmt: skip
        # Each secret input's marker: looked for in everything the run can read (lab.chaos.objects).
        self.scan = MarkerScan(str(p.input["token"]) for p in self.planned if p.secret)
        self.next_message_scan = 0.0
        self.ids: dict[int, str] = {}  # planned index -> dispatch id, once scheduled
        self.sent_at: dict[str, float] = {}  # dispatch id -> last `schedule` task send (task path)
        self.sends: Counter[str] = Counter()  # dispatch id -> `schedule` task sends
        self.recorded: set[str] = set()  # task-path dispatch ids seen in the database
        self.by_task: dict[str, Planned] = {}  # dispatch id -> its planned dispatch, sent as the task
        self.sealed: dict[str, str] = {}  # dispatch id -> its secret input's Fernet token (task path)
        self.old_schema = False  # the previous release's schema: before the rolling upgrade's migrate
        self.clocks: dict[str, SteppedClock] = {}
        # name -> (process, its start count, its log's size) when the run's Redis came back
        self.across_broker_restart: dict[str, tuple[ManagedProcess, int, int]] = {}
        self.shim: Path | None = None
        self.edited_ids: set[str] = set()  # dispatches cancelled or whose Job was edited by hand
        self.ids_lock = threading.Lock()
        self.cluster: ChaosCluster | None = None
        self.neighbour: Any = None  # lab.chaos.neighbour.Neighbour, when the run has one
        self.observer: Any = None  # lab.chaos.observer.JobObserver
        self.caps_now: Path | None = None  # the capability file the workers run on
        # Set once the namespace change has restarted every process on the moved file (or will
        # not happen): the feeder holds the work planned after it until then.
        self.moved = threading.Event()
        self.feed_error: BaseException | None = None
        self.threads: list[threading.Thread] = []
        self.t0 = 0.0
        self.next_queue_count = 0.0

    def _process(self, name: str, *, shim: Path | None, old: bool) -> ManagedProcess:
        """Worker `name` or beat, of this release or (`old`) the previous one, on its clock."""
        clock = self.clocks.get(name)
        env = self.env | {"K8S_DISPATCH_CAPABILITIES": str(self.caps_now)}
        env |= clock.env(shim) if clock is not None and shim is not None else {}
        if old:
            assert self.release is not None
            if name == BEAT:
                return self.release.beat(env=env, log_dir=self.dir, name=BEAT)
            return self.release.worker(name, env=env, log_dir=self.dir, concurrency=self.settings.worker_concurrency)
        if name == BEAT:
            return celery_beat(env=env, log_dir=self.dir, name=BEAT)
        return celery_worker(name, env=env, log_dir=self.dir, concurrency=self.settings.worker_concurrency)

    def _add(self, proc: ManagedProcess) -> None:
        self.procs[proc.name] = proc
        self.stack.callback(proc.stop)

    def _sleep_until(self, when: float) -> bool:
        """Wait until `when` (monotonic); False if the run is stopping."""
        return not self.stop.wait(max(0.0, when - time.monotonic()))

    @property
    def _cluster(self) -> ChaosCluster:
        assert self.cluster is not None, "the cluster starts in _set_up"
        return self.cluster

    def _set_api_faults(self, rate: float, latency_ms: int) -> None:
        with self.cluster_lock:
            self._cluster.set_faults(rate, latency_ms)
