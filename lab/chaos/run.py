"""The chaos run: the whole system abused on a seeded schedule, then checked for anything lost,
doubled, wrong or left over (`python -m k8s_dispatch.lab chaos`, `make chaos`).

`run(options)` starts a PostgreSQL instance, a redis-server and an object store (SeaweedFS) of its
own (`lab.chaos.services`: restarting them hurts no one else), the cluster (`localcluster serve`, or the real control plane
behind a fault proxy: `lab.chaos.cluster`), W `celery -A k8s_dispatch.tasks worker` processes and
`celery -A k8s_dispatch.tasks beat` as a user would (from the previous release when the run rehearses
a rolling upgrade: `lab.chaos.upgrade`), and feeds N dispatches at a steady rate while
`lab.chaos.fault_plan` kills processes, flushes and restarts the broker, breaks and restarts the API
server, kills database connections and restarts the database, restarts the object store, steps clocks,
loses cancels and edits Jobs by hand (`lab.chaos.edits`). Then it stops the faults, waits for
convergence and judges the end state (`lab.chaos.checks`), the object store's and the secret
inputs' included (`lab.chaos.objects`). Every process, server, worktree and temp dir is removed at the
end, whatever happened.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import psycopg
import redis
import yaml
from sqlalchemy.engine import make_url

from k8s_dispatch.core.errors import DispatchError
from k8s_dispatch.lab.chaos import cluster as chaos_cluster
from k8s_dispatch.lab.chaos.checks import story, unexpected_task_errors
from k8s_dispatch.lab.chaos.cluster import CLUSTERS
from k8s_dispatch.lab.chaos.convergence import Convergence, slot_dispatches
from k8s_dispatch.lab.chaos.fault_plan import BEAT, worker_names
from k8s_dispatch.lab.chaos.faults import FaultExecutor
from k8s_dispatch.lab.chaos.feeder import Feeder
from k8s_dispatch.lab.chaos.options import (
    DEPLOYMENT_SETTINGS,
    HARNESS_DB_APP,
    MESSAGE_SCAN_S,
    NAMESPACE,
    NAMESPACES,
    OBJECT_STORE_SETTINGS,
    PROGRESS_EVERY_S,
    QUEUE_COUNT_S,
    SKEW_S,
    START_TIMEOUT_S,
    STORIES,
    THREAD_JOIN_S,
    TICK_S,
    WORKER_DB_APP,
    ChaosOptions,
    ChaosResult,
    fault_plan,
    stepped_worker,
)
from k8s_dispatch.lab.chaos.report import render
from k8s_dispatch.lab.chaos.services import (
    STORE_BUCKET,
    OwnObjectStore,
    OwnPostgres,
    OwnRedis,
    SteppedClock,
    build_sleep_shim,
)
from k8s_dispatch.lab.chaos.stores import conninfo, delete_prefix, drop_database, with_app_name
from k8s_dispatch.lab.chaos.upgrade import PreviousRelease
from k8s_dispatch.lab.chaos.workload import capabilities_config, idle_namespaces, stored_results
from k8s_dispatch.ops import interrupts
from k8s_dispatch.ops.processes import WaitTimeout, wait_for_log, wait_until

__all__ = ["ChaosOptions", "ChaosResult", "fault_plan", "render", "run"]

log = logging.getLogger(__name__)


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


class _Run(Feeder, FaultExecutor, Convergence):
    """One run's steps on its resources (lab.chaos.state): set-up, the run, tear-down;
    `__exit__` releases them all."""

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
        self.own_store, self.stored = None, None
        store_values: dict[str, str] = {}
        if options.objectstore:
            from cryptography.fernet import Fernet

            self.own_store = OwnObjectStore(directory=self.dir / "objectstore", log_dir=self.dir, env=server_env)
            self.stack.callback(self.own_store.stop)
            self.own_store.start()
            self.stored = stored_results(self.planned, prefix=self.object_prefix)
            store_values = {f"K8S_DISPATCH_{k}": v for k, v in
                            (self.own_store.settings(self.object_prefix) | OBJECT_STORE_SETTINGS).items()}  # fmt: skip
            store_values["K8S_DISPATCH_INPUT_KEY"] = Fernet.generate_key().decode()
            if options.mode == "simulate":
                self._write_stored_results()

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
        caps_path.write_text(yaml.safe_dump(capabilities_config(options.mode, idle=self.idle, stored=self.stored)))
        cluster = chaos_cluster.make(options.cluster, directory=self.dir, mode=options.mode,
                                     namespaces=self.all_namespaces, env=base_env,
                                     ready_gate=options.api_ready_gate)  # fmt: skip
        self.stack.callback(cluster.stop)
        cluster.start()
        self.cluster = cluster
        values = {
            "K8S_DISPATCH_DATABASE_URL": with_app_name(self.db_url, WORKER_DB_APP),
            "K8S_DISPATCH_REDIS_URL": self.redis_url,
            "K8S_DISPATCH_KEY_PREFIX": self.prefix,
            "K8S_DISPATCH_NAMESPACE": NAMESPACE,
            "K8S_DISPATCH_CAPABILITIES": str(caps_path),
            "K8S_DISPATCH_KUBECONFIG": str(cluster.worker_kubeconfig),
            **{f"K8S_DISPATCH_{k}": v for k, v in DEPLOYMENT_SETTINGS.items()},
            **store_values,
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

        self.observer = JobObserver(cluster.harness_kubeconfig, scan=self.scan)
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

    def _write_stored_results(self) -> None:
        """Simulate mode: each stored-result dispatch's first attempt's object, written as its
        container would have (nothing runs in a simulated Pod; its message is the reference)."""
        assert self.own_store is not None and self.stored is not None
        by_capability = {p.capability: p for p in self.planned if p.stored is not None}
        client = self.own_store.client()
        try:
            for stored in self.stored:
                plan = by_capability[stored.capability].stored
                assert plan is not None
                client.put_object(Bucket=STORE_BUCKET, Key=stored.key, Body=plan.data())
        finally:
            client.close()

    def _create_database(self) -> str:
        name = f"k8s_dispatch_chaos_{self.tag}"
        admin_url = self.admin_url
        with psycopg.connect(conninfo(admin_url), autocommit=True, connect_timeout=10) as admin:
            admin.execute(f'CREATE DATABASE "{name}"')
        self.stack.callback(drop_database, admin_url, name)
        return make_url(admin_url).set(database=name).render_as_string(hide_password=False)

    def _create_engine_side(self) -> None:
        """The engine's connection (its own application_name: the DB_KILL spares it) and cases."""
        from celery import Celery

        from k8s_dispatch import celeryconfig
        from k8s_dispatch.lab.chaos.workload import cases
        from k8s_dispatch.store import scheduling
        from k8s_dispatch.store.db import make_engine, make_sessionmaker, transaction

        self.engine = make_engine(with_app_name(self.db_url, HARNESS_DB_APP))
        self.stack.callback(self.engine.dispose)
        self.sessions = make_sessionmaker(self.engine)
        self.producer = Celery("k8s-dispatch-chaos-engine", set_as_current=False)
        self.producer.conf.update(celeryconfig.config(self.settings))
        self.stack.callback(self.producer.close)
        with transaction(self.sessions) as session:
            for case_id, tenancy_id in cases(self.tag):
                scheduling.create_case(session, case_id=case_id, tenancy_id=tenancy_id)

    def _delete_keys(self) -> None:
        try:
            delete_prefix(self.redis, self.prefix)
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
        next_report, last_said = time.monotonic() + PROGRESS_EVERY_S, (-1, -1, -1, -1)
        only_slots: float | None = None  # when all that was left was slots held by ended dispatches
        while time.monotonic() < deadline:
            self._tick()
            pending, jobs = self._pending() + (self.neighbour.pending() if self.neighbour else 0), self._jobs_left()
            held = self._pods_held() if pending == 0 and jobs == 0 else -1  # Pods are freed before their Job
            # An ended dispatch's slot frees once its Job is seen stopped, which may be a sweep after it is gone.
            slots = self._slots_held() if held == 0 else -1
            if slots > 0 and only_slots is None:
                only_slots = time.monotonic()
                self.progress(f"chaos: converging: every dispatch ended and notified, no job or pod left; "
                              f"{slots} slots still held, waiting for them to be freed: {self._slot_words()}")  # fmt: skip
            if slots == 0:
                converged = True
                break
            if time.monotonic() >= next_report and (pending, jobs, held, slots) != last_said:  # once while it stays
                next_report, last_said = time.monotonic() + PROGRESS_EVERY_S, (pending, jobs, held, slots)
                self.progress(f"chaos: converging: {pending} dispatches not ended and notified, {jobs} jobs left"
                              + (f", {held} pods held" if held > 0 else "")
                              + (f", {slots} slots held" if slots > 0 else ""))  # fmt: skip
            time.sleep(TICK_S)
        if only_slots is not None:
            result.slots_wait_s = time.monotonic() - only_slots
            self.progress(f"chaos: slots held after the rest converged: {'freed' if converged else 'NOT freed'} "
                          f"after {result.slots_wait_s:.1f}s")  # fmt: skip
        if converged:
            result.converged_s = time.monotonic() - stopped
            # A claim is released by its holder or expires with its lease: none may stay longer.
            lease_s = self.settings.guard_lease_ms / 1000
            with contextlib.suppress(WaitTimeout):  # judged below
                wait_until(lambda: not self._claims(), timeout=lease_s + 5, interval=TICK_S, what="no guard claim")
        self.result.deaf = self._deaf_after_broker_restart()
        logs = {path.relative_to(self.dir).as_posix(): path.read_text(errors="replace")
                for path in sorted(self.dir.glob("**/*.log"))}  # fmt: skip
        self.result.unexpected_errors = unexpected_task_errors({n: t for n, t in logs.items() if "worker" in n})
        self._judge()
        if self.own_store is not None:
            self._judge_objects(logs)
        self.result.stories = {d: story(logs, d) for d in self.result.verdict.suspects[:STORIES]}

    def _slot_words(self) -> str:
        """The dispatches of this deployment that hold a slot, as the progress line names them."""
        try:
            return "; ".join(h.describe() for h in slot_dispatches(self.sessions)) or "by the second deployment"
        except DispatchError as e:
            return f"cannot say ({e.__class__.__name__})"

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
        self._scan_messages()

    def _scan_messages(self) -> None:
        """Read the Celery messages in the broker now (queued and unacknowledged) for the secret
        inputs' markers (once a MESSAGE_SCAN_S)."""
        if not self.scan.markers or time.monotonic() < self.next_message_scan or not hasattr(self, "redis"):
            return
        self.next_message_scan = time.monotonic() + MESSAGE_SCAN_S
        try:
            for key in self.redis.scan_iter(match=f"{self.prefix}:*", count=1000, _type="list"):
                for raw in self.redis.lrange(key, 0, -1):
                    self.scan.scan_message(raw, where=key.decode(errors="replace"))
            for raw in self.redis.hvals(f"{self.prefix}:unacked"):
                self.scan.scan_message(raw, where="unacked")
        except redis.RedisError as e:
            log.debug("cannot read the broker's messages now: %s", e)

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
