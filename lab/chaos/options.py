"""A chaos run's options and result: what the run is told (`ChaosOptions`, and the deployment and
timings it is run with), the plan it derives from them (`fault_plan`), and what it found
(`ChaosResult`, `FaultDone`): its final line and its JSON."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k8s_dispatch.lab.chaos.checks import Verdict
from k8s_dispatch.lab.chaos.cluster import LOCALCLUSTER
from k8s_dispatch.lab.chaos.fault_plan import BEAT, Fault, FaultKind, FaultPlan, make_plan, worker_names
from k8s_dispatch.lab.chaos.objects import ObjectVerdict
from k8s_dispatch.lab.chaos.workload import MAP_EVERY

NAMESPACE = "chaos"
# Where the capabilities move at the NAMESPACE_CHANGE fault: work scheduled before stays where it was.
MOVED_NAMESPACE = "chaos-moved"
NAMESPACES = (NAMESPACE, MOVED_NAMESPACE)  # where the work runs; the idle namespaces come on top
SKEW_S = 60.0  # the clock of the first worker (faketime), against every other host's
CLOCK_STEP_S = 600.0  # the first worker's clock steps forward by this much, beat's back
# The previous release the rolling upgrade starts from (a commit-ish of this clone).
DEFAULT_UPGRADE_FROM = "HEAD~1"
CANCELS_PER_FAULT = 3  # running dispatches one LOST_CANCEL cancels
OUTAGE_S = 2.0  # how long a restarted Redis, PostgreSQL or object store stays down
MESSAGE_SCAN_S = 1.0  # how often the Celery messages in the broker are read for secret markers
# The object store's deployment settings: orphans of an ended dispatch are deleted by the sweep
# after this grace (the sweep runs every 5 minutes at most: seldom within a short run).
OBJECT_STORE_SETTINGS = {"OBJECT_STORE_ORPHAN_GRACE_S": "30"}
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
STORIES = 3  # the suspect dispatches whose log lines a failed run's report shows
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
    maps: int | None = None  # map dispatches among `dispatches`; None: one per workload.MAP_EVERY
    # The run's own object store (SeaweedFS): stored results, secret inputs, archived logs, and
    # `objectstore_restarts` restarts of it; False: none of them.
    objectstore: bool = True
    objectstore_restarts: int = 1
    large_results: int = 5  # dispatches among `dispatches` whose results (1-3 MiB) go to the store
    secret_inputs: int = 6  # dispatches among `dispatches` with a secret input
    upgrade_from: str | None = DEFAULT_UPGRADE_FROM  # the previous release's ref; None: no upgrade
    database_url: str | None = None  # use this database (not dropped); default: a fresh one
    admin_database_url: str | None = None  # where the fresh database is created; default: our own server
    redis_url: str | None = None  # default: a redis-server of the run's own
    work_dir: Path | None = None  # logs and cluster state; default: a temp dir, kept if the run fails

    @property
    def map_count(self) -> int:
        return self.maps if self.maps is not None else self.dispatches // MAP_EVERY

    @property
    def large_count(self) -> int:
        return self.large_results if self.objectstore else 0

    @property
    def secret_count(self) -> int:
        return self.secret_inputs if self.objectstore else 0

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
    # How long slots stayed held by ended dispatches once nothing else was left (None: never so).
    slots_wait_s: float | None = None
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
    stories: dict[str, list[str]] = field(default_factory=dict)  # a suspect dispatch -> its last log lines
    objects: ObjectVerdict = field(default_factory=ObjectVerdict)  # the object store's and the secrets' checks

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
                and not self.unexpected_errors and self.objects.ok)  # fmt: skip

    @property
    def objectstore_restarts(self) -> int:
        return self.count_done(FaultKind.OBJECTSTORE_RESTART)

    def final_line(self) -> str:
        v, o = self.verdict, self.objects
        converged = f"{self.converged_s:.1f}" if self.converged_s is not None else "timeout"
        return (
            f"chaos: dispatched={v.dispatched} terminal={v.terminal} lost={v.lost} duplicates={v.duplicates} "
            f"wrong_output={v.wrong_output} leftover_jobs={v.leftover_jobs} second_jobs={v.second_jobs} "
            f"limit_exceeded={'none' if v.limit_exceeded is None else v.limit_exceeded} running={v.running} "
            f"queued={v.queued} items={v.items} items_lost={v.items_lost} items_duplicates={v.items_duplicates} "
            f"items_wrong_output={v.items_wrong_output} held_pods={v.held_pods} kills={self.kills} "
            f"broker_flushes={self.broker_flushes} api_faults={self.api_faults} converged_s={converged} "
            f"seed={self.options.seed}"
            + (f" large_results={o.large} large_bad={o.large_bad} orphan_objects={o.orphan_objects} "
               f"logs_archived={o.logs_archived} logs_missing={o.logs_missing} secret_inputs={o.secrets} "
               f"secret_leaks={o.secret_leaks} objectstore_restarts={self.objectstore_restarts}"
               if self.options.objectstore else "")
        )  # fmt: skip

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
            "maps": v.maps,
            "items": v.items,
            "items_lost": v.items_lost,
            "items_duplicates": v.items_duplicates,
            "items_wrong_output": v.items_wrong_output,
            "held_pods": v.held_pods,
            "item_outcomes": dict(sorted(v.item_outcomes.items())),
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
            "objectstore_restarts": self.objectstore_restarts,
            "large_results": self.objects.large,
            "large_bad": self.objects.large_bad,
            "objects": self.objects.objects,
            "orphan_objects": self.objects.orphan_objects,
            "logs_archived": self.objects.logs_archived,
            "logs_missing": self.objects.logs_missing,
            "other_logs_missing": self.objects.other_logs_missing,
            "secret_inputs": self.objects.secrets,
            "secret_leaks": self.objects.secret_leaks,
            "secret_scanned": self.objects.scanned,
            "object_problems": self.objects.problems,
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
            "slots_wait_s": round(self.slots_wait_s, 1) if self.slots_wait_s is not None else None,
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
        objectstore_restarts=options.objectstore_restarts if options.objectstore else 0,
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
               FaultKind.LABEL_EDIT, FaultKind.OBJECTSTORE_RESTART)  # fmt: skip
