"""The real services a bench run uses, each its own and cleaned up at the end.

A PostgreSQL database created (and migrated) for the run and dropped after it; a Redis key
prefix unique to the run, its keys deleted after it; an API server (`python -m k8s_dispatch.demo.localcluster serve`,
or the real control plane of `realcluster`) and `celery -A tasks worker|beat` as subprocesses
(via `ops.processes`), configured only through K8S_DISPATCH_* variables, as a deployment is.
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
import urllib.parse
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import redis
import yaml
from sqlalchemy.engine import make_url

from k8s_dispatch.ops.processes import (
    LISTENING,
    ManagedProcess,
    celery_beat,
    celery_worker,
    localcluster_server,
    wait_for_log,
    wait_until,
)
from k8s_dispatch.store import migrate

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
    clusters: tuple[str, ...] = ("local", "real")  # the API servers `api_load` runs against (LOCAL, REAL)


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


LOCAL, REAL = "local", "real"  # the API servers a benchmark can run against (`--cluster`)
KUBELET = "kubelet"  # api_load's steady state beside a real node (`api_load_kubelet`)
BENCH_USER_AGENT = "k8s-dispatch-bench"  # the bench's own requests, told apart in the real server's audit log
# Every request's metadata, once it has been answered: who sent it, which the counter cannot say.
AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived", "ResponseStarted"]
rules:
- level: Metadata
"""


@dataclass(frozen=True)
class Cluster:
    """A running API server and how to reach it: localcluster's plain-http listener (no TLS, so
    the figures are the API's), or the real kube-apiserver over https with its own CA."""

    kind: str  # LOCAL or REAL
    url: str
    token: str
    kubeconfig: Path
    process: ManagedProcess | None = None  # localcluster's server process
    ca_file: Path | None = None  # the real server's CA
    audit_log: Path | None = None  # the real server's audit log (JSON lines, one per answered request)
    plane: Any = None  # the real one's `realcluster.controlplane.ControlPlane`

    def ssl_context(self) -> ssl.SSLContext | None:
        """What verifies the server's certificate, or None for plain http."""
        if urllib.parse.urlsplit(self.url).scheme != "https":
            return None
        return ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)

    def connection(self, *, timeout: float | None = 30) -> http.client.HTTPConnection:
        """A new (not yet connected) connection to the server, http or https."""
        url = urllib.parse.urlsplit(self.url)
        ctx = self.ssl_context()
        if ctx is not None:
            return http.client.HTTPSConnection(url.hostname or "127.0.0.1", url.port, timeout=timeout, context=ctx)
        return http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=timeout)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}", "User-Agent": BENCH_USER_AGENT}

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        """One authenticated request as the admin: (status, body)."""
        conn = self.connection()
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, path, body=data, headers={**self.headers(), "Content-Type": "application/json"})
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def pids(self) -> dict[str, int | None]:
        """The server's processes by name (the real one's etcd, kube-apiserver, controller manager
        and node agent), for their CPU."""
        if self.plane is not None:
            return {name: p.pid for name, p in self.plane.processes.items()}
        return {"localcluster": self.process.pid if self.process else None}

    def ensure_namespace(self, name: str, *, timeout: float = START_TIMEOUT_S) -> None:
        """Namespace `name` ready for Jobs: localcluster makes one on first use; a real server
        refuses objects in a namespace that does not exist, and Pods until the ServiceAccount
        controller has made its `default` account."""
        if self.kind == LOCAL:
            return
        status, body = self.request("POST", "/api/v1/namespaces", {"metadata": {"name": name}})
        if status not in (201, 409):
            raise RuntimeError(f"create namespace {name}: {status} {body[:200]!r}")
        wait_until(lambda: self.request("GET", f"/api/v1/namespaces/{name}/serviceaccounts/default")[0] == 200,
                   timeout=timeout, interval=0.1, what=f"the default ServiceAccount of {name}")  # fmt: skip


@contextmanager
def cluster(work_dir: Path, *, name: str, kind: str = LOCAL, kube_api_qps: int = 400) -> Iterator[Cluster]:
    """An API server of `kind`, started for the caller and stopped on exit: `python -m
    localcluster serve --mode simulate --no-tls` in its own process, or (REAL) etcd,
    kube-apiserver (audit log on), kube-controller-manager (`kube_api_qps`: its client budget)
    and our node agent in simulate mode, in `work_dir/name`."""
    if kind == REAL:
        with real_cluster(work_dir / name, kube_api_qps=kube_api_qps) as real:
            yield real
        return
    kubeconfig = work_dir / f"{name}.kubeconfig"
    process = localcluster_server(log_dir=work_dir, kubeconfig=kubeconfig, mode="simulate", name=name)
    process.argv.append("--no-tls")
    process.start()
    try:
        line = wait_for_log(process, LISTENING, timeout=START_TIMEOUT_S)
        url = line.split(LISTENING, 1)[1].strip()
        doc = yaml.safe_load(kubeconfig.read_text())
        token = next(u["user"]["token"] for u in doc["users"])
        yield Cluster(kind=LOCAL, process=process, url=url, token=token, kubeconfig=kubeconfig)
    finally:
        process.stop()


@contextmanager
def real_cluster(
    directory: Path, *, kube_api_qps: int, mode: str = "simulate", node: str = "agent", max_running: int | None = None
) -> Iterator[Cluster]:
    """The real control plane in `directory` with its audit log on: our node agent in `mode` (in
    exec mode, `max_running` processes at once), or (`node="kubelet"`) a real node."""
    from k8s_dispatch.lab.realcluster.controlplane import (  # built on first use: only when asked for
        ControlPlane,
        remove,
    )

    directory.mkdir(parents=True, exist_ok=True)
    policy, audit_log = directory / "audit-policy.yaml", directory / "audit.log"
    policy.write_text(AUDIT_POLICY)
    plane = ControlPlane(
        directory=directory, mode=mode, node=node, kube_api_qps=kube_api_qps, max_running=max_running,
        apiserver_args=(f"--audit-policy-file={policy}", f"--audit-log-path={audit_log}", "--audit-log-format=json",
                        "--audit-log-maxsize=0"),
    )  # fmt: skip
    plane.start()
    try:
        yield Cluster(kind=REAL, url=plane.url, token=plane.token, kubeconfig=plane.kubeconfig,
                      ca_file=directory / "pki" / "ca.crt", audit_log=audit_log, plane=plane)  # fmt: skip
    finally:
        plane.stop()
        remove(directory)


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
def worker_and_beat(
    work_dir: Path, env: Mapping[str, str], *, concurrency: int
) -> Iterator[Callable[[], dict[str, int | None]]]:
    """One `celery -A tasks worker` and one `celery -A tasks beat`, started together; yields
    `ready()`, which returns once both are ready (untimed setup can run while they start), with
    their pids. SIGTERM on exit."""
    worker_process = _clean(celery_worker("bench-worker", env=env, log_dir=work_dir, concurrency=concurrency), env)
    beat = _clean(celery_beat(env=env, log_dir=work_dir, name="bench-beat"), env)

    def ready() -> dict[str, int | None]:
        wait_for_log(worker_process, " ready.", timeout=START_TIMEOUT_S)
        wait_for_log(beat, "beat: Starting", timeout=START_TIMEOUT_S)
        return {"worker": worker_process.pid, "beat": beat.pid}

    try:
        worker_process.start()
        beat.start()
        yield ready
    finally:
        beat.stop()
        worker_process.stop()
