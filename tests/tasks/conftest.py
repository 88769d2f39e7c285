"""Real Celery processes for the task tests: `deploy(cluster, ...)` builds a `Deployment` per call
with its own Redis key prefix (its queues meet no other test's), its own namespace, its own
PostgreSQL database (a sweep acts on the whole database, so no test may see another's rows)
and a cluster: localcluster, or with `any_cluster` each of localcluster and the real control
plane in turn (the namespace is created first where the API server requires it). Workers and beat are `celery -A k8s_dispatch.tasks worker|beat`
subprocesses (started with `ops.processes`) configured only through K8S_DISPATCH_* variables,
as in production, and stopped with SIGTERM at the end; one that needs SIGKILL fails the test.
"""

from __future__ import annotations

import base64
import json
import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
import yaml
from celery import Celery
from clusters import ClusterHandle

from k8s_dispatch import celeryconfig
from k8s_dispatch.core.settings import Settings, load_settings
from k8s_dispatch.delivery import shutdown
from k8s_dispatch.demo.localcluster import LocalCluster
from k8s_dispatch.ops import processes
from k8s_dispatch.store import dispatches, migrate, scheduling
from k8s_dispatch.store.db import make_engine, make_sessionmaker, transaction
from k8s_dispatch.store.models import Dispatch, EventType
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.kube import KubeClient

START_TIMEOUT_S = 90.0  # a Celery worker's start: seconds when the machine is quiet
# A worker's stop: its running tasks (poll's watch slice) and its last pass over our Pods being deleted.
STOP_TIMEOUT_S = 30.0 + shutdown.MAX_S


def wait_until(
    predicate: Callable[[], Any],
    *,
    timeout_s: float = 30.0,
    what: str = "condition",
    on_fail: Callable[[], str] = lambda: "",
) -> Any:
    """Poll `predicate` until it returns something truthy; after `timeout_s`, fail with `on_fail()`."""
    return processes.wait_until(predicate, timeout=timeout_s, what=what, details=on_fail)


class Proc:
    """A `ops.processes.ManagedProcess` (celery worker or beat), started, with log helpers."""

    def __init__(self, managed: processes.ManagedProcess) -> None:
        self.managed = managed.start()
        self.name = managed.name
        self.log_path = managed.log_path

    @property
    def popen(self) -> subprocess.Popen[bytes]:
        assert self.managed.popen is not None
        return self.managed.popen

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 60) -> str:
        return f"--- {self.log_path.name} ---\n{self.managed.log_tail(lines)}"

    def wait_for_log(self, text: str, *, timeout_s: float = 30.0) -> None:
        def seen() -> bool:
            if not self.managed.alive:
                pytest.fail(f"{self.name} exited with {self.managed.returncode} before logging {text!r}\n{self.tail()}")
            return text in self.log()

        wait_until(seen, timeout_s=timeout_s, what=f"{text!r} in {self.log_path.name}", on_fail=self.tail)

    def stop(self, *, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM (Celery's warm shutdown); a process that needs SIGKILL returns -9 (a failure)."""
        return self.managed.stop(timeout=timeout_s)


@dataclass
class Deployment:
    """One test's k8s-dispatch: settings, producer app, DB and cluster access, its processes."""

    settings: Settings
    env: dict[str, str]
    cluster: LocalCluster | ClusterHandle
    tmp: Path
    producer: Celery
    sessions: Any
    kube: KubeClient
    redis: redis.Redis
    procs: list[Proc] = field(default_factory=list)

    @property
    def namespace(self) -> str:
        return self.settings.namespace

    @property
    def prefix(self) -> str:
        return self.settings.key_prefix

    def start_worker(
        self, name: str, *, env: dict[str, str] | None = None, wait: bool = True, queues: str | None = None
    ) -> Proc:
        """A worker of the deployment; `queues` ("a,b"): only those consumed (Celery's -Q)."""
        extra = ("-Q", queues) if queues else ()
        environ = {**self.env, **(env or {})}
        concurrency = self.settings.worker_concurrency
        proc = Proc(processes.celery_worker(name, env=environ, log_dir=self.tmp, concurrency=concurrency, extra=extra))
        self.procs.append(proc)
        if wait:  # a start's time is not under test: room for a machine busy with the suite's other files
            proc.wait_for_log(" ready.", timeout_s=START_TIMEOUT_S)
        return proc

    def start_beat(self, name: str = "beat") -> Proc:
        proc = Proc(processes.celery_beat(env=self.env, log_dir=self.tmp, name=name))
        self.procs.append(proc)
        proc.wait_for_log("beat: Starting")
        return proc

    def wait(self, predicate: Callable[[], Any], *, timeout_s: float = 30.0, what: str = "condition") -> Any:
        """Poll `predicate` with a deadline; on failure show the processes' logs."""
        return wait_until(predicate, timeout_s=timeout_s, what=what, on_fail=self.logs)

    def logs(self) -> str:
        return "\n".join(p.tail() for p in self.procs)

    # --- the engine's side ---------------------------------------------------------------

    def new_case(self, tenancy: str = "tenant-a") -> str:
        case_id = f"case-{uuid.uuid4().hex[:10]}"
        with transaction(self.sessions) as session:
            scheduling.create_case(session, case_id=case_id, tenancy_id=tenancy)
        return case_id

    def schedule_batch(self, capability: str, count: int) -> list[str]:
        """`count` dispatches of `capability` on one new case, in one engine transaction
        (`schedule_many_in_session`: `create_jobs` sent after commit); their ids."""
        from k8s_dispatch.tasks.scheduling import schedule_many_in_session
        from k8s_dispatch.workers.resolver import CapabilityResolver

        case_id = self.new_case()
        requests = [
            scheduling.ScheduleRequest(case_id, "tenant-a", capability, {"i": i}, f"key-{uuid.uuid4()}")
            for i in range(count)
        ]
        with transaction(self.sessions) as session:
            results = schedule_many_in_session(
                session, requests, router=CapabilityResolver.from_settings(self.settings),
                max_input_bytes=self.settings.max_input_bytes, via=self.producer,
            )  # fmt: skip
        return [r.dispatch_id for r in results]

    def terminal_events(self, dispatch_ids: list[str]) -> dict[str, list[tuple[str, Any]]]:
        """dispatch id -> its terminal events (type, payload): exactly one each when done."""
        wanted = {t.value for t in (EventType.WORKER_COMPLETED, EventType.WORKER_FAILED, EventType.WORKER_CANCELLED)}
        with transaction(self.sessions) as session:
            return {
                d: [(e.type, e.payload) for e in dispatches.events_for(session, d) if e.type in wanted]
                for d in dispatch_ids
            }

    def all_terminal(self, dispatch_ids: list[str]) -> bool:
        with transaction(self.sessions) as session:
            rows = dispatches.get_dispatches(session, dispatch_ids)
        return len(rows) == len(dispatch_ids) and all(r.terminal for r in rows.values())

    def wait_terminal(self, dispatch_ids: list[str], *, timeout_s: float = 60.0) -> dict[str, list[tuple[str, Any]]]:
        wait_until(
            lambda: self.all_terminal(dispatch_ids),
            timeout_s=timeout_s,
            what=f"{len(dispatch_ids)} dispatches terminal",
            on_fail=self.logs,
        )
        return self.terminal_events(dispatch_ids)

    def jobs(self, namespace: str | None = None) -> list[dict[str, Any]]:
        return [
            j
            for page in self.kube.iter_jobs(namespace or self.namespace, label_selector=job_labels.selector())
            for j in page
        ]

    def wait_no_jobs(self, *, timeout_s: float = 20.0) -> None:
        wait_until(lambda: not self.jobs(), timeout_s=timeout_s, what="no Job left", on_fail=self.logs)

    def notifications(self) -> list[str]:
        """Dispatch ids of the engine notifications queued so far, in order (messages kept)."""
        raw = self.redis.lrange(f"{self.prefix}:{self.settings.notify_queue}", 0, -1)
        ids = []
        for message in reversed(raw):  # kombu LPUSHes: oldest last
            envelope = json.loads(message)
            assert envelope["headers"]["task"] == self.settings.notify_task
            args, _kwargs, _embed = json.loads(base64.b64decode(envelope["body"]))
            ids.append(args[0])
        return ids

    def wait_notified(self, dispatch_ids: list[str], *, timeout_s: float = 30.0) -> list[str]:
        """The notifications once each of these dispatches has one: the engine is told after the
        terminal event commits (`delivery.terminal.announce`), so a test that saw the event waits."""
        wait_until(
            lambda: set(dispatch_ids) <= set(self.notifications()),
            timeout_s=timeout_s,
            what=f"{len(dispatch_ids)} dispatches notified",
            on_fail=self.logs,
        )
        return self.notifications()

    def dispatch_by_key(self, tenancy_id: str, idempotency_key: str) -> Any:
        with transaction(self.sessions) as session:
            return session.scalars(
                sa.select(Dispatch).where(
                    Dispatch.tenancy_id == tenancy_id, Dispatch.idempotency_key == idempotency_key
                )
            ).one_or_none()

    def send(self, task: str, *args: Any, **kwargs: Any) -> None:
        self.producer.send_task(task, args=list(args), kwargs=kwargs)

    def stop(self) -> None:
        problems = []
        for proc in reversed(self.procs):
            code = proc.stop()
            if code not in (0, None):
                problems.append(f"{proc.name} exited with {code}\n{proc.tail()}")
        self.procs.clear()
        assert not problems, "\n".join(problems)


def capabilities_file(path: Path, capabilities: dict[str, Any], limits: dict[str, Any] | None = None) -> Path:
    path.write_text(yaml.safe_dump({"capabilities": capabilities, **({"limits": limits} if limits else {})}))
    return path


@pytest.fixture
def deploy(new_pg_database, redis_url, key_prefix, tmp_path) -> Iterator[Callable[..., Deployment]]:
    """`deploy(cluster, capabilities=None, limits=None, **settings)`: a Deployment (its capabilities
    file holds `limits` too); stopped cleanly at the end."""
    made: list[tuple[Deployment, Any]] = []

    def make(
        cluster: LocalCluster | ClusterHandle,
        *,
        capabilities: dict[str, Any] | None = None,
        limits: dict[str, Any] | None = None,
        **overrides: str,
    ) -> Deployment:
        pg_url = new_pg_database()
        migrate.upgrade(pg_url)
        values = {
            "K8S_DISPATCH_DATABASE_URL": pg_url,
            "K8S_DISPATCH_REDIS_URL": redis_url,
            "K8S_DISPATCH_KEY_PREFIX": f"{key_prefix}-{uuid.uuid4().hex[:6]}",
            "K8S_DISPATCH_NAMESPACE": f"t-{uuid.uuid4().hex[:8]}",
            "K8S_DISPATCH_KUBECONFIG": str(cluster.kubeconfig),
            "K8S_DISPATCH_POLL_INTERVAL_S": "0.2",
            "K8S_DISPATCH_WORKER_CONCURRENCY": "8",
            "K8S_DISPATCH_GUARD_LEASE_MS": "15000",
        }
        if capabilities is not None:
            values["K8S_DISPATCH_CAPABILITIES"] = str(
                capabilities_file(tmp_path / f"caps-{len(made)}.yaml", capabilities, limits)
            )
        values.update({f"K8S_DISPATCH_{k.upper()}": v for k, v in overrides.items()})
        settings = load_settings(values)
        if isinstance(cluster, ClusterHandle):
            for spec in [{"namespace": settings.namespace}, *(capabilities or {}).values()]:
                if isinstance(spec, dict) and spec.get("namespace"):
                    cluster.ensure_namespace(spec["namespace"])
        env = processes.project_env(values)
        producer = Celery("test-producer", set_as_current=False)
        producer.conf.update(celeryconfig.config(settings))
        engine = make_engine(pg_url)
        deployment = Deployment(
            settings=settings,
            env=env,
            cluster=cluster,
            tmp=tmp_path,
            producer=producer,
            sessions=make_sessionmaker(engine),
            kube=KubeClient(cluster.kubeconfig),
            redis=redis.Redis.from_url(redis_url),
        )
        made.append((deployment, engine))
        return deployment

    yield make
    failures = []
    for deployment, engine in made:
        try:
            deployment.stop()
        except AssertionError as e:
            failures.append(str(e))
        finally:
            deployment.producer.close()
            deployment.kube.close()
            deployment.redis.close()
            engine.dispose()
    assert not failures, "\n".join(failures)


@pytest.fixture
def world(pg_url, redis_url, key_prefix):
    """An engine's side without workers: a producer app on a fresh key prefix, the database
    (engine and sessions), Redis, and the name of the jobs queue the producer sends to. Its keys
    are deleted at the end. Yields (producer, engine, sessions, redis, queue)."""
    prefix = f"{key_prefix}-producer-{uuid.uuid4().hex[:6]}"
    settings = load_settings({"K8S_DISPATCH_KEY_PREFIX": prefix, "K8S_DISPATCH_REDIS_URL": redis_url})
    producer = Celery("test-producer", set_as_current=False)
    producer.conf.update(celeryconfig.config(settings))
    engine = make_engine(pg_url, pool_size=10)  # the outbox's tests commit from 8 threads
    client = redis.Redis.from_url(redis_url)
    yield producer, engine, make_sessionmaker(engine), client, f"{prefix}:{celeryconfig.JOBS_QUEUE}"
    producer.close()
    for key in client.scan_iter(f"{prefix}*"):
        client.delete(key)
    client.close()
    engine.dispose()
