"""A second deployment on the chaos run's namespace: its own database and key prefix (so its own
deployment label), one worker and beat, its own dispatches fed at a steady rate, and no faults of
its own: only those of the servers it shares with the run (the run's own Redis and PostgreSQL
restarted, the API's errors and restart). Both deployments use `ORPHAN_POLICY=delete`: had either seen the other's Jobs, it would
delete them as orphans, and their work would end JobLost. Judged on its own, then added to the
run's verdict: both must end clean.
"""

from __future__ import annotations

import threading
import time
import uuid
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

import psycopg
import redis
import yaml
from sqlalchemy.engine import make_url

from k8s_dispatch.lab.chaos.checks import Verdict, judge, limit_peaks
from k8s_dispatch.lab.chaos.convergence import of_deployment, open_slots, pending, read_ends
from k8s_dispatch.lab.chaos.stores import conninfo, delete_prefix, drop_database
from k8s_dispatch.lab.chaos.workload import TENANCIES, Expected, capabilities_config, cases, expected, workload
from k8s_dispatch.ops.processes import ManagedProcess, celery_beat, celery_worker, wait_for_log

NAME = "neighbour"
START_TIMEOUT_S = 90.0


class Neighbour:
    def __init__(self, options: Any, *, tag: str, directory: Path, env: dict[str, str], values: dict[str, str],
                 count: int, stack: ExitStack) -> None:  # fmt: skip
        self.options = options
        self.tag = f"{tag}n"
        self.dir = directory
        self.stack = stack
        self.prefix = f"k8s-dispatch-chaos-{self.tag}"
        self.base_env = env
        self.values = dict(values)
        self.planned = workload(options.seed + 1, count, tag=self.tag, task_every=0)
        self.ids: dict[int, str] = {}
        self.ids_lock = threading.Lock()
        self.procs: dict[str, ManagedProcess] = {}

    def start(self) -> None:
        from celery import Celery

        from k8s_dispatch import celeryconfig
        from k8s_dispatch.core.settings import load_settings
        from k8s_dispatch.store import scheduling
        from k8s_dispatch.store.db import make_engine, make_sessionmaker, transaction
        from k8s_dispatch.store.migrate import upgrade

        options = self.options
        self.dir.mkdir(parents=True, exist_ok=True)
        self.redis = redis.Redis.from_url(options.redis_url, socket_timeout=10, socket_connect_timeout=10)
        self.stack.callback(self.redis.close)
        self.stack.callback(delete_prefix, self.redis, self.prefix)
        name = f"k8s_dispatch_chaos_{self.tag}"
        with psycopg.connect(conninfo(options.admin_database_url), autocommit=True, connect_timeout=10) as admin:
            admin.execute(f'CREATE DATABASE "{name}"')
        self.stack.callback(drop_database, options.admin_database_url, name)
        self.database = name
        db_url = make_url(options.admin_database_url).set(database=name).render_as_string(hide_password=False)
        upgrade(db_url)
        caps = self.dir / "capabilities.yaml"
        caps.write_text(yaml.safe_dump(capabilities_config(options.mode)))
        self.values |= {
            "K8S_DISPATCH_DATABASE_URL": db_url,
            "K8S_DISPATCH_KEY_PREFIX": self.prefix,
            "K8S_DISPATCH_CAPABILITIES": str(caps),
        }
        prefix = "K8S_DISPATCH_OBJECT_STORE_PREFIX"
        if prefix in self.values:  # the run's store, its own prefix: neither's sweep sees the other's objects
            self.values[prefix] += "-neighbour"
        self.settings = load_settings(self.values)
        env = self.base_env | self.values
        self.engine = make_engine(db_url)
        self.stack.callback(self.engine.dispose)
        self.sessions = make_sessionmaker(self.engine)
        self.producer = Celery("k8s-dispatch-chaos-neighbour", set_as_current=False)
        self.producer.conf.update(celeryconfig.config(self.settings))
        self.stack.callback(self.producer.close)
        with transaction(self.sessions) as session:
            for case_id, tenancy_id in cases(self.tag):
                scheduling.create_case(session, case_id=case_id, tenancy_id=tenancy_id)
        worker = celery_worker(
            f"{NAME}-worker", env=env, log_dir=self.dir, concurrency=self.settings.worker_concurrency
        )
        beat = celery_beat(env=env, log_dir=self.dir, name=f"{NAME}-beat")
        for proc in (worker, beat):
            self.procs[proc.name] = proc
            self.stack.callback(proc.stop)
            proc.start()
        wait_for_log(worker, " ready.", timeout=START_TIMEOUT_S)
        wait_for_log(beat, "beat: Starting", timeout=START_TIMEOUT_S)

    def feed(self, stop: threading.Event, window_s: float) -> None:
        """Schedule the neighbour's dispatches evenly over `window_s` (the Python call path)."""
        from k8s_dispatch.core.errors import DispatchError
        from k8s_dispatch.store.db import transaction
        from k8s_dispatch.tasks.scheduling import schedule_in_session
        from k8s_dispatch.workers.resolver import CapabilityResolver

        resolver = CapabilityResolver.from_settings(self.settings)
        started = time.monotonic()
        for planned in self.planned:
            if stop.wait(max(0.0, started + planned.index * window_s / len(self.planned) - time.monotonic())):
                return
            while not stop.is_set():
                try:
                    with transaction(self.sessions) as session:
                        scheduled = schedule_in_session(
                            session, via=self.producer, case_id=planned.case_id, tenancy_id=planned.tenancy_id,
                            capability=planned.capability, input=planned.input,
                            idempotency_key=planned.idempotency_key, router=resolver,
                            max_input_bytes=self.settings.max_input_bytes,
                        )  # fmt: skip
                except DispatchError:
                    stop.wait(0.2)
                    continue
                with self.ids_lock:
                    self.ids[planned.index] = scheduled.dispatch_id
                break

    def pending(self) -> int:
        with self.ids_lock:
            ids = list(self.ids.values())
        return pending(self.sessions, ids, planned=len(self.planned))

    def slots_held(self) -> int:
        """Slots held in its database. Raises DispatchError: the database cannot say."""
        return open_slots(self.sessions)[0]

    def revive(self) -> list[str]:
        notes = []
        for name, proc in self.procs.items():
            if not proc.alive:
                notes.append(f"{name} exited by itself with code {proc.returncode} (restarted)")
                proc.start()
        return notes

    def judge(self, *, jobs_seen: dict[str, set[tuple[str, str]]], peaks: dict[tuple[str, str, str], int]) -> Verdict:
        """Its dispatches' ends; its own Jobs' peaks (`peaks`: the observer's, of every deployment)
        against its limits; what holds or waits for a slot in its database."""
        from k8s_dispatch.workers.resolver import CapabilityResolver

        wanted: dict[str, Expected] = {}
        with self.ids_lock:
            for planned in self.planned:
                dispatch_id = self.ids.get(planned.index, f"never-scheduled-{uuid.uuid4()}")
                wanted[dispatch_id] = expected(planned.kind, planned.input, mode=self.options.mode)
        rows, events, namespaces = read_ends(self.sessions, list(wanted))
        claims = [(k.decode(), int(self.redis.pttl(k))) for k in self.redis.scan_iter(match=f"{self.prefix}:claim:*")]
        limits = CapabilityResolver.from_settings(self.settings).limits
        own = of_deployment(peaks, self.settings.effective_deployment)
        named = [replace(p, scope=f"{NAME} {p.scope}") for p in limit_peaks(limits, own, tenancies=TENANCIES)]
        # jobs=(): what is left in the cluster is counted once, by the run, over every deployment's Jobs
        return judge(wanted, rows=rows, events=events, jobs=(), claims=claims, namespaces=namespaces,
                     jobs_seen=jobs_seen, limits=named, open_slots=open_slots(self.sessions))  # fmt: skip
