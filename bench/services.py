"""The real services a bench run uses, each its own and cleaned up at the end.

A PostgreSQL database created (and migrated) for the run and dropped after it; a Redis key
prefix unique to the run, its keys deleted after it; `python -m localcluster serve` and
`celery -A tasks worker|beat` as subprocesses (via `tasks.processes`), configured only through
K8S_DISPATCH_* variables, as a deployment is.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg
import redis
import yaml
from sqlalchemy.engine import make_url

from engine import migrate
from tasks.processes import (
    LISTENING,
    ManagedProcess,
    celery_beat,
    celery_worker,
    localcluster_server,
    wait_for_log,
)

PG_ADMIN_URL = os.environ.get("K8S_DISPATCH_BENCH_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("K8S_DISPATCH_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
HOW_TO_START = "run `bash tests/services.sh` (what `make bench` does) to start it"
ENV_PREFIX = "K8S_DISPATCH_"
START_TIMEOUT_S = 60.0


class ServiceUnavailable(RuntimeError):
    """PostgreSQL or Redis cannot be reached: the bench cannot run."""


@dataclass(frozen=True)
class BenchContext:
    """What every benchmark of one run shares: its work directory, services and Redis prefix.

    A benchmark that needs a database creates its own (`database(ctx.pg_admin_url)`), so no
    family sees another's rows (the recovery sweep would act on them).
    """

    work_dir: Path  # logs, kubeconfigs, capability files
    pg_admin_url: str
    redis_url: str
    key_prefix: str  # every Redis key of the run starts with it


def check_postgres(admin_url: str = PG_ADMIN_URL) -> None:
    """Raises ServiceUnavailable unless PostgreSQL answers (checked before any benchmark runs)."""
    conninfo = make_url(admin_url).set(drivername="postgresql").render_as_string(hide_password=False)
    try:
        psycopg.connect(conninfo, connect_timeout=5).close()
    except psycopg.OperationalError as e:
        raise ServiceUnavailable(f"PostgreSQL is unreachable at {admin_url} ({e}); {HOW_TO_START}") from e


@contextmanager
def database(admin_url: str = PG_ADMIN_URL) -> Iterator[str]:
    """A new PostgreSQL database, migrated to head; its URL. Dropped on exit."""
    conninfo = make_url(admin_url).set(drivername="postgresql").render_as_string(hide_password=False)
    try:
        admin = psycopg.connect(conninfo, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as e:
        raise ServiceUnavailable(f"PostgreSQL is unreachable at {admin_url} ({e}); {HOW_TO_START}") from e
    name = f"k8s_dispatch_bench_{uuid.uuid4().hex[:8]}"
    try:
        admin.execute(f'CREATE DATABASE "{name}"')
        try:
            url = make_url(conninfo).set(database=name).render_as_string(hide_password=False)
            migrate.upgrade(url)
            yield url
        finally:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.close()


@contextmanager
def redis_prefix(url: str = REDIS_URL) -> Iterator[str]:
    """A key prefix unique to this run; every key under it is deleted on exit."""
    client = redis.Redis.from_url(url, socket_connect_timeout=5)
    try:
        try:
            client.ping()
        except redis.RedisError as e:
            raise ServiceUnavailable(f"Redis is unreachable at {url} ({e}); {HOW_TO_START}") from e
        prefix = f"k8s-dispatch-bench-{uuid.uuid4().hex[:8]}"
        try:
            yield prefix
        finally:
            keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
            for start in range(0, len(keys), 500):
                client.delete(*keys[start : start + 500])
    finally:
        client.close()


@dataclass(frozen=True)
class Cluster:
    """A running `localcluster serve` process: plain http (no TLS, so the figures are the API's)."""

    process: ManagedProcess
    url: str
    token: str
    kubeconfig: Path


@contextmanager
def cluster(work_dir: Path, *, name: str) -> Iterator[Cluster]:
    """`python -m localcluster serve --mode simulate --no-tls` in its own process; stopped on exit."""
    kubeconfig = work_dir / f"{name}.kubeconfig"
    process = localcluster_server(log_dir=work_dir, kubeconfig=kubeconfig, mode="simulate", name=name)
    process.argv.append("--no-tls")
    process.start()
    try:
        line = wait_for_log(process, LISTENING, timeout=START_TIMEOUT_S)
        url = line.split(LISTENING, 1)[1].strip()
        doc = yaml.safe_load(kubeconfig.read_text())
        token = next(u["user"]["token"] for u in doc["users"])
        yield Cluster(process=process, url=url, token=token, kubeconfig=kubeconfig)
    finally:
        process.stop()


def deployment_env(values: Mapping[str, str]) -> dict[str, str]:
    """K8S_DISPATCH_* settings for a process: `values` (keys without the prefix), and no other
    K8S_DISPATCH_* variable inherited from the bench's own environment."""
    return {f"{ENV_PREFIX}{key.upper()}": str(value) for key, value in values.items()}


def _clean(process: ManagedProcess, env: Mapping[str, str]) -> ManagedProcess:
    process.env = {k: v for k, v in process.env.items() if not k.startswith(ENV_PREFIX) or k in env}
    return process


@contextmanager
def worker(
    work_dir: Path, env: Mapping[str, str], *, concurrency: int, name: str = "bench-worker"
) -> Iterator[ManagedProcess]:
    """One `celery -A tasks worker` process, ready (its start-up sweep running); SIGTERM on exit."""
    process = _clean(celery_worker(name, env=env, log_dir=work_dir, concurrency=concurrency), env)
    try:
        process.start()
        wait_for_log(process, " ready.", timeout=START_TIMEOUT_S)
        yield process
    finally:
        process.stop()


@contextmanager
def worker_and_beat(work_dir: Path, env: Mapping[str, str], *, concurrency: int) -> Iterator[Callable[[], None]]:
    """One `celery -A tasks worker` and one `celery -A tasks beat`, started together; yields
    `ready()`, which returns once both are ready (untimed setup can run while they start).
    SIGTERM on exit."""
    worker_process = _clean(celery_worker("bench-worker", env=env, log_dir=work_dir, concurrency=concurrency), env)
    beat = _clean(celery_beat(env=env, log_dir=work_dir, name="bench-beat"), env)

    def ready() -> None:
        wait_for_log(worker_process, " ready.", timeout=START_TIMEOUT_S)
        wait_for_log(beat, "beat: Starting", timeout=START_TIMEOUT_S)

    try:
        worker_process.start()
        beat.start()
        yield ready
    finally:
        beat.stop()
        worker_process.stop()
