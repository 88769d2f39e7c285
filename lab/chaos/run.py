"""The chaos run: the whole system abused on a seeded schedule, then checked for anything lost,
doubled, wrong or left over (`k8s-dispatch chaos`, `make chaos`).

`run(options)` starts a PostgreSQL instance and a redis-server of its own (`lab.chaos.services`:
restarting them hurts no one else), the cluster (`localcluster serve`, or the real control plane
behind a fault proxy: `lab.chaos.cluster`), W `celery -A k8s_dispatch.tasks worker` processes and
`celery -A k8s_dispatch.tasks beat` as a user would (from the previous release when the run rehearses
a rolling upgrade: `lab.chaos.upgrade`), and feeds N dispatches at a steady rate while
`lab.chaos.fault_plan` kills processes, flushes and restarts the broker, breaks and restarts the API
server, kills database connections and restarts the database, steps clocks, loses cancels and
edits Jobs by hand (`lab.chaos.edits`). Then it stops the faults, waits for convergence and judges
the end state (`lab.chaos.checks`). Every process, server, worktree and temp dir is removed at the
end, whatever happened.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psycopg
import redis
import sqlalchemy as sa
import yaml
from sqlalchemy.engine import make_url

from k8s_dispatch.core.errors import DispatchError
from k8s_dispatch.lab.chaos import cluster as chaos_cluster
from k8s_dispatch.lab.chaos import edits
from k8s_dispatch.lab.chaos.checks import (
    RowSnapshot,
    TerminalEvent,
    Verdict,
    judge,
    limit_peaks,
    unexpected_task_errors,
)
from k8s_dispatch.lab.chaos.cluster import CLUSTERS, LOCALCLUSTER, ChaosCluster
from k8s_dispatch.lab.chaos.fault_plan import BEAT, Fault, FaultKind, FaultPlan, make_plan, worker_names
from k8s_dispatch.lab.chaos.services import OwnPostgres, OwnRedis, SteppedClock, build_sleep_shim
from k8s_dispatch.lab.chaos.upgrade import PreviousRelease, migrate_to_head
from k8s_dispatch.lab.chaos.workload import (
    LIMITED_CAPABILITY,
    TENANCIES,
    Expected,
    Planned,
    capabilities_config,
    expected,
    idle_namespaces,
    workload,
)
from k8s_dispatch.lab.kubeclient import opened
from k8s_dispatch.ops import interrupts
from k8s_dispatch.ops.processes import ManagedProcess, WaitTimeout, celery_beat, celery_worker, wait_for_log, wait_until
from k8s_dispatch.store.models import TERMINAL_EVENT_TYPES, CaseEvent, Dispatch
from k8s_dispatch.workers.labels import DEPLOYMENT_LABEL
from k8s_dispatch.workers.manifest import FINALIZER

log = logging.getLogger(__name__)

NAMESPACE = "chaos"
# Where the capabilities move at the NAMESPACE_CHANGE fault: work scheduled before stays where it was.
MOVED_NAMESPACE = "chaos-moved"
NAMESPACES = (NAMESPACE, MOVED_NAMESPACE)  # where the work runs; the idle namespaces come on top
SKEW_S = 60.0  # the clock of the first worker (faketime), against every other host's
CLOCK_STEP_S = 600.0  # the first worker's clock steps forward by this much, beat's back
# The previous release the rolling upgrade starts from (a commit-ish of this clone).
DEFAULT_UPGRADE_FROM = "HEAD~1"
CANCELS_PER_FAULT = 3  # running dispatches one LOST_CANCEL cancels
OUTAGE_S = 2.0  # how long a restarted Redis or PostgreSQL stays down
# The application_name of the workers' database connections: what the DB_KILL fault kills.
WORKER_DB_APP = "k8s-dispatch-worker"
HARNESS_DB_APP = "k8s-dispatch-chaos"
# The deployment under test, configured as an operator would: short intervals, so that what
# only the recovery sweep can fix (messages lost with a killed worker or a flushed broker) is
# fixed within the run's deadline.
DEPLOYMENT_SETTINGS = {
    "POLL_INTERVAL_S": "1.0",
    "SWEEP_INTERVAL_S": "5",
    "SWEEP_GRACE_S": "10",
    "GUARD_LEASE_MS": "15000",
    "BROKER_VISIBILITY_TIMEOUT_S": "60",
    "WORKER_CONCURRENCY": "8",
    # A Job of ours with no dispatch is deleted: were the second deployment's Jobs not invisible
    # to this one (and the other way round), its running work would end JobLost.
    "ORPHAN_POLICY": "delete",
}
START_TIMEOUT_S = 180.0  # a process's start on a busy 2-core machine (seen: 95 s, at a load of 34)
# The engine's side of the `schedule` task: a call whose dispatch is not in the database after
# this long is sent again (same dispatch id and idempotency key), as a broker may lose it; the
# wait doubles with each send, so a slow queue is not flooded with copies.
RESEND_AFTER_S = 15.0
TICK_S = 0.5
THREAD_JOIN_S = 60.0
PROGRESS_EVERY_S = 10.0
QUEUE_COUNT_S = 1.0
POD_DELETE_TRIES = 30  # a second apart: through an API server restart
# A lost cancel or a hand edit waits this long for a running dispatch to hit (one a second): on a
# loaded machine the rolling restarts and a flushed queue leave no Job running for over a minute.
TARGET_WAIT_S = 150.0
ID_CHUNK = 500


@dataclass(frozen=True)
class ChaosOptions:
    dispatches: int = 1000
    workers: int = 3
    seed: int = 0
    mode: str = "simulate"
    cluster: str = LOCALCLUSTER  # or "realcluster": kube-apiserver, etcd, the real Job controller
    api_ready_gate: bool = True  # realcluster: the fault proxy forwards only while kube-apiserver is ready
    skewed_workers: int = 1  # workers run under faketime, SKEW_S off the true clock
    neighbour_share: float = 0.1  # the second deployment's dispatches, as a share of the first's (0: none)
    rate: float = 10.0  # dispatches per second from the feeder
    kills: int = 20
    deadline_s: float = 300.0  # for convergence, once the faults stop
    broker_flushes: int = 1
    api_fault_rate: float = 0.05
    api_latency_ms: int = 20
    redis_restarts: int = 1  # of the run's own redis-server (none with `redis_url`)
    pg_restarts: int = 1  # of the run's own PostgreSQL (none with `admin_database_url`)
    lost_cancels: int = 1  # faults, each cancelling CANCELS_PER_FAULT running dispatches
    label_edits: int = 1  # faults, each editing one Job per kind of edit (lab.chaos.edits)
    clock_step_s: float = CLOCK_STEP_S  # 0: no step
    idle_namespaces: int = 48  # capabilities in namespaces no dispatch uses, beside the run's two
    upgrade_from: str | None = DEFAULT_UPGRADE_FROM  # the previous release's ref; None: no upgrade
    database_url: str | None = None  # use this database (not dropped); default: a fresh one
    admin_database_url: str | None = None  # where the fresh database is created; default: our own server
    redis_url: str | None = None  # default: a redis-server of the run's own
    work_dir: Path | None = None  # logs and cluster state; default: a temp dir, kept if the run fails

    @property
    def window_s(self) -> float:
        """The span the faults are spread over: the feeder's run."""
        return max(self.dispatches / self.rate, 10.0)


@dataclass(frozen=True)
class FaultDone:
    fault: Fault
    at_s: float  # when it actually happened
    detail: str
    ok: bool = True


@dataclass
class ChaosResult:
    options: ChaosOptions
    plan: FaultPlan
    prefix: str
    database: str
    work_dir: Path
    verdict: Verdict = field(default_factory=Verdict)
    done: list[FaultDone] = field(default_factory=list)
    api_faults: int = 0  # faults the API server (or the proxy in front of it) injected
    api_faults_by_kind: dict[str, int] = field(default_factory=dict)
    db_connections_killed: int = 0
    converged_s: float | None = None  # None: not converged by the deadline
    feed_s: float = 0.0
    wall_s: float = 0.0
    resends: int = 0
    unexpected_exits: list[str] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    neighbour: Verdict | None = None  # the second deployment's own verdict (also in `verdict`)
    jobs_seen: int = 0  # distinct Jobs the observer saw
    samples: int = 0  # the observer's samples of the running Jobs (every 100 ms)
    queued_peak: dict[str, int] = field(default_factory=dict)  # tenancy -> most QUEUED at once (database, 1/s)
    by_namespace: dict[str, int] = field(default_factory=dict)  # dispatches by recorded namespace
    edited: dict[str, str] = field(default_factory=dict)  # dispatch id -> the hand edit of its Job
    cancelled: list[str] = field(default_factory=list)  # dispatches cancelled with the follow-up lost
    release: str = ""  # the previous release's commit (a rolling upgrade), or ""
    temp_dirs: list[str] = field(default_factory=list)  # outside the work dir, removed at the end
    deaf: list[str] = field(default_factory=list)  # processes that went on consuming nothing after a Redis restart
    unexpected_errors: list[str] = field(default_factory=list)  # exceptions that escaped a task

    def count_done(self, kind: FaultKind) -> int:
        return sum(1 for d in self.done if d.fault.kind is kind and d.ok)

    @property
    def kills(self) -> int:
        return self.count_done(FaultKind.KILL)

    @property
    def broker_flushes(self) -> int:
        return self.count_done(FaultKind.BROKER_FLUSH)

    @property
    def ok(self) -> bool:
        return (self.error is None and self.converged_s is not None and self.verdict.ok and not self.deaf
                and not self.unexpected_errors)  # fmt: skip

    def final_line(self) -> str:
        v = self.verdict
        converged = f"{self.converged_s:.1f}" if self.converged_s is not None else "timeout"
        return (
            f"chaos: dispatched={v.dispatched} terminal={v.terminal} lost={v.lost} duplicates={v.duplicates} "
            f"wrong_output={v.wrong_output} leftover_jobs={v.leftover_jobs} second_jobs={v.second_jobs} "
            f"limit_exceeded={'none' if v.limit_exceeded is None else v.limit_exceeded} running={v.running} "
            f"queued={v.queued} kills={self.kills} "
            f"broker_flushes={self.broker_flushes} api_faults={self.api_faults} converged_s={converged} "
            f"seed={self.options.seed}"
        )

    def to_dict(self) -> dict[str, Any]:
        v = self.verdict
        return {
            "dispatched": v.dispatched,
            "terminal": v.terminal,
            "lost": v.lost,
            "duplicates": v.duplicates,
            "wrong_output": v.wrong_output,
            "leftover_jobs": v.leftover_jobs,
            "second_jobs": v.second_jobs,
            "wrong_namespace": v.wrong_namespace,
            "held_claims": v.held_claims,
            "unnotified": v.unnotified,
            "limit_exceeded": v.limit_exceeded,
            "running": v.running,
            "queued": v.queued,
            "limits": [{"scope": p.scope, "name": p.name, "limit": p.limit, "peak": p.peak} for p in v.limits],
            "queued_peak": self.queued_peak,
            "samples": self.samples,
            "kills": self.kills,
            "broker_flushes": self.broker_flushes,
            "api_faults": self.api_faults,
            "api_faults_by_kind": self.api_faults_by_kind,
            "api_restarts": self.count_done(FaultKind.API_RESTART),
            "db_kills": self.count_done(FaultKind.DB_KILL),
            "redis_restarts": self.count_done(FaultKind.REDIS_RESTART),
            "pg_restarts": self.count_done(FaultKind.PG_RESTART),
            "clock_steps": self.count_done(FaultKind.CLOCK_STEP),
            "rolling_upgrades": self.count_done(FaultKind.ROLLING_UPGRADE),
            "release": self.release,
            "hand_edited": self.edited,
            "cancels_lost": self.cancelled,
            "temp_dirs": self.temp_dirs,
            "deaf_after_redis_restart": self.deaf,
            "unexpected_task_errors": self.unexpected_errors,
            "db_connections_killed": self.db_connections_killed,
            "converged_s": round(self.converged_s, 1) if self.converged_s is not None else None,
            "seed": self.options.seed,
            "ok": self.ok,
            "error": self.error,
            "mode": self.options.mode,
            "cluster": self.options.cluster,
            "workers": self.options.workers,
            "rate": self.options.rate,
            "feed_s": round(self.feed_s, 1),
            "wall_s": round(self.wall_s, 1),
            "schedule_resends": self.resends,
            "jobs_seen": self.jobs_seen,
            "by_namespace": self.by_namespace,
            "neighbour": None
            if self.neighbour is None
            else {
                "dispatched": self.neighbour.dispatched,
                "ok": self.neighbour.ok,
                "outcomes": dict(sorted(self.neighbour.outcomes.items())),
                "problems": self.neighbour.problems,
            },
            "unexpected_exits": self.unexpected_exits,
            "outcomes": dict(sorted(v.outcomes.items())),
            "stats": self.stats,
            "problems": v.problems,
            "faults": [
                {
                    "planned_s": d.fault.at_s,
                    "at_s": round(d.at_s, 3),
                    "kind": d.fault.kind.value,
                    "target": d.fault.target,
                    "ok": d.ok,
                    "detail": d.detail,
                }
                for d in self.done
            ],
            "prefix": self.prefix,
            "database": self.database,
            "work_dir": str(self.work_dir),
        }


def fault_plan(options: ChaosOptions) -> FaultPlan:
    """The run's fault schedule: a function of the seed and the options alone."""
    step = options.clock_step_s
    return make_plan(
        options.seed,
        window_s=options.window_s,
        kills=options.kills,
        targets=[*worker_names(options.workers), BEAT],
        broker_flushes=options.broker_flushes,
        api_fault_rate=options.api_fault_rate,
        api_latency_ms=options.api_latency_ms,
        redis_restarts=options.redis_restarts if options.redis_url is None else 0,
        pg_restarts=options.pg_restarts if options.admin_database_url is None and options.database_url is None else 0,
        lost_cancels=options.lost_cancels,
        label_edits=options.label_edits,
        rolling_upgrades=1 if options.upgrade_from else 0,
        clock_steps=[(stepped_worker(options.workers), step), (BEAT, -step)] if step else [],
    )


def stepped_worker(workers: int) -> str:
    """The worker whose clock the run steps: the first, which runs SKEW_S off already. One faked
    worker, not two: under libfaketime a thread's hand-off to another costs 25-60 times as much
    (measured: a thread pool's 200 tasks 0.5 s against 0.02 s), and a start-up sweep over 50
    namespaces took 90 s in a faked worker against 3 s in a true one."""
    return worker_names(workers)[0]


# Faults that may take long (a restart, a migration and the replacement of every process): they
# run beside the others, which go on on schedule.
LONG_FAULTS = (FaultKind.API_RESTART, FaultKind.POD_DELETE, FaultKind.ROLLING_UPGRADE, FaultKind.LOST_CANCEL,
               FaultKind.LABEL_EDIT)  # fmt: skip


class _Stop(Exception):
    """The run is stopping (Ctrl-C, SIGTERM, an error): a fault not yet begun is not begun."""


def run(options: ChaosOptions, *, progress: Callable[[str], None] = lambda _: None) -> ChaosResult:
    """One chaos run; cleans up every process, the database and the Redis keys before returning.

    Raises:
        KeyboardInterrupt: Ctrl-C or SIGTERM (after the clean-up).
    """
    if options.dispatches < 1 or options.workers < 1 or options.rate <= 0:
        raise ValueError("dispatches and workers must be >= 1 and rate > 0")
    if options.mode not in ("simulate", "exec"):
        raise ValueError(f"mode must be simulate or exec, got {options.mode!r}")
    if options.cluster not in CLUSTERS:
        raise ValueError(f"cluster must be one of {', '.join(CLUSTERS)}, got {options.cluster!r}")
    tag = uuid.uuid4().hex[:8]
    plan = fault_plan(options)
    work_dir = options.work_dir or Path(tempfile.mkdtemp(prefix=f"k8s-dispatch-chaos-{tag}-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    result = ChaosResult(options=options, plan=plan, prefix=f"k8s-dispatch-chaos-{tag}", database="", work_dir=work_dir)
    started = time.monotonic()
    try:
        with interrupts.interrupts(), _Run(options, result, tag=tag, progress=progress) as chaos:
            chaos.execute()
    except (DispatchError, WaitTimeout, RuntimeError, OSError, redis.RedisError, psycopg.Error) as e:
        # The harness itself could not go on (a service down, a process that never started).
        result.error = f"{e.__class__.__name__}: {e}"
    finally:
        result.wall_s = time.monotonic() - started
        if result.ok and options.work_dir is None:
            shutil.rmtree(work_dir, ignore_errors=True)
    return result


class _Run:
    """The resources of one run and the steps that use them; `__exit__` releases them all."""

    def __init__(
        self, options: ChaosOptions, result: ChaosResult, *, tag: str, progress: Callable[[str], None]
    ) -> None:
        self.options = options
        self.result = result
        self.tag = tag
        self.progress = progress
        self.prefix = result.prefix
        self.dir = result.work_dir
        self.stack = ExitStack()
        self.stop = threading.Event()
        self.proc_lock = threading.RLock()
        # The cluster's own lock: a kube-apiserver restart takes seconds, and the other faults
        # (kills, the rolling restart of the namespace change) go on meanwhile, on schedule.
        self.cluster_lock = threading.RLock()
        self.procs: dict[str, ManagedProcess] = {}
        self.planned = workload(options.seed, options.dispatches, tag=tag)
        self.ids: dict[int, str] = {}  # planned index -> dispatch id, once scheduled
        self.sent_at: dict[str, float] = {}  # dispatch id -> last `schedule` task send (task path)
        self.sends: Counter[str] = Counter()  # dispatch id -> `schedule` task sends
        self.recorded: set[str] = set()  # task-path dispatch ids seen in the database
        self.by_task: dict[str, Planned] = {}  # dispatch id -> its planned dispatch, sent as the task
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
        self.feed_error: BaseException | None = None
        self.threads: list[threading.Thread] = []
        self.t0 = 0.0
        self.next_queue_count = 0.0

    # --- set-up and tear-down ------------------------------------------------------------

    def __enter__(self) -> _Run:
        try:
            self._set_up()
        except BaseException:
            self.stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        # The feeder and the fault thread finish what they are doing (a fault started while
        # we stop the processes could start one again behind our back), then everything goes.
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=THREAD_JOIN_S)
        with self.proc_lock, self.cluster_lock:
            self.stack.close()

    def _set_up(self) -> None:
        from k8s_dispatch.core.settings import load_settings
        from k8s_dispatch.store.migrate import upgrade
        from k8s_dispatch.workers.kube import KubeClient
        from k8s_dispatch.workers.resolver import CapabilityResolver

        options = self.options
        base_env = {k: v for k, v in os.environ.items() if not k.startswith("K8S_DISPATCH_")}
        # Our servers carry the work dir in their environment: what is left of a run can be found.
        server_env = base_env | {"K8S_DISPATCH_CHAOS_WORK_DIR": str(self.dir)}
        self.own_pg: OwnPostgres | None = None
        self.own_redis: OwnRedis | None = None
        if options.admin_database_url is None:
            self.own_pg = OwnPostgres(log_dir=self.dir, env=server_env)
            self.result.temp_dirs.append(str(self.own_pg.data))
            self.stack.callback(self.own_pg.stop)
            self.own_pg.start()
        self.admin_url = options.admin_database_url or (self.own_pg.admin_url if self.own_pg else "")
        if options.redis_url is None:
            self.own_redis = OwnRedis(directory=self.dir / "redis", log_dir=self.dir, env=server_env)
            self.stack.callback(self.own_redis.stop)
            self.own_redis.start()
        self.redis_url = options.redis_url or (self.own_redis.url if self.own_redis else "")
        self.redis = redis.Redis.from_url(self.redis_url, socket_timeout=10, socket_connect_timeout=10)
        self.stack.callback(self.redis.close)
        self.stack.callback(self._delete_keys)
        self.redis.ping()

        self.release: PreviousRelease | None = None
        if options.upgrade_from:
            self.release = PreviousRelease(options.upgrade_from)
            self.result.temp_dirs.append(str(self.release.root.parent))
            self.stack.callback(self.release.remove)
            self.result.release = self.release.check_out()
        self.db_url = options.database_url or self._create_database()
        self.result.database = make_url(self.db_url).database or ""
        if self.release is not None:  # the old fleet runs on the old schema until ROLLING_UPGRADE
            self.release.migrate(self.db_url, env=base_env)
        else:
            upgrade(self.db_url)
        self.old_schema = self.release is not None

        self.idle = idle_namespaces(options.idle_namespaces)
        self.all_namespaces = (*NAMESPACES, *self.idle)
        caps_path = self.dir / "capabilities.yaml"
        caps_path.write_text(yaml.safe_dump(capabilities_config(options.mode, idle=self.idle)))
        cluster = chaos_cluster.make(options.cluster, directory=self.dir, mode=options.mode,
                                     namespaces=self.all_namespaces, env=base_env,
                                     ready_gate=options.api_ready_gate)  # fmt: skip
        self.stack.callback(cluster.stop)
        cluster.start()
        self.cluster = cluster
        values = {
            "K8S_DISPATCH_DATABASE_URL": _with_app_name(self.db_url, WORKER_DB_APP),
            "K8S_DISPATCH_REDIS_URL": self.redis_url,
            "K8S_DISPATCH_KEY_PREFIX": self.prefix,
            "K8S_DISPATCH_NAMESPACE": NAMESPACE,
            "K8S_DISPATCH_CAPABILITIES": str(caps_path),
            "K8S_DISPATCH_KUBECONFIG": str(cluster.worker_kubeconfig),
            **{f"K8S_DISPATCH_{k}": v for k, v in DEPLOYMENT_SETTINGS.items()},
        }
        self.env = base_env | values
        self.values = values
        self.caps_now = caps_path
        self.settings = load_settings(values)
        self.limits = CapabilityResolver.from_settings(self.settings).limits
        self.kube = KubeClient(cluster.harness_kubeconfig, timeout_s=10)
        self.stack.callback(self.kube.close)

        self._create_engine_side()
        # Faked clocks: the first workers SKEW_S off from the start; the stepped worker and beat
        # on a clock the CLOCK_STEP faults move while they run.
        names = worker_names(options.workers)
        offsets = {name: SKEW_S for name in names[: options.skewed_workers]}
        if options.clock_step_s:
            offsets.setdefault(stepped_worker(options.workers), 0.0)
            offsets.setdefault(BEAT, 0.0)
        self.clocks = {name: SteppedClock(self.dir / f"clock-{name}", offset) for name, offset in offsets.items()}
        self.shim = build_sleep_shim(self.dir / "shim") if self.clocks else None
        for name in [*names, BEAT]:
            self._add(self._process(name, shim=self.shim, old=self.release is not None))
        for proc in self.procs.values():
            proc.start()
        for name, proc in self.procs.items():
            wait_for_log(proc, " ready." if name != BEAT else "beat: Starting", timeout=START_TIMEOUT_S)
        if options.neighbour_share > 0:
            from k8s_dispatch.lab.chaos.neighbour import Neighbour

            servers = replace(options, redis_url=self.redis_url, admin_database_url=self.admin_url)
            self.neighbour = Neighbour(
                servers, tag=self.tag, directory=self.dir / "neighbour", env=base_env, values=values,
                count=max(10, round(options.dispatches * options.neighbour_share)), stack=self.stack,
            )  # fmt: skip
            self.neighbour.start()
        from k8s_dispatch.lab.chaos.observer import JobObserver

        self.observer = JobObserver(cluster.harness_kubeconfig)
        self.stack.callback(self.observer.stop)
        self.observer.start()
        skewed = ", ".join(f"{n} {c.offset_s:+g}s" for n, c in self.clocks.items())
        release = f" of {options.upgrade_from} ({self.result.release[:12]})" if self.release else ""
        self.progress(
            f"chaos: {options.workers} workers and beat{release} (faketime: {skewed or 'none'}), "
            f"{'a second deployment, ' if self.neighbour else ''}{options.cluster} ({options.mode}) up, "
            f"{len(self.all_namespaces)} namespaces; database {self.result.database}, prefix {self.prefix}, "
            f"logs in {self.dir}, temp dirs {' '.join(self.result.temp_dirs) or 'none'}"
        )

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

    def _create_database(self) -> str:
        name = f"k8s_dispatch_chaos_{self.tag}"
        admin_url = self.admin_url
        with psycopg.connect(_conninfo(admin_url), autocommit=True, connect_timeout=10) as admin:
            admin.execute(f'CREATE DATABASE "{name}"')
        self.stack.callback(_drop_database, admin_url, name)
        return make_url(admin_url).set(database=name).render_as_string(hide_password=False)

    def _create_engine_side(self) -> None:
        """The engine's connection (its own application_name: the DB_KILL spares it) and cases."""
        from celery import Celery

        from k8s_dispatch import celeryconfig
        from k8s_dispatch.lab.chaos.workload import cases
        from k8s_dispatch.store import dispatches
        from k8s_dispatch.store.db import make_engine, make_sessionmaker, transaction

        self.engine = make_engine(_with_app_name(self.db_url, HARNESS_DB_APP))
        self.stack.callback(self.engine.dispose)
        self.sessions = make_sessionmaker(self.engine)
        self.producer = Celery("k8s-dispatch-chaos-engine", set_as_current=False)
        self.producer.conf.update(celeryconfig.config(self.settings))
        self.stack.callback(self.producer.close)
        with transaction(self.sessions) as session:
            for case_id, tenancy_id in cases(self.tag):
                dispatches.create_case(session, case_id=case_id, tenancy_id=tenancy_id)

    def _delete_keys(self) -> None:
        try:
            _delete_prefix(self.redis, self.prefix)
        except redis.RedisError as e:
            log.warning("could not delete the run's keys under %s: %s", self.prefix, e)

    # --- the run -------------------------------------------------------------------------

    def execute(self) -> None:
        result = self.result
        self.t0 = time.monotonic()
        feeder = threading.Thread(target=self._feed, name="chaos-feeder", daemon=True)
        faults = threading.Thread(target=self._inject_faults, name="chaos-faults", daemon=True)
        self.threads = [feeder, faults]
        if self.neighbour is not None:
            self.threads.append(threading.Thread(target=self.neighbour.feed, args=(self.stop, self.options.window_s),
                                                 name="chaos-neighbour", daemon=True))  # fmt: skip
        for thread in self.threads:
            thread.start()
        next_report = time.monotonic() + PROGRESS_EVERY_S
        while feeder.is_alive() or faults.is_alive():
            self._tick()
            if time.monotonic() >= next_report:
                next_report += PROGRESS_EVERY_S
                self.progress(f"chaos: {time.monotonic() - self.t0:5.0f}s fed {len(self.ids)}/{len(self.planned)}, "
                              f"faults {len(result.done)}/{len(result.plan.faults)}")  # fmt: skip
            time.sleep(TICK_S)
        feeder.join()
        faults.join()
        if self.feed_error is not None:
            raise self.feed_error
        # Faults stop: whatever the plan left on is switched off, every process is up.
        self._set_api_faults(0.0, 0)
        self._tick()
        stopped = time.monotonic()
        self.progress(f"chaos: faults stopped after {stopped - self.t0:.0f}s; waiting for convergence")
        deadline = stopped + self.options.deadline_s
        converged = False
        next_report = time.monotonic() + PROGRESS_EVERY_S
        while time.monotonic() < deadline:
            self._tick()
            pending, jobs = self._pending() + (self.neighbour.pending() if self.neighbour else 0), self._jobs_left()
            if pending == 0 and jobs == 0:
                converged = True
                break
            if time.monotonic() >= next_report:
                next_report += PROGRESS_EVERY_S
                self.progress(f"chaos: converging: {pending} dispatches not ended and notified, {jobs} jobs left")
            time.sleep(TICK_S)
        if converged:
            result.converged_s = time.monotonic() - stopped
            # A claim is released by its holder or expires with its lease: none may stay longer.
            lease_s = self.settings.guard_lease_ms / 1000
            with contextlib.suppress(WaitTimeout):  # judged below
                wait_until(lambda: not self._claims(), timeout=lease_s + 5, interval=TICK_S, what="no guard claim")
        self.result.deaf = self._deaf_after_broker_restart()
        logs = {path.relative_to(self.dir).as_posix(): path.read_text(errors="replace")
                for path in sorted(self.dir.glob("**/*.log")) if "worker" in path.name}  # fmt: skip
        self.result.unexpected_errors = unexpected_task_errors(logs)
        self._judge()

    def _tick(self) -> None:
        """Restart what died on its own (and say so); send lost `schedule` calls again."""
        interrupts.check()  # a Ctrl-C the garbage collector swallowed
        with self.proc_lock:
            for name, proc in self.procs.items():
                if not proc.alive:
                    note = f"{name} exited by itself with code {proc.returncode} (restarted)"
                    log.warning("%s\n%s", note, proc.log_tail(20))
                    self.result.unexpected_exits.append(note)
                    proc.start()
            if self.cluster is not None and self.cluster_lock.acquire(blocking=False):  # not while it restarts
                try:
                    self.result.unexpected_exits += self.cluster.revive()
                finally:
                    self.cluster_lock.release()
            if self.neighbour is not None:
                self.result.unexpected_exits += self.neighbour.revive()
        self._resend_unrecorded()
        self._count_queued()

    def _count_queued(self) -> None:
        """Note the most dispatches of each tenancy waiting for a slot at once (once a second)."""
        from k8s_dispatch.store import admission
        from k8s_dispatch.store.db import transaction

        if time.monotonic() < self.next_queue_count or not hasattr(self, "sessions") or self.old_schema:
            return
        self.next_queue_count = time.monotonic() + QUEUE_COUNT_S
        try:
            with transaction(self.sessions) as session:
                rows = admission.by_tenancy(admission.summary(session))
        except DispatchError as e:
            log.warning("cannot count the queued dispatches: %s", e)
            return
        peaks = self.result.queued_peak
        for tenancy, (_running, queued) in rows.items():
            peaks[tenancy] = max(peaks.get(tenancy, 0), queued)

    # --- the feeder (the engine) -----------------------------------------------------------

    def _feed(self) -> None:
        try:
            for planned in self.planned:
                if not self._sleep_until(self.t0 + planned.index / self.options.rate):
                    return
                self._schedule(planned)
            self.result.feed_s = time.monotonic() - self.t0
        except BaseException as e:
            self.feed_error = e

    def _schedule(self, planned: Planned) -> None:
        from kombu.exceptions import OperationalError

        from k8s_dispatch.core.errors import DatabaseUnavailable
        from k8s_dispatch.store.db import transaction
        from k8s_dispatch.tasks.scheduling import schedule_many_in_session
        from k8s_dispatch.workers.resolver import CapabilityResolver

        # While the previous release runs on its schema, the engine sends the `schedule` task
        # (its workers write the rows), as an engine whose library is not upgraded yet would.
        if planned.via_task or self.old_schema:
            dispatch_id = str(uuid.uuid4())
            with self.ids_lock:
                self.ids[planned.index] = dispatch_id
                self.by_task[dispatch_id] = planned
            try:
                self._send_schedule(planned, dispatch_id)
            except OperationalError as e:
                log.warning("schedule task for %s not sent (%s); sent again later", dispatch_id, e)
            return
        resolver = getattr(self, "_resolver", None) or CapabilityResolver.from_settings(self.settings)
        self._resolver = resolver  # the engine's router: replaced when the capability file changes
        while not self.stop.is_set():
            try:
                with transaction(self.sessions) as session:
                    (scheduled,) = schedule_many_in_session(
                        session, [planned.request()], router=resolver,
                        max_input_bytes=self.settings.max_input_bytes, via=self.producer,
                    )  # fmt: skip
            except DatabaseUnavailable as e:  # the engine retries its own transaction
                log.warning("scheduling %s: %s; retrying", planned.idempotency_key, e)
                time.sleep(0.2)
                continue
            with self.ids_lock:
                self.ids[planned.index] = scheduled.dispatch_id
            return

    def _send_schedule(self, planned: Planned, dispatch_id: str) -> None:
        from k8s_dispatch import celeryconfig as names

        self.sent_at[dispatch_id] = time.monotonic()
        self.sends[dispatch_id] += 1
        self.producer.send_task(
            names.SCHEDULE_TASK,
            args=[planned.case_id, planned.tenancy_id, planned.capability, planned.input, planned.idempotency_key],
            kwargs={"dispatch_id": dispatch_id},
        )

    def _resend_unrecorded(self) -> None:
        """The engine's half of the `schedule` task: a call not recorded in time is sent again."""
        from kombu.exceptions import OperationalError

        now = time.monotonic()
        with self.ids_lock:
            waiting = {d: p for d, p in self.by_task.items() if d not in self.recorded}
        due = {
            d: p
            for d, p in waiting.items()
            if now - self.sent_at.get(d, 0.0) >= RESEND_AFTER_S * 2 ** max(0, self.sends[d] - 1)
        }
        if not due:
            return
        try:
            present = self._existing(list(due))
        except DispatchError as e:
            log.warning("cannot read dispatches to resend: %s", e)
            return
        self.recorded |= present
        for dispatch_id, planned in due.items():
            if dispatch_id in present:
                continue
            try:
                self._send_schedule(planned, dispatch_id)
                self.result.resends += 1
            except OperationalError as e:
                log.warning("schedule task for %s not sent again (%s)", dispatch_id, e)

    # --- the faults ------------------------------------------------------------------------

    def _inject_faults(self) -> None:
        restarts: list[threading.Thread] = []
        try:
            for fault in self.result.plan.faults:
                if not self._sleep_until(self.t0 + fault.at_s):
                    return
                if fault.kind in LONG_FAULTS:  # beside the others
                    restarts.append(threading.Thread(target=self._do, args=(fault,), name="chaos-restart", daemon=True))
                    restarts[-1].start()
                elif not self._do(fault):
                    return
        finally:
            for thread in restarts:
                thread.join(timeout=THREAD_JOIN_S)

    def _do(self, fault: Fault) -> bool:
        """Carry out one fault and record it; False if the run is stopping."""
        at_s = time.monotonic() - self.t0
        try:
            detail, ok = self._inject(fault), True
        except _Stop:
            return False
        except (DispatchError, OSError, redis.RedisError, psycopg.Error, WaitTimeout, RuntimeError) as e:
            detail, ok = f"failed: {e.__class__.__name__}: {e}", False
            log.warning("fault %s failed: %s", fault.describe(), detail)
        self.result.done.append(FaultDone(fault=fault, at_s=at_s, detail=detail, ok=ok))
        log.info("fault %s: %s", fault.describe(), detail)
        return True

    def _inject(self, fault: Fault) -> str:
        kind = fault.kind
        if kind is FaultKind.KILL:
            with self.proc_lock:
                if self.stop.is_set():
                    raise _Stop
                proc = self.procs[fault.target or ""]
                pid = proc.pid
                proc.kill(signal.SIGKILL)
                proc.start()
            return f"SIGKILL {fault.target} (pid {pid}); started again (pid {proc.pid})"
        if kind is FaultKind.BROKER_FLUSH:
            return self._flush_broker()
        if kind is FaultKind.API_FAULTS_ON:
            plan = self.result.plan
            self._set_api_faults(plan.api_fault_rate, plan.api_latency_ms)
            return f"{plan.api_fault_rate:.0%} of requests fail ({self._cluster.fault_words}), +{plan.api_latency_ms} ms each"
        if kind is FaultKind.API_FAULTS_OFF:
            self._set_api_faults(0.0, 0)
            return "API faults off"
        if kind is FaultKind.API_RESTART:
            with self.cluster_lock:
                if self.stop.is_set():
                    raise _Stop
                began = time.monotonic()
                what = self._cluster.restart_api()
            return f"{what} in {time.monotonic() - began:.1f}s"
        if kind is FaultKind.DB_KILL:
            killed = self._kill_db_connections()
            self.result.db_connections_killed += killed
            return f"pg_terminate_backend on {killed} worker connections"
        if kind is FaultKind.POD_DELETE:
            return self._delete_finished_pods()
        if kind is FaultKind.NAMESPACE_CHANGE:
            return self._change_namespace()
        if kind is FaultKind.REDIS_RESTART:
            return self._restart_server(self.own_redis)
        if kind is FaultKind.PG_RESTART:
            return self._restart_server(self.own_pg)
        if kind is FaultKind.CLOCK_STEP:
            clock = self.clocks[fault.target or ""]
            offset = clock.step(fault.step_s)
            return f"{fault.target}'s wall clock stepped {fault.step_s:+g}s (now {offset:+g}s off)"
        if kind is FaultKind.LOST_CANCEL:
            return self._cancel_losing_follow_up()
        if kind is FaultKind.LABEL_EDIT:
            return self._edit_jobs()
        if kind is FaultKind.ROLLING_UPGRADE:
            return self._rolling_upgrade()
        raise AssertionError(f"unknown fault {fault!r}")

    def _restart_server(self, server: OwnRedis | OwnPostgres | None) -> str:
        """SIGKILL one of the run's own servers, leave it down OUTAGE_S, start it again."""
        if server is None:
            raise RuntimeError("the run uses a server it was given, not its own: not restarted")
        with self.proc_lock:
            if self.stop.is_set():
                raise _Stop
            pid = server.proc.pid
            server.proc.kill(signal.SIGKILL)
            self.stop.wait(OUTAGE_S)  # down for a while even when stopping: start it again below
            server.start()
            if server is self.own_redis:  # who must reconnect and go on: judged at the end
                self.across_broker_restart = {
                    name: (proc, proc.starts, proc.log_path.stat().st_size if proc.log_path.exists() else 0)
                    for name, proc in self.procs.items()
                }
        return f"{server.proc.name} (pid {pid}) SIGKILLed, down {OUTAGE_S:g}s, started again (pid {server.proc.pid})"

    def _deaf_after_broker_restart(self) -> list[str]:
        """The processes that lived through the last Redis restart (neither killed nor replaced
        since) and never showed, in their logs after it, that they reconnected and went on: a
        worker receiving a task, beat sending one (Celery has had consumers that stay connected
        and consume nothing after a reconnect)."""
        deaf = []
        for name, (proc, starts, offset) in self.across_broker_restart.items():
            if self.procs.get(name) is not proc or proc.starts != starts or not proc.alive:
                continue  # started afresh since: its consuming is the verdict's to judge
            with proc.log_path.open("rb") as log:
                log.seek(offset)
                after = log.read().decode(errors="replace")
            went_on = "Sending due task" if name == BEAT else "] received"
            if went_on not in after:
                deaf.append(f"{name} (pid {proc.pid}): no {went_on.strip('] ')!r} in its log since the Redis restart")
        return deaf

    def _cancel_losing_follow_up(self) -> str:
        """The engine cancels a few running dispatches; the broker loses every `cancel` message."""
        deadline = time.monotonic() + TARGET_WAIT_S
        while True:
            with self.ids_lock:
                ids = [d for d in self.ids.values() if d not in self.edited_ids]
            chosen = edits.running_dispatches(self.sessions, ids, capability=LIMITED_CAPABILITY,
                                                    limit=CANCELS_PER_FAULT)  # fmt: skip
            if chosen or time.monotonic() >= deadline or self.stop.wait(1.0):
                break
        self.edited_ids.update(chosen)  # whatever the cancel found, these are judged as cancelled
        ended = edits.cancel_losing_follow_up(self.sessions, chosen)
        self.result.cancelled += chosen
        return f"cancelled {len(ended)} of {len(chosen)} running dispatches, their cancel messages lost"

    def _edit_jobs(self) -> str:
        """Hand edits of running Jobs (lab.chaos.edits.EDITS), each on another Job, waiting up to
        TARGET_WAIT_S for Jobs to edit; tried again through API errors and restarts."""
        import urllib3
        from kubernetes import client

        left = list(edits.EDITS)
        done: list[tuple[edits.Target, str]] = []
        deadline, failures = time.monotonic() + TARGET_WAIT_S, 0
        selector = f"{DEPLOYMENT_LABEL}={self.settings.effective_deployment}"
        while True:
            try:
                with opened(self._cluster.harness_kubeconfig) as api:
                    listed = client.BatchV1Api(api).list_job_for_all_namespaces(label_selector=selector,
                                                                                _request_timeout=10)  # fmt: skip
                    found = [api.sanitize_for_serialization(job) for job in listed.items]
                    targets = edits.running_targets(found, capability=LIMITED_CAPABILITY, skip=self.edited_ids)
                    targets = targets[: len(left)]
                    self.edited_ids.update(t.dispatch_id for t in targets)  # judged as edited, done or not
                    now_done = edits.edit_jobs(api, targets, edits=left)
            except (client.ApiException, urllib3.exceptions.HTTPError) as e:
                failures += 1
                if failures >= POD_DELETE_TRIES:
                    raise RuntimeError(f"editing jobs: {e.__class__.__name__}: {e}") from e
                now_done = []
            for target, what in now_done:
                self.result.edited[target.dispatch_id] = what
            done += now_done
            left = [edit for edit in left if edit[0] not in {what for _, what in now_done}]
            if not left or time.monotonic() >= deadline or self.stop.wait(1.0):
                break
        return "; ".join(f"{t.namespace}/{t.name}: {what}" for t, what in done) or "no running Job to edit"

    def _rolling_upgrade(self) -> str:
        """`k8s-dispatch migrate` to head while the previous release's workers and beat run, then
        each replaced by this release's in turn (SIGTERM: a warm shutdown; kills go on meanwhile)."""
        if self.release is None:
            raise RuntimeError("no previous release checked out")
        began = time.monotonic()
        migrate_to_head(self.db_url, env=self.env)
        self.old_schema = False
        migrated = time.monotonic() - began
        replaced: list[ManagedProcess] = []
        try:
            for name in [*worker_names(self.options.workers), BEAT]:
                with self.proc_lock:  # the new one takes the name (kills and revivals hit it), then starts
                    if self.stop.is_set():
                        raise _Stop
                    old = self.procs[name]
                    new = self._process(name, shim=self.shim, old=False)
                    new.starts = old.starts  # one log, numbered on
                    self.procs[name] = new
                    self.stack.callback(new.stop)
                    new.start()
                old.kill(signal.SIGTERM)  # a warm shutdown beside its successor, as a rolling update's surge
                replaced.append(old)
        finally:
            for old in replaced:
                old.stop()  # SIGKILL after its grace period, as the kubelet does
        return (f"migrated to head in {migrated:.1f}s under the previous release ({self.result.release[:12]}); "
                f"replaced {', '.join(p.name for p in replaced)} in turn")  # fmt: skip

    def _delete_finished_pods(self) -> str:
        """`kubectl delete pod` of every finished Pod of ours, delivered or not: our finalizer must
        keep each result until it is recorded (what PodGC or a node scale-down would do). Tried
        again while the API server is restarting or answering errors.

        Raises:
            RuntimeError: the API server refused every try.
        """
        import urllib3
        from kubernetes import client

        for attempt in range(POD_DELETE_TRIES):
            try:
                return self._delete_finished_pods_once()
            except (client.ApiException, urllib3.exceptions.HTTPError) as e:
                if attempt == POD_DELETE_TRIES - 1 or self.stop.wait(1.0):
                    raise RuntimeError(f"deleting finished pods: {e.__class__.__name__}: {e}") from e
        raise AssertionError("unreachable")

    def _delete_finished_pods_once(self) -> str:
        from concurrent.futures import ThreadPoolExecutor

        from kubernetes import client

        with opened(self._cluster.harness_kubeconfig) as api:
            core = client.CoreV1Api(api)
            finished = [
                pod
                for namespace in NAMESPACES
                for pod in core.list_namespaced_pod(namespace, label_selector="batch.kubernetes.io/job-name").items
                if pod.status is not None
                and pod.status.phase in ("Succeeded", "Failed")
                and not (pod.metadata is not None and pod.metadata.deletion_timestamp)
            ]

            def delete(pod: Any) -> int:
                try:
                    core.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace, _request_timeout=10)
                except client.ApiException as e:
                    if e.status != 404:
                        log.warning("could not delete pod %s: %s", pod.metadata.name, e.status)
                    return 0
                return 1

            with ThreadPoolExecutor(max_workers=8) as pool:
                deleted = sum(pool.map(delete, finished))
        held = sum(pod.metadata is not None and FINALIZER in (pod.metadata.finalizers or []) for pod in finished)
        return f"deleted {deleted} of {len(finished)} finished pods ({held} held by our finalizer until delivered)"

    def _change_namespace(self) -> str:
        """A rolling deploy onto a capability file that moves every capability to another
        namespace: each worker in turn, then beat, restarted on it; the engine's router too."""
        from k8s_dispatch.core.settings import load_settings
        from k8s_dispatch.workers.resolver import CapabilityResolver

        config = capabilities_config(self.options.mode, idle=self.idle)
        for spec in config["capabilities"].values():
            spec.setdefault("namespace", MOVED_NAMESPACE)  # the idle ones stay where they are
        moved = self.dir / "capabilities-moved.yaml"
        moved.write_text(yaml.safe_dump(config))
        settings = load_settings(self.values | {"K8S_DISPATCH_CAPABILITIES": str(moved)})
        self._resolver = CapabilityResolver.from_settings(settings)
        self.caps_now = moved
        restarted = []
        for name in [*worker_names(self.options.workers), BEAT]:
            with self.proc_lock:
                if self.stop.is_set():
                    raise _Stop
                proc = self.procs[name]
                proc.env["K8S_DISPATCH_CAPABILITIES"] = str(moved)
                proc.stop()
                proc.start()
                restarted.append(name)
        return f"capabilities moved to namespace {MOVED_NAMESPACE}; restarted {', '.join(restarted)} in turn"

    def _flush_broker(self) -> str:
        """Every key under the run's prefix: queued and unacknowledged messages, bindings, claims."""
        from k8s_dispatch.delivery.stats import Stats

        for name, value in Stats(self.redis, prefix=self.prefix).all().items():
            self.result.stats[name] = self.result.stats.get(name, 0) + value  # counted before they go
        queued = 0
        for key in self.redis.scan_iter(match=f"{self.prefix}:k8s-dispatch.*", count=500):
            if self.redis.type(key) == b"list":
                queued += self.redis.llen(key)
        unacked = self.redis.hlen(f"{self.prefix}:unacked")
        deleted = _delete_prefix(self.redis, self.prefix)
        return f"deleted {deleted} keys: {queued} queued and {unacked} unacknowledged messages lost"

    def _kill_db_connections(self) -> int:
        with psycopg.connect(_conninfo(self.admin_url), autocommit=True, connect_timeout=10) as admin:
            rows = admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND application_name = %s",
                (self.result.database, WORKER_DB_APP),
            ).fetchall()
        return sum(1 for (killed,) in rows if killed)

    @property
    def _cluster(self) -> ChaosCluster:
        assert self.cluster is not None, "the cluster starts in _set_up"
        return self.cluster

    def _set_api_faults(self, rate: float, latency_ms: int) -> None:
        with self.cluster_lock:
            self._cluster.set_faults(rate, latency_ms)

    def _sleep_until(self, when: float) -> bool:
        """Wait until `when` (monotonic); False if the run is stopping."""
        return not self.stop.wait(max(0.0, when - time.monotonic()))

    # --- convergence and the verdict --------------------------------------------------------

    def _dispatch_ids(self) -> list[str]:
        with self.ids_lock:
            return list(self.ids.values())

    def _existing(self, ids: list[str]) -> set[str]:
        from k8s_dispatch.store.db import transaction

        found: set[str] = set()
        with transaction(self.sessions) as session:
            for chunk in _chunks(ids):
                found.update(session.scalars(sa.select(Dispatch.dispatch_id).where(Dispatch.dispatch_id.in_(chunk))))
        return found

    def _pending(self) -> int:
        """Dispatches the engine asked for that have not ended and been notified yet."""
        return pending(self.sessions, self._dispatch_ids(), planned=len(self.planned))

    def _all_jobs(self) -> list[dict[str, Any]]:
        return [job for ns in NAMESPACES for page in self.kube.iter_jobs(ns, label_selector="") for job in page]

    def _jobs_left(self) -> int:
        try:
            return len(self._all_jobs())
        except DispatchError:
            return -1

    def _claims(self) -> list[tuple[str, int]]:
        keys = list(self.redis.scan_iter(match=f"{self.prefix}:claim:*", count=500))
        return [(k.decode(), int(self.redis.pttl(k))) for k in keys]

    def _judge(self) -> None:
        from k8s_dispatch.delivery.stats import Stats

        result = self.result
        mode = self.options.mode
        wanted: dict[str, Expected] = {}
        with self.ids_lock:
            for planned in self.planned:
                dispatch_id = self.ids.get(planned.index, f"never-scheduled-{planned.index}")
                wanted[dispatch_id] = expected(planned.kind, planned.input, mode=mode)
            for dispatch_id in self.edited_ids & set(wanted):
                # Cancelled, or its Job edited by hand: any end will do, one, and no Job left;
                # an edited Job's dispatch may be re-run (a second Job), a cancelled one never.
                wanted[dispatch_id] = replace(wanted[dispatch_id], any_end=True,
                                              rerun_allowed=dispatch_id not in self.result.cancelled)  # fmt: skip
        seen = self.observer.seen() if self.observer is not None else {}
        peaks = self.observer.peaks() if self.observer is not None else {}
        result.samples = self.observer.samples if self.observer is not None else 0
        result.jobs_seen = sum(len(jobs) for jobs in seen.values())
        rows, events, namespaces = read_ends(self.sessions, list(wanted))
        result.by_namespace = dict(sorted(Counter(str(ns) for ns in namespaces.values()).items()))
        limits = limit_peaks(self.limits, of_deployment(peaks, self.settings.effective_deployment), tenancies=TENANCIES)
        result.verdict = judge(wanted, rows=rows, events=events, jobs=self._all_jobs(), claims=self._claims(),
                               namespaces=namespaces, jobs_seen=seen, limits=limits,
                               open_slots=open_slots(self.sessions))  # fmt: skip
        if self.neighbour is not None:
            result.neighbour = self.neighbour.judge(jobs_seen=seen, peaks=peaks)
            result.verdict = result.verdict.merged(result.neighbour)
        counted = Counter(result.stats)
        counted.update(Stats(self.redis, prefix=self.prefix).all())
        result.stats = dict(sorted(counted.items()))
        with self.cluster_lock:
            injected = self._cluster.injected()
        result.api_faults = sum(injected.values())
        result.api_faults_by_kind = dict(sorted(injected.items()))


def read_ends(
    sessions: Any, ids: list[str]
) -> tuple[dict[str, RowSnapshot], dict[str, list[TerminalEvent]], dict[str, str | None]]:
    """What the database says of `ids`: each row's end, each dispatch's terminal events in order,
    and the namespace each recorded for its Job."""
    from k8s_dispatch.store.db import transaction

    rows: dict[str, RowSnapshot] = {}
    events: dict[str, list[TerminalEvent]] = {}
    namespaces: dict[str, str | None] = {}
    terminal_types = sorted(t.value for t in TERMINAL_EVENT_TYPES)
    with transaction(sessions) as session:
        for chunk in _chunks(ids):
            for row in session.execute(
                sa.select(
                    Dispatch.dispatch_id, Dispatch.state, Dispatch.output, Dispatch.reason, Dispatch.notified_at,
                    Dispatch.job_namespace,
                ).where(Dispatch.dispatch_id.in_(chunk))
            ):  # fmt: skip
                rows[row.dispatch_id] = RowSnapshot(
                    state=str(row.state.value),
                    output=row.output,
                    reason=row.reason,
                    notified=row.notified_at is not None,
                )
                namespaces[row.dispatch_id] = row.job_namespace
            for event in session.execute(
                sa.select(CaseEvent.dispatch_id, CaseEvent.type, CaseEvent.payload)
                .where(CaseEvent.dispatch_id.in_(chunk), CaseEvent.type.in_(terminal_types))
                .order_by(CaseEvent.id)
            ):
                events.setdefault(event.dispatch_id, []).append(TerminalEvent(event.type, event.payload))
    return rows, events, namespaces


def open_slots(sessions: Any) -> tuple[int, int]:
    """(dispatches holding a slot, dispatches queued) in the whole database."""
    from k8s_dispatch.store import admission
    from k8s_dispatch.store.db import transaction

    with transaction(sessions) as session:
        rows = admission.summary(session)
    return sum(r.running for r in rows), sum(r.queued for r in rows)


def of_deployment(peaks: dict[tuple[str, str, str], int], deployment: str) -> dict[tuple[str, str], int]:
    """The observer's peaks of one deployment's Jobs, by (scope, name)."""
    return {(scope, name): n for (dep, scope, name), n in peaks.items() if dep == deployment}


def pending(sessions: Any, ids: list[str], *, planned: int) -> int:
    """Of `planned` dispatches (`ids` those scheduled so far), how many have not ended and been
    notified yet (all of them when the database cannot say)."""
    from k8s_dispatch.store.db import transaction
    from k8s_dispatch.store.models import TERMINAL_STATES

    try:
        with transaction(sessions) as session:
            done = 0
            for chunk in _chunks(ids):
                done += (
                    session.scalar(
                        sa.select(sa.func.count()).where(
                            Dispatch.dispatch_id.in_(chunk),
                            Dispatch.state.in_(sorted(TERMINAL_STATES)),
                            Dispatch.notified_at.is_not(None),
                        )
                    )
                    or 0
                )
    except DispatchError:
        return planned
    return planned - done


# --- helpers at the edges ------------------------------------------------------------------------


def _chunks(ids: list[str]) -> Iterator[list[str]]:
    for start in range(0, len(ids), ID_CHUNK):
        yield ids[start : start + ID_CHUNK]


def _conninfo(url: str) -> str:
    """A libpq URL for psycopg (without a SQLAlchemy driver suffix)."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _with_app_name(url: str, app_name: str) -> str:
    parsed = make_url(url)
    if parsed.get_backend_name() != "postgresql":
        return url
    return parsed.update_query_dict({"application_name": app_name}).render_as_string(hide_password=False)


def _drop_database(admin_url: str, name: str) -> None:
    with psycopg.connect(_conninfo(admin_url), autocommit=True, connect_timeout=10) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _delete_prefix(client: redis.Redis, prefix: str) -> int:
    deleted = 0
    batch: list[bytes] = []
    for key in client.scan_iter(match=f"{prefix}:*", count=1000):
        batch.append(key)
        if len(batch) >= 500:
            deleted += client.delete(*batch)
            batch = []
    if batch:
        deleted += client.delete(*batch)
    return deleted


# --- the report ----------------------------------------------------------------------------------


def render(result: ChaosResult, console: Any) -> None:
    """Print what the run did and found as tables on a rich Console (not the final line)."""
    from rich.table import Table

    options, verdict = result.options, result.verdict
    setup = Table(title="chaos run", show_header=False)
    setup.add_column(style="bold")
    setup.add_column()
    for name, value in (
        ("seed", options.seed),
        ("dispatches", f"{options.dispatches} at {options.rate:g}/s (feed {result.feed_s:.1f}s)"),
        ("processes", f"{options.workers} x celery -A k8s_dispatch.tasks worker, celery -A k8s_dispatch.tasks beat"),
        ("cluster", _cluster_words(options)),
        ("deployment", ", ".join(f"{k.lower()}={v}" for k, v in DEPLOYMENT_SETTINGS.items())),
        ("database / prefix", f"{result.database} / {result.prefix}"),
        ("converged", f"{result.converged_s:.1f}s after the faults stopped" if result.converged_s is not None
         else f"NOT within {options.deadline_s:g}s"),
        ("wall time", f"{result.wall_s:.1f}s"),
    ):  # fmt: skip
        setup.add_row(name, str(value))
    console.print(setup)

    faults = Table(title="faults (planned from the seed, then done)")
    for column in ("fault", "planned", "done", "what happened"):
        faults.add_column(column)
    for kind in FaultKind:
        done = [d for d in result.done if d.fault.kind is kind]
        if not done and not result.plan.count(kind):
            continue
        if kind is FaultKind.KILL:
            by_target = Counter(d.fault.target for d in done if d.ok)
            what = ", ".join(f"{t} x{n}" for t, n in sorted(by_target.items()))
        elif kind is FaultKind.API_FAULTS_ON:
            kinds = ", ".join(f"{k} x{n}" for k, n in result.api_faults_by_kind.items())
            what = f"{done[0].detail if done else ''}; {result.api_faults} injected ({kinds})"
        else:
            what = "; ".join(d.detail for d in done)
        failed = [d for d in done if not d.ok]
        if failed:
            what += f" [red]{len(failed)} failed: {failed[0].detail}[/red]"
        faults.add_row(kind.value, str(result.plan.count(kind)), str(sum(d.ok for d in done)), what)
    if result.unexpected_exits:
        faults.add_row("unexpected exits", "0", str(len(result.unexpected_exits)), "; ".join(result.unexpected_exits))
    if result.deaf:
        faults.add_row("deaf after the Redis restart", "0", str(len(result.deaf)), "; ".join(result.deaf))
    if result.unexpected_errors:
        faults.add_row("exceptions escaping a task", "0", str(len(result.unexpected_errors)),
                       "; ".join(result.unexpected_errors[:5]))  # fmt: skip
    console.print(faults)

    outcomes = Table(title="terminal events")
    outcomes.add_column("event")
    outcomes.add_column("dispatches", justify="right")
    for outcome, count in sorted(verdict.outcomes.items()):
        outcomes.add_row(outcome, str(count))
    console.print(outcomes)

    checks = Table(title="checks")
    for column in ("check", "found", ""):
        checks.add_column(column)
    for name, value in (
        ("lost (no terminal event)", verdict.lost),
        ("duplicates (more than one terminal event)", verdict.duplicates),
        ("wrong output or reason", verdict.wrong_output),
        ("leftover jobs or finalizers", verdict.leftover_jobs),
        ("dispatches with a second Job", verdict.second_jobs),
        ("dispatches with a Job outside their recorded namespace", verdict.wrong_namespace),
        ("Jobs running beyond a limit (worst sample)", max(0, verdict.limit_exceeded or 0)),
        ("dispatches holding a slot after convergence", verdict.running),
        ("dispatches queued after convergence", verdict.queued),
        ("guard claims held past their lease", verdict.held_claims),
        ("ended without the engine told", verdict.unnotified),
    ):
        checks.add_row(name, str(value), "[green]ok[/green]" if value == 0 else "[red]FAIL[/red]")
    for name, value in sorted(result.stats.items()):
        checks.add_row(f"stat: {name}", str(value), "")
    checks.add_row("schedule task calls sent again by the engine", str(result.resends), "")
    checks.add_row("Jobs the observer saw", str(result.jobs_seen), "")
    if result.neighbour is not None:
        n = result.neighbour
        checks.add_row(f"second deployment: {n.dispatched} dispatches, {n.terminal} ended",
                       "clean" if n.ok else "NOT clean", "[green]ok[/green]" if n.ok else "[red]FAIL[/red]")  # fmt: skip
    console.print(checks)
    if verdict.limits:
        limits = Table(title=f"fair-share limits: the most Jobs running at once, {result.samples} samples 100 ms apart")
        for column in ("limit", "maxRunning", "most running", "most queued (database)", ""):
            limits.add_column(column)
        for peak in verdict.limits:
            queued = str(result.queued_peak.get(peak.name, 0)) if peak.scope == "tenancy" else ""
            mark = "[green]ok[/green]" if peak.excess <= 0 else "[red]FAIL[/red]"
            limits.add_row(f"{peak.scope} {peak.name}", str(peak.limit), str(peak.peak), queued, mark)
        console.print(limits)
    for problem in verdict.problems:
        console.print(f"[red]{problem}[/red]")
    if result.error:
        console.print(f"[red]error: {result.error}[/red]")
    if not result.ok:
        console.print(f"logs and cluster state kept in {result.work_dir}")


def _cluster_words(options: ChaosOptions) -> str:
    if options.cluster == LOCALCLUSTER:
        return f"localcluster serve --mode {options.mode}"
    return (f"realcluster: etcd, kube-apiserver, kube-controller-manager, node agent --mode {options.mode}; "
            "workers through faultproxy as deploy/rbac.yaml's ServiceAccount")  # fmt: skip
