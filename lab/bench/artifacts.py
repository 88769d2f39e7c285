"""Issue 28's figures: a large result through the object store, and what archived logs cost.

1. A result of `result_mib` MiB (100 at full and quick) from schedule to terminal event: a real
   `celery -A tasks worker` and `beat`, PostgreSQL, Redis, SeaweedFS (`weed mini`, built by
   `tools/build.sh seaweedfs`) and localcluster in exec mode, where the Job is the runner as a
   local process whose function returns a file of random bytes the bench wrote before the round
   (`pathlib:Path`: the runner streams it in its PUT to the attempt's presigned URL, taking its
   SHA-256 as it goes, while the store takes its own, asked for by the URL) and leaves the
   reference as its termination message; the Job's end is handed off by a prompt poll (the kept
   watch stream rings: `tasks.prompt_poll`), and the worker HEADs the object (its size and the
   store's SHA-256) before it records the reference. Its throughput is compared, round by round, with the raw transfer of
   the same bytes by the product's own S3 client (boto3 `put_object` from memory, then
   `get_object` read to the end) in the same run, on the same store: a ratio of 1 would be the
   whole delivery for the price of one PUT and one GET. Where each dispatch's time went is
   reported by phase (`PHASES`: the runner's own marks, the worker's log, the terminal event),
   and the part that grows with the result's size (the runner's upload, and complete_batch's
   verification and record) is compared with the raw transfer too, without a target: what is
   left is the fixed cost of a dispatch (the Pod's start, the wait for the next poll).
2. Requests per finished Job, Kubernetes and object store, with an object store configured (every
   capability then `archiveLogs: onFailure`, the default) in api_load's steady state of 1,000 Jobs
   of 60 s: the same steady state, window and count as issue 8's figure 2 (`api_load._ours`);
   the object store's requests counted by a relay in front of it, those in the window divided by
   the Jobs finished in it. The Jobs succeed, so no log is archived: the figure says what
   `onFailure` costs the common case (a failed Pod adds one pods/log GET and one PUT).
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
import yaml
from celery import Celery

from k8s_dispatch import celeryconfig
from k8s_dispatch.artifacts.errors import ObjectStoreUnavailable
from k8s_dispatch.artifacts.reference import parse_reference
from k8s_dispatch.artifacts.store import S3Store
from k8s_dispatch.core.settings import load_settings
from k8s_dispatch.lab import seaweedfs as weed_mini
from k8s_dispatch.lab.bench import api_load, services, workload
from k8s_dispatch.lab.bench.results import BenchResult, Figure, Ratio, Target
from k8s_dispatch.lab.bench.sizes import Size
from k8s_dispatch.ops.processes import LISTENING, free_ports, localcluster_server, wait_for_log, wait_until
from k8s_dispatch.store.db import make_engine, make_sessionmaker, transaction
from k8s_dispatch.store.models import TERMINAL_EVENT_TYPES, CaseEvent, EventType
from k8s_dispatch.tasks.scheduling import schedule_in_session
from k8s_dispatch.workers.resolver import CapabilityResolver

BUILD_SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "build.sh"
BUCKET = "bench"
CAPABILITY = "bench.bytes"
NAMESPACE = "bench-artifacts"
MIB = 1 << 20
THROUGHPUT_RATIO = Target(0.8)  # the issue's: delivery at least 0.8x a raw PUT + GET
REQUESTS_PER_JOB = api_load.REQUESTS_PER_JOB  # unchanged by an object store: <= 3.5
DELIVERY_DEADLINE_S = 300.0
STORE_READY_S = 60.0


@dataclass(frozen=True)
class Knobs:
    result_mib: int
    rounds: int  # interleaved rounds: a raw PUT + GET and a dispatch each
    load: api_load.Knobs  # the steady state of the requests-per-Job figure


KNOBS = {
    "smoke": Knobs(result_mib=4, rounds=2, load=api_load.Knobs(jobs=(10,), job_s=4.0, window_s=4.0)),
    "quick": Knobs(result_mib=100, rounds=9, load=api_load.Knobs(jobs=(api_load.TARGET_JOBS,), job_s=60.0, window_s=9.0)),
    "full": Knobs(result_mib=100, rounds=11, load=api_load.Knobs(jobs=(api_load.TARGET_JOBS,), job_s=60.0, window_s=60.0)),
}  # fmt: skip


def run(ctx: services.BenchContext, size: Size) -> BenchResult:
    knobs = KNOBS[size.name]
    [jobs] = knobs.load.jobs
    result = BenchResult(
        name="artifacts",
        title=f"a {knobs.result_mib} MiB result through the object store; requests per Job with archiveLogs: onFailure",
        rounds=knobs.rounds,
        params={
            "result_mib": knobs.result_mib,
            "rounds": knobs.rounds,
            "concurrent_jobs": jobs,
            "job_s": knobs.load.job_s,
            "window_s": knobs.load.window_s,
            "poll_interval_s": load_settings({}).poll_interval_s,
        },
    )
    with seaweedfs(ctx.work_dir) as store:
        rounds = _throughput(ctx, store, knobs)
        k8s_per_job, store_per_job, window = _requests_per_job(ctx, store, knobs.load)
    size_mib = float(knobs.result_mib)
    what = f"{knobs.result_mib} MiB"
    raw_s, dispatch_s = rounds.raw_s, rounds.dispatch_s
    result.figures += [
        Figure("result_schedule_to_terminal_s", f"{what} result: schedule -> terminal event", "s", dispatch_s,
               ref="28"),
        Figure("result_throughput_mib_s", f"{what} result: throughput, schedule -> terminal event", "MiB/s",
               [size_mib / s for s in dispatch_s], ref="28"),
        Figure("raw_put_get_s", f"{what}: raw PUT + GET, the product's S3 client (boto3)", "s", raw_s, ref="28"),
        Figure("raw_throughput_mib_s", f"{what}: raw PUT + GET throughput, the product's S3 client", "MiB/s",
               [size_mib / s for s in raw_s], ref="28"),
        Figure("raw_put_s", f"{what}: the raw PUT", "s", rounds.put_s, ref="28"),
        Figure("raw_get_s", f"{what}: the raw GET", "s", rounds.get_s, ref="28"),
        *[Figure(f"phase_{name}_s", f"{what} result, phase: {label}", "s", rounds.phases[name], ref="28")
          for name, label in PHASES.items()],
        Figure(f"requests_per_job_kubernetes_{jobs}", f"Kubernetes requests per finished Job, an object store and "
               f"archiveLogs: onFailure, {jobs:,} Jobs of {knobs.load.job_s:g} s", "requests", [k8s_per_job],
               target=REQUESTS_PER_JOB if jobs == api_load.TARGET_JOBS else None, ref="28"),
        Figure(f"requests_per_job_with_store_{jobs}", f"Kubernetes and object store requests per finished Job, "
               f"archiveLogs: onFailure, {jobs:,} Jobs of {knobs.load.job_s:g} s", "requests",
               [k8s_per_job + store_per_job], ref="28"),
    ]  # fmt: skip
    result.ratios.append(
        Ratio("result_vs_raw_throughput", f"{what} result: throughput schedule -> terminal event / raw PUT + GET's",
              [raw / took for raw, took in zip(raw_s, dispatch_s, strict=True)], target=THROUGHPUT_RATIO, ref="28")
    )  # fmt: skip
    moved = [up + done for up, done in zip(rounds.phases["runner_upload"], rounds.phases["complete"], strict=True)]
    result.ratios.append(
        Ratio("transfer_vs_raw_throughput", f"{what} result: throughput of the runner's upload and complete_batch "
              "(hash and PUT; HEAD and record) / raw PUT + GET's",
              [raw / took for raw, took in zip(raw_s, moved, strict=True)], ref="28")
    )  # fmt: skip
    result.notes.append(
        f"{what}: the dispatch's time includes creating the Job, the runner's start, its PUT streamed from the file "
        "through SHA-256 (the store taking its own), the prompt poll that sees the Job end, the worker's HEAD (size "
        "and the store's SHA-256) and the record; the raw transfer only the two requests, from and to memory. The "
        f"worker's tasks in the rounds (complete_batch: the HEAD and the record): {rounds.tasks}"
    )
    result.params["object_store_requests_per_job"] = store_per_job
    result.notes.append(
        f"{jobs:,} Jobs with an object store: {store_per_job:.3f} object store requests per finished Job (a failed "
        "Pod's archived log adds one PUT, and one pods/log GET: artifacts/logs.py; these Jobs succeed)"
    )
    result.notes.append(
        f"{jobs:,} Jobs with an object store: {window.total} Kubernetes requests and "
        f"{round(store_per_job * len(window.finished))} object store requests, {len(window.finished)} Jobs finished "
        f"in {window.seconds:.1f}s ({window.in_flight[0]}/{window.in_flight[1]} in flight at start/end): "
        f"{api_load.breakdown(window.requests, seconds=window.seconds)}"
    )
    return result


# --- the object store --------------------------------------------------------------------------


@dataclass(frozen=True)
class Store:
    endpoint: str
    access_key: str
    secret_key: str

    def settings(self, prefix: str, *, endpoint: str | None = None) -> dict[str, str]:
        """The deployment's object store settings (names without K8S_DISPATCH_), results under `prefix`."""
        return {
            "object_store_endpoint": endpoint or self.endpoint,
            "object_store_bucket": BUCKET,
            "object_store_prefix": prefix,
            "object_store_access_key": self.access_key,
            "object_store_secret_key": self.secret_key,
        }

    def client(self, prefix: str) -> S3Store:
        return S3Store.from_settings(load_settings(services.deployment_env(self.settings(prefix))))


@contextmanager
def seaweedfs(work_dir: Path) -> Iterator[Store]:
    """SeaweedFS's `weed mini` (master, volume, filer and S3 gateway in one process) on free
    ports, its data in `work_dir`; stopped on exit."""
    built = subprocess.run(["bash", str(BUILD_SCRIPT), "seaweedfs"], capture_output=True, text=True, check=False)
    if built.returncode != 0:
        raise RuntimeError(f"tools/build.sh seaweedfs failed: {built.stderr[-2000:]}")
    weed = Path(built.stdout.strip().splitlines()[-1]) / "weed"
    d = work_dir / "seaweedfs"
    (d / "data").mkdir(parents=True)
    access, secret = "bench", secrets.token_hex(16)
    (d / "s3.json").write_text(weed_mini.s3_config("bench", access, secret))
    p = free_ports(weed_mini.PORTS)
    argv = weed_mini.mini_argv(weed, d, p, BUCKET, volume_size_mb=1024)
    process = weed_mini.start(argv, d)
    store = Store(f"http://127.0.0.1:{p[6]}", access, secret)
    try:
        probe = store.client("probe")

        def ready() -> bool:
            if process.poll() is not None:
                raise RuntimeError(f"weed exited {process.returncode}: see {d / 'weed.log'}")
            try:
                probe.put("probe/ready", b"ok")
            except ObjectStoreUnavailable:  # not yet: the gateway answers before a volume takes writes
                return False
            probe.delete("probe/ready")
            return True

        wait_until(ready, timeout=STORE_READY_S, interval=0.1, what="SeaweedFS taking writes")
        yield store
    finally:
        weed_mini.stop(process)


class CountingRelay:
    """A TCP relay in front of the store that notes when each request passed (its request line
    seen in the stream): what the deployment behind it asked of the store, and when."""

    def __init__(self, upstream_endpoint: str) -> None:
        host, _, port = upstream_endpoint.removeprefix("http://").partition(":")
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.requests: list[tuple[float, str]] = []  # (time.time(), method)
        threading.Thread(target=self._accept, daemon=True).start()

    def between(self, start: float, end: float) -> list[str]:
        return [method for at, method in list(self.requests) if start <= at <= end]

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
                upstream = socket.create_connection(self._upstream, timeout=30)
            except OSError:
                return
            upstream.settimeout(None)
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, requests: bool) -> None:
        try:
            while chunk := source.recv(1 << 16):
                if requests:
                    for method in (b"GET", b"HEAD", b"PUT", b"POST", b"DELETE"):
                        if chunk.startswith(method + b" /"):  # a keep-alive request begins a read
                            self.requests.append((time.time(), method.decode()))
                sink.sendall(chunk)
        except OSError:
            pass  # either side closed: the other is closed below
        finally:
            for s in (source, sink):
                with suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()


# --- 1. a large result against a raw PUT + GET ---------------------------------------------------


# The product's runner (`container.runner.main`) as the Job's process, with the times of its
# phases appended to the file named first (one JSON line per run): when the process started,
# when the function had returned and the upload began (`runner.upload`: the result's hashes and
# its PUT), when the upload ended and when the runner returned.
TIMED_RUNNER = """
import json, sys, time
marks = {"process": time.time()}
from k8s_dispatch.container import runner
upload = runner.upload
def timed_upload(url, source):
    marks["upload"] = time.time()
    try:
        return upload(url, source)
    finally:
        marks["uploaded"] = time.time()
runner.upload = timed_upload
code = runner.main(sys.argv[2:])
marks["exit"] = time.time()
with open(sys.argv[1], "a") as f:
    f.write(json.dumps(marks) + "\\n")
sys.exit(code)
"""


def capability_config(max_bytes: int, marks: Path) -> dict[str, Any]:
    """The runner in exec mode: the file INPUT names, streamed to the object store as the result;
    the times of its phases appended to `marks` (`TIMED_RUNNER`)."""
    spec = {
        "worker": "exec", "image": "k8s-dispatch:latest",
        "command": [sys.executable, "-c", TIMED_RUNNER, str(marks)], "args": ["pathlib:Path"],
        "results": "objectStore", "maxResultBytes": max_bytes, "activeDeadlineSeconds": 600, "backoffLimit": 0,
    }  # fmt: skip
    return {"capabilities": {CAPABILITY: spec}}


@contextmanager
def exec_cluster(work_dir: Path) -> Iterator[Path]:
    """localcluster in exec mode, plain http, in its own process; its kubeconfig."""
    kubeconfig = work_dir / "lc-artifacts.kubeconfig"
    process = localcluster_server(log_dir=work_dir, kubeconfig=kubeconfig, mode="exec", name="lc-artifacts")
    process.argv.append("--no-tls")
    process.start()
    try:
        wait_for_log(process, LISTENING, timeout=services.START_TIMEOUT_S)
        yield kubeconfig
    finally:
        process.stop()


@dataclass
class Rounds:
    """What `_throughput` measured, one entry per round (`phases`: per phase, by `PHASES`' names)."""

    raw_s: list[float] = field(default_factory=list)
    put_s: list[float] = field(default_factory=list)
    get_s: list[float] = field(default_factory=list)
    dispatch_s: list[float] = field(default_factory=list)
    phases: dict[str, list[float]] = field(default_factory=dict)
    tasks: str = ""


# Where a dispatch's time goes, from the runner's marks (`TIMED_RUNNER`), the worker's log and the
# terminal event's created_at: name -> label. Their sum is the dispatch's time.
PHASES = {
    "to_runner": "schedule -> the runner's process started (schedule, create_jobs, the Pod's start)",
    "runner_start": "the runner's start -> its upload began (imports, input, the function)",
    "runner_upload": "the runner's upload: its PUT, hashed as it is sent",
    "to_complete": "the upload's end -> complete_batch received (the runner's exit, the Job's status, the poll)",
    "complete": "complete_batch received -> terminal event (the HEAD with the store's SHA-256, the record)",
}
TASK_RECEIVED = re.compile(r"Task [\w.-]*complete_batch\[[^\]]*\] received")


def phases_of(
    spans: Sequence[tuple[float, float]], marks: Sequence[dict[str, float]], received: Sequence[float]
) -> dict[str, list[float]]:
    """Each round's phases (pure): `spans` (schedule, terminal event) and the runner's `marks`
    per round, `received` the times complete_batch messages were received (any order); a round's
    is the last one received before its terminal event."""
    phases: dict[str, list[float]] = {name: [] for name in PHASES}
    for (started, ended), mark in zip(spans, marks, strict=True):
        got = max((at for at in received if mark["uploaded"] <= at <= ended), default=math.nan)
        for name, (a, b) in {
            "to_runner": (started, mark["process"]),
            "runner_start": (mark["process"], mark["upload"]),
            "runner_upload": (mark["upload"], mark["uploaded"]),
            "to_complete": (mark["uploaded"], got),
            "complete": (got, ended),
        }.items():
            phases[name].append(b - a)
    return phases


def _throughput(ctx: services.BenchContext, store: Store, knobs: Knobs) -> Rounds:
    """A raw PUT + GET and a dispatch (schedule -> terminal event) per round, their order
    alternating; where each dispatch's time went, and what the worker's tasks took in the rounds.
    A small dispatch first, untimed, warms the worker up."""
    size = knobs.result_mib * MIB
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    caps_file = ctx.work_dir / "artifacts-capabilities.yaml"
    marks_file = ctx.work_dir / "artifacts-runner-marks.jsonl"
    caps_file.write_text(yaml.safe_dump(capability_config(2 * size, marks_file)))
    caps = CapabilityResolver.from_mapping(capability_config(2 * size, marks_file), source=str(caps_file))
    client = store.client(prefix)
    with services.database(ctx.pg_admin_url) as database_url, exec_cluster(ctx.work_dir) as kubeconfig:
        env = services.deployment_env(
            {
                "database_url": database_url,
                "redis_url": ctx.redis_url,
                "key_prefix": f"{ctx.key_prefix}-artifacts-{uuid.uuid4().hex[:6]}",
                "namespace": NAMESPACE,
                "kubeconfig": str(kubeconfig),
                "capabilities": str(caps_file),
                **store.settings(prefix),
            }
        )
        settings = load_settings(env)
        engine = make_engine(database_url)
        sessions = make_sessionmaker(engine)
        producer = Celery("bench-producer", set_as_current=False)
        producer.conf.update(celeryconfig.config(settings))
        rounds = Rounds()
        spans: list[tuple[float, float]] = []
        try:
            case_id = workload.new_case(sessions)

            def dispatch(path: Path) -> float:
                n = path.stat().st_size
                started = time.time()
                with transaction(sessions) as session:
                    dispatch_id = schedule_in_session(
                        session, via=producer, case_id=case_id, tenancy_id=workload.TENANCY, capability=CAPABILITY,
                        input=str(path), idempotency_key=f"key-{uuid.uuid4()}", router=caps,
                        max_input_bytes=settings.max_input_bytes,
                    ).dispatch_id  # fmt: skip
                kind, payload, at = wait_until(lambda: _ended(sessions, dispatch_id), timeout=DELIVERY_DEADLINE_S,
                                               interval=0.05, what=f"the {n}-byte result recorded")  # fmt: skip
                if kind != EventType.WORKER_COMPLETED.value:
                    raise RuntimeError(f"the {n}-byte result was not delivered: {kind} {payload}")
                reference = parse_reference(payload["output"])
                if reference.size != n:
                    raise RuntimeError(f"the recorded reference says {reference.size} bytes, not {n}")
                client.delete(reference.key)  # the engine's delete: the store holds one round at a time
                spans.append((started, at))
                return at - started

            def raw(round_: int, path: Path) -> float:
                data, key = path.read_bytes(), f"{prefix}/raw/{round_}"
                started = time.perf_counter()
                client.put(key, data)
                put = time.perf_counter()
                read = sum(len(chunk) for chunk in client.read(key))
                ended = time.perf_counter()
                client.delete(key)
                if read != size:
                    raise RuntimeError(f"the raw GET read {read} bytes, not {size}")
                rounds.put_s.append(put - started)
                rounds.get_s.append(ended - put)
                return ended - started

            with services.worker_and_beat(ctx.work_dir, env, concurrency=api_load.CONCURRENCY) as ready:
                ready()
                dispatch(_random_file(ctx.work_dir, "warm-up", MIB))  # untimed: the worker's clients built
                spans.clear()
                rounds_from = time.time()
                for i in range(knobs.rounds):
                    path = _random_file(ctx.work_dir, f"round-{i}", size)  # untimed: the bytes of both variants
                    if i % 2 == 0:
                        rounds.raw_s.append(raw(i, path))
                        rounds.dispatch_s.append(dispatch(path))
                    else:
                        rounds.dispatch_s.append(dispatch(path))
                        rounds.raw_s.append(raw(i, path))
                    path.unlink()
                within = (rounds_from, time.time())
            log = (ctx.work_dir / "bench-worker.log").read_text(errors="replace")
            rounds.tasks = api_load.task_times(log, within=within)
            marks = [json.loads(line) for line in marks_file.read_text().splitlines()][1:]  # the warm-up's first
            received = [api_load._logged_at(line) for line in log.splitlines() if TASK_RECEIVED.search(line)]
            rounds.phases = phases_of(spans, marks, received)
        finally:
            producer.close()
            engine.dispose()
    return rounds


def _random_file(work_dir: Path, name: str, size: int) -> Path:
    path = work_dir / f"artifacts-{name}.bin"
    with path.open("wb") as f:
        for _ in range(0, size, MIB):
            f.write(os.urandom(MIB))
    return path


def _ended(sessions: Any, dispatch_id: str) -> tuple[str, dict[str, Any], float] | None:
    """The dispatch's terminal event: (type, payload, its created_at as a Unix time), or None yet."""
    types = [t.value for t in TERMINAL_EVENT_TYPES]
    query = sa.select(CaseEvent.type, CaseEvent.payload, CaseEvent.created_at).where(
        CaseEvent.dispatch_id == dispatch_id, CaseEvent.type.in_(types)
    )
    with transaction(sessions) as session:
        row = session.execute(query).first()
    return None if row is None else (str(row[0]), dict(row[1] or {}), row[2].timestamp())


# --- 2. requests per Job with archiveLogs: onFailure --------------------------------------------


def _requests_per_job(
    ctx: services.BenchContext, store: Store, knobs: api_load.Knobs
) -> tuple[float, float, api_load.Window]:
    """(Kubernetes requests per finished Job, object store requests per finished Job, the window)."""
    [n] = knobs.jobs
    caps_file = ctx.work_dir / "artifacts-load-capabilities.yaml"
    caps_file.write_text(yaml.safe_dump(api_load.capability_config(knobs.job_s)))
    caps = CapabilityResolver.from_mapping(api_load.capability_config(knobs.job_s), source=str(caps_file))
    relay = CountingRelay(store.endpoint)
    try:
        settings = store.settings(f"bench-load-{uuid.uuid4().hex[:8]}", endpoint=relay.endpoint)
        window = api_load._ours(ctx, knobs, n, caps, caps_file, extra_env=settings)
    finally:
        relay.close()
    in_window = relay.between(*window.span)
    return window.per_job, len(in_window) / len(window.finished), window
