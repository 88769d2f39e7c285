"""Figures 2 and 3 of issue 8: the load our system puts on the API server, against the usual
Celery pattern, and how soon a finished Job's result is in the database.

Steady state with N Jobs always running, each lasting JOB_S (60 s at quick and full), without
waiting JOB_S for it: the first N Jobs' run times are spread evenly over 0..JOB_S, and every Job
seen finishing is replaced at once by a new JOB_S Job, so N stay in flight and about N / JOB_S
finish per second. Simulated Jobs (localcluster simulate mode, the run time set by the pod
template's duration annotation, one capability per run time).

- Ours: a real `celery -A tasks worker` and `celery -A tasks beat` (poll every POLL_INTERVAL_S)
  against PostgreSQL, Redis and localcluster; the bench schedules as an engine does
  (`schedule_in_session`: the dispatch written, `create_job` sent after commit).
- Baseline (`bench/baseline_app.py`, its own worker on the same Redis): one task per Job creates
  it; a task GETs the Job every COUNTDOWN_S (`countdown`) until it has ended, then deletes it.

Requests are what the server itself counted (`apiserver_request_total` on its /metrics, the
difference of two scrapes around a window; a scrape is no resource request, and the bench's
own watch is counted by the server only when it ends, after the window): EVERY request in the
window, divided by the Jobs that finished in it. The bench sees Jobs finish through one raw
watch on their namespace (`?watch=true`): the instant an event first shows the Complete
condition. Figure 3 is, for our system, the time from that instant to the terminal event's
`created_at` in the database (both clocks this machine's; completionTime has whole seconds only).
"""

from __future__ import annotations

import http.client
import json
import math
import queue
import re
import socket
import sys
import threading
import time
import urllib.parse
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

import sqlalchemy as sa
import yaml
from celery import Celery
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.orm import Session, sessionmaker

import celeryconfig
from bench import baseline_app, rawhttp, services, workload
from bench.results import BenchResult, Figure, Ratio, Target
from bench.sizes import Size
from engine.db import make_engine, make_sessionmaker, transaction
from engine.models import TERMINAL_EVENT_TYPES, CaseEvent, Dispatch
from engine.settings import load_settings
from tasks.processes import ManagedProcess, WaitTimeout, project_env, wait_for_log, wait_until
from tasks.scheduling import schedule_in_session
from workers.resolver import CapabilityResolver

POLL_INTERVAL_S = 2.0
PAGE_SIZE = 500  # poll's LIST pages (K8S_DISPATCH_POLL_PAGE_SIZE, its default)
COUNTDOWN_S = 5.0  # the baseline's re-check interval
CONCURRENCY = 8  # worker threads, ours and the baseline's alike
STEPS = 60  # run times of the first N Jobs: JOB_S * k / STEPS, k = 0..STEPS
TARGET_JOBS = 1000  # the targets are stated at 1,000 concurrent Jobs
# Issue 8 set 3; issue 13 put our finalizer on every Pod, whose release is a patch per Pod: 3.5.
REQUESTS_PER_JOB = Target(3.5, at_least=False, inclusive=True)
LATENCY_P99 = Target(POLL_INTERVAL_S + 1, at_least=False, inclusive=True)
OURS_NAMESPACE = "bench-load"
BASELINE_NAMESPACE = "bench-load-baseline"
# After the first N Jobs are in flight, before the window opens: a poll interval, so that the
# system's first poll of them (it records those that finished while they were being created:
# requests whose Jobs the window would not count) is behind.
SETTLE_S = POLL_INTERVAL_S
PRE_CREATE_CLIENTS = 4  # threads creating the first N Jobs straight into the cluster


@dataclass(frozen=True)
class Knobs:
    jobs: tuple[int, ...]  # the N concurrent Jobs, one steady state each
    job_s: float  # how long each Job runs
    window_s: float  # how long requests and completions are counted


KNOBS = {
    "smoke": Knobs(jobs=(10,), job_s=4.0, window_s=4.0),
    "quick": Knobs(jobs=(TARGET_JOBS,), job_s=60.0, window_s=9.0),  # where the targets are: ~150 finish
    "full": Knobs(jobs=(100, 1000, 5000), job_s=60.0, window_s=60.0),
}

Key = tuple[str, str, str, int]  # verb, resource, subresource, code
CREATED: Key = ("POST", "jobs", "", 201)


@dataclass
class Window:
    """What one steady state showed in its window."""

    seconds: float
    requests: Counter[Key]  # counted by the server, the bench's own removed
    finished: dict[str, float]  # Job name -> the instant the bench saw it finish, inside the window
    in_flight: tuple[int, int]  # Jobs running at the window's start and end
    latencies_s: list[float] = field(default_factory=list)  # ours: finish -> terminal event
    unrecorded: int = 0  # ours: finished Jobs without a terminal event by `_latencies`' deadline
    tasks: str = ""  # ours: what the worker's tasks took, from its log
    watch_lag_p99_s: float = 0.0  # the bench's watch: seen finished - completionTime (< 1 s: on time)

    @property
    def total(self) -> int:
        return sum(self.requests.values())

    @property
    def created(self) -> int:
        return self.requests[CREATED]

    @property
    def per_job(self) -> float:
        """Requests per Job: in steady state, every request / the Jobs finished. A system that
        falls behind creates fewer Jobs than finish, which would flatter it: so each Job counts
        its one successful create, plus every other request / the Jobs finished."""
        if not self.created:
            return self.total / len(self.finished)
        return 1 + (self.total - self.created) / len(self.finished)

    @property
    def per_s(self) -> float:
        return self.total / self.seconds


def run(ctx: services.BenchContext, size: Size) -> BenchResult:
    knobs = KNOBS[size.name]
    result = BenchResult(
        name="api_load",
        title="API load per Job and completion latency, in steady state: ours vs a GET per Job with countdown",
        rounds=1,
        params={
            "concurrent_jobs": list(knobs.jobs),
            "job_s": knobs.job_s,
            "window_s": knobs.window_s,
            "poll_interval_s": POLL_INTERVAL_S,
            "baseline_countdown_s": COUNTDOWN_S,
            "worker_concurrency": CONCURRENCY,
        },
    )
    caps_file = ctx.work_dir / "api-load-capabilities.yaml"
    caps_file.write_text(yaml.safe_dump(capability_config(knobs.job_s)))
    caps = CapabilityResolver.from_mapping(capability_config(knobs.job_s), source=str(caps_file))
    for i, n in enumerate(knobs.jobs):
        variants = {"ours": partial(_ours, ctx, knobs, n, caps, caps_file), "baseline": partial(_baseline, ctx, knobs, n)}
        order = list(variants) if i % 2 == 0 else list(reversed(variants))
        windows = {name: variants[name]() for name in order}
        _report(result, n, windows["ours"], windows["baseline"], knobs)
    result.notes.append(
        "requests per Job: every request the server counted in the window (apiserver_request_total, two /metrics "
        "scrapes; the bench's own watch is not in it) / the Jobs seen finishing in it; counted as 1 create + the "
        "other requests / Jobs finished, the same in a steady state, and not flattering a system that falls behind "
        "on creates"
    )
    result.notes.append(
        "completion latency: a raw watch on the Jobs records when the Complete condition first appears; "
        "latency = the terminal event's created_at in PostgreSQL minus that instant (same machine clock)"
    )
    return result


# --- the workload ---------------------------------------------------------------------------


def capability(k: int) -> str:
    return f"load.k{k}"


def capability_config(job_s: float) -> dict[str, Any]:
    """Capabilities load.k0..load.k60: simulated Jobs that run job_s * k / STEPS."""
    return {
        "capabilities": {
            capability(k): {
                "worker": workload.WORKER,
                "image": "k8s-dispatch-bench:simulated",
                "annotations": {f"{workload.SIM}duration-ms": str(round(1000 * job_s * k / STEPS))},  # = _ms
                "activeDeadlineSeconds": 3600,
                "backoffLimit": 0,
            }
            for k in range(STEPS + 1)
        }
    }


GOLDEN = (5**0.5 - 1) / 2


def initial_steps(n: int) -> list[int]:
    """The run time (in STEPS) of each of the first n Jobs: spread evenly over 0..STEPS, and over
    any run of consecutive Jobs too (a golden-ratio sequence), so that however long creating
    them takes, they finish at an even rate: the N / JOB_S per second of the steady state."""
    return [round(STEPS * ((i * GOLDEN) % 1.0)) for i in range(n)]


# --- what the server counted -------------------------------------------------------------


def scrape(cluster: services.Cluster) -> Counter[Key]:
    """`apiserver_request_total` from the server's /metrics, by verb, resource, subresource, code."""
    url = urllib.parse.urlsplit(cluster.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {cluster.token}"})
        response = conn.getresponse()
        body = response.read().decode()
        if response.status != 200:
            raise RuntimeError(f"GET /metrics answered {response.status}: {body[:200]}")
    finally:
        conn.close()
    counts: Counter[Key] = Counter()
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            if s.name == "apiserver_request_total":
                labels = s.labels
                counts[(labels["verb"], labels["resource"], labels["subresource"], int(labels["code"]))] += int(s.value)
    return counts


def breakdown(requests: Counter[Key], *, seconds: float) -> str:
    """"LIST jobs 12 (0.8/s), POST jobs 301 ..." for a note, largest first."""
    parts = []
    for (verb, resource, sub, code), n in requests.most_common():
        what = f"{verb} {resource}{'/' + sub if sub else ''}{'' if code < 400 else f' [{code}]'}"
        parts.append(f"{what} {n} ({n / seconds:.1f}/s)")
    return ", ".join(parts)


# --- seeing Jobs finish ------------------------------------------------------------------


class JobWatch:
    """One raw watch request on a namespace's Jobs, read on a thread: the instant each Job is
    first seen with a Complete or Failed condition, and the Jobs seen at all."""

    def __init__(self, cluster: services.Cluster, namespace: str, on_finished: Callable[[str], None]) -> None:
        self._url = urllib.parse.urlsplit(cluster.url)
        self._token = cluster.token
        self._namespace = namespace
        self._on_finished = on_finished
        self.finished_at: dict[str, float] = {}
        # how late the watch saw each Job finish, against its completionTime (whole seconds: 0-1 s
        # is on time): the instrument's own lag, which would hide latency
        self.lag_s: dict[str, float] = {}
        self.seen: set[str] = set()
        self.ended_at: list[float] = []  # when each of our watch requests ended (the server counts it then)
        self.error: BaseException | None = None
        self._conn: http.client.HTTPConnection | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"watch-{namespace}", daemon=True)

    @property
    def in_flight(self) -> int:
        """Jobs seen and not (yet) seen finished."""
        return len(self.seen) - len(self.finished_at)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        conn = self._conn
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=10)

    def _run(self) -> None:
        rv = ""
        try:
            while not self._stopping.is_set():
                rv = self._watch(rv)
        except Exception as e:  # noqa: BLE001 - reported to the bench's thread through `error`
            if not self._stopping.is_set():
                self.error = e

    def _watch(self, rv: str) -> str:
        """One watch request, from `rv` ("" = every Job now, then changes); the last rv seen."""
        conn = http.client.HTTPConnection(self._url.hostname, self._url.port, timeout=None)
        self._conn = conn
        query = urllib.parse.urlencode({"watch": "true", "timeoutSeconds": "3600", "resourceVersion": rv})
        try:
            conn.request(
                "GET",
                f"/apis/batch/v1/namespaces/{self._namespace}/jobs?{query}",
                headers={"Authorization": f"Bearer {self._token}"},
            )
            response = conn.getresponse()
            if response.status != 200:
                raise RuntimeError(f"watch answered {response.status}: {response.read()[:200]!r}")
            for line in response:
                now = time.time()
                event = json.loads(line)
                obj = event["object"]
                if event["type"] == "ERROR":
                    raise RuntimeError(f"watch error: {obj.get('message')}")
                meta = obj.get("metadata") or {}
                rv = meta.get("resourceVersion", rv)
                name = meta.get("name")
                if event["type"] == "BOOKMARK" or name is None:
                    continue
                self.seen.add(name)
                if name not in self.finished_at and _finished(obj):
                    self.finished_at[name] = now
                    self.lag_s[name] = now - _completion_time(obj, default=now)
                    self._on_finished(name)
        finally:
            self.ended_at.append(time.time())
            conn.close()
        return rv


def _completion_time(job: dict[str, Any], *, default: float) -> float:
    """The Job's status.completionTime (or, failed, its condition's time) as a Unix time."""
    status = job.get("status") or {}
    stamp = status.get("completionTime") or next(
        (c.get("lastTransitionTime") for c in status.get("conditions") or [] if c.get("type") == "Failed"), None
    )
    if not stamp:
        return default
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()


def _finished(job: dict[str, Any]) -> bool:
    conditions = (job.get("status") or {}).get("conditions") or []
    return any(c.get("type") in ("Complete", "Failed") and c.get("status") == "True" for c in conditions)


class Refiller:
    """Replaces each finished Job with a new one, in batches, on its own thread (so the watch
    keeps reading while a batch is scheduled)."""

    def __init__(self, start_jobs: Callable[[int], None]) -> None:
        self._start_jobs = start_jobs
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="refill", daemon=True)
        self.error: BaseException | None = None
        self.started = 0

    def finished(self, name: str) -> None:
        self._queue.put(name)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            items = [self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            count = sum(1 for item in items if item is not None)
            if count:
                try:
                    self._start_jobs(count)
                    self.started += count
                except Exception as e:  # noqa: BLE001 - reported to the bench's thread through `error`
                    self.error = e
                    return
            if None in items:
                return


@contextmanager
def steady(
    cluster: services.Cluster, namespace: str, n: int, *, pre_create: Callable[[Sequence[int]], None],
    start_jobs: Callable[[Sequence[int]], None], details: Callable[[], str],
) -> Iterator[JobWatch]:
    """N Jobs in flight: the first N pre-created (`pre_create`, straight into the cluster, as if
    the system had been running for a while; it returns once the system is ready) with spread
    run times, each finished one replaced by a JOB_S one through the system (`start_jobs`);
    yields once N are in flight."""
    refiller = Refiller(lambda count: start_jobs([STEPS] * count))
    watch = JobWatch(cluster, namespace, refiller.finished)
    watch.start()
    refiller.start()
    try:
        pre_create(initial_steps(n))

        def all_started() -> bool:
            for part in (watch, refiller):
                if part.error is not None:
                    raise RuntimeError(f"the bench's {type(part).__name__} failed: {part.error}") from part.error
            return len(watch.seen) >= n

        wait_until(all_started, timeout=60 + n / 20, interval=0.2, what=f"{n} Jobs created", details=details)
        # Then until the creates have caught up with the completions (N in flight, but for the
        # replacements on their way). A system that cannot sustain N is measured anyway; the
        # window's in-flight counts show it.
        try:
            wait_until(lambda: all_started() and watch.in_flight >= n - max(1, n // 20), timeout=10 + n / 100,
                       interval=0.2, what=f"{n} Jobs in flight")  # fmt: skip
        except WaitTimeout:
            pass
        time.sleep(SETTLE_S)  # measurement, not synchronisation: let the first completions flow
        yield watch
    finally:
        refiller.stop()
        watch.stop()


def measure(cluster: services.Cluster, watch: JobWatch, window_s: float) -> Window:
    """Requests and completions over `window_s` seconds (a measurement window, not a wait)."""
    before, t0, in_flight_at_start = scrape(cluster), time.time(), watch.in_flight
    time.sleep(window_s)
    after, t1, in_flight_at_end = scrape(cluster), time.time(), watch.in_flight
    after.subtract(before)
    requests = +after
    own_watches = sum(1 for t in watch.ended_at if t0 <= t <= t1)
    for key in [k for k in requests if k[0] == "WATCH"]:
        taken = min(own_watches, requests[key])
        requests[key] -= taken
        own_watches -= taken
    finished = {name: t for name, t in list(watch.finished_at.items()) if t0 <= t <= t1}
    lags = [watch.lag_s[name] for name in finished if name in watch.lag_s]
    if not finished:
        raise RuntimeError(f"no Job finished in the {window_s:g}s window: nothing to divide the requests by")
    return Window(seconds=t1 - t0, requests=+requests, finished=finished, in_flight=(in_flight_at_start, in_flight_at_end),
                  watch_lag_p99_s=_percentile(lags, 0.99) if lags else 0.0)


# --- ours ----------------------------------------------------------------------------------


def _ours(ctx: services.BenchContext, knobs: Knobs, n: int, caps: CapabilityResolver, caps_file: Path) -> Window:
    with services.database(ctx.pg_admin_url) as database_url, services.cluster(ctx.work_dir, name=f"lc-load-{n}") as cluster:
        env = services.deployment_env(
            {
                "database_url": database_url,
                "redis_url": ctx.redis_url,
                "key_prefix": f"{ctx.key_prefix}-load-{n}",
                "namespace": OURS_NAMESPACE,
                "kubeconfig": str(cluster.kubeconfig),
                "capabilities": str(caps_file),
                "poll_interval_s": str(POLL_INTERVAL_S),
                "poll_page_size": str(PAGE_SIZE),
                "worker_concurrency": str(CONCURRENCY),
            }
        )
        settings = load_settings(env)
        engine = make_engine(database_url)
        sessions = make_sessionmaker(engine)
        producer = Celery("bench-producer", set_as_current=False)
        producer.conf.update(celeryconfig.config(settings))
        case_id = workload.new_case(sessions)

        def start_jobs(steps: Sequence[int]) -> None:
            with transaction(sessions) as session:
                for k in steps:
                    schedule_in_session(
                        session,
                        via=producer,
                        case_id=case_id,
                        tenancy_id=workload.TENANCY,
                        capability=capability(k),
                        input={"k": k},
                        idempotency_key=f"key-{uuid.uuid4()}",
                        router=caps,
                        max_input_bytes=settings.max_input_bytes,
                    )

        def pre_create(steps: Sequence[int], ready: Callable[[], None]) -> None:
            """The rows written while the worker and beat start, the Jobs created once they are
            ready: none finishes before the system can replace it."""
            made = workload.created_dispatches(
                sessions, caps, count=len(steps), namespace=OURS_NAMESPACE, deployment=settings.effective_deployment,
                capability_of=lambda i: capability(steps[i]),
            )  # fmt: skip
            ready()
            rawhttp.create_jobs(cluster, OURS_NAMESPACE, [body for _, body in made], clients=PRE_CREATE_CLIENTS)

        def details() -> str:
            return "\n".join(_log_tail(ctx.work_dir / f"{name}.log") for name in ("bench-worker", "bench-beat"))

        try:
            with services.worker_and_beat(ctx.work_dir, env, concurrency=CONCURRENCY) as ready:
                with steady(cluster, OURS_NAMESPACE, n, pre_create=partial(pre_create, ready=ready),
                            start_jobs=start_jobs, details=details) as watch:  # fmt: skip
                    window = measure(cluster, watch, knobs.window_s)
                # The window's Jobs get their terminal events a poll or so later.
                window.latencies_s, window.unrecorded = _latencies(sessions, window.finished)
            window.tasks = task_times((ctx.work_dir / "bench-worker.log").read_text(errors="replace"))
        finally:
            producer.close()
            engine.dispose()
    return window


TASK_DONE = re.compile(r"Task ([\w.-]+)\[[^\]]*\] succeeded in ([\d.]+)s")


def task_times(log: str) -> str:
    """"poll 20x p50 0.12s p99 0.30s, ..." for the tasks of the worker's latest start, from its log."""
    latest = log[log.rfind("--- start #") :]
    seconds: dict[str, list[float]] = {}
    for name, s in TASK_DONE.findall(latest):
        seconds.setdefault(name.rsplit(".", 1)[-1], []).append(float(s))
    return ", ".join(
        f"{name} {len(v)}x p50 {_percentile(v, 0.5):.2f}s p99 {_percentile(v, 0.99):.2f}s" for name, v in sorted(seconds.items())
    )


def _log_tail(path: Path, lines: int = 20) -> str:
    try:
        return f"--- {path.name}:\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return f"--- {path.name}: no log"


def _latencies(sessions: sessionmaker[Session], finished: dict[str, float]) -> tuple[list[float], int]:
    """Seconds from each Job's finish (as the watch saw it) to its terminal event's created_at,
    and how many had none by the deadline (a minute, or a poll interval per 100 Jobs if that is
    longer). A Job still unrecorded then counts with the time waited for it (a lower
    bound of its latency), so a system that falls behind shows it in the percentiles."""
    names = sorted(finished)
    if not names:
        return [], 0
    query = (
        sa.select(Dispatch.job_name, CaseEvent.created_at)
        .join(CaseEvent, CaseEvent.dispatch_id == Dispatch.dispatch_id)
        .where(Dispatch.job_name.in_(names), CaseEvent.type.in_([t.value for t in TERMINAL_EVENT_TYPES]))
    )
    events: dict[str, float] = {}

    def recorded() -> bool:
        with transaction(sessions) as session:
            events.update({name: at.timestamp() for name, at in session.execute(query).all()})
        return len(events) == len(names)

    try:
        wait_until(recorded, timeout=max(60.0, len(names) * POLL_INTERVAL_S / 100), interval=0.5,
                   what=f"terminal events of {len(names)} Jobs")  # fmt: skip
    except WaitTimeout:
        pass
    now = time.time()
    return [events.get(name, now) - finished[name] for name in names], len(names) - len(events)


# --- the baseline ---------------------------------------------------------------------------


def _baseline(ctx: services.BenchContext, knobs: Knobs, n: int) -> Window:
    prefix = f"{ctx.key_prefix}-baseline-{n}"
    with services.cluster(ctx.work_dir, name=f"lc-load-baseline-{n}") as cluster:
        env = {
            "BENCH_BASELINE_BROKER_URL": ctx.redis_url,
            "BENCH_BASELINE_KEY_PREFIX": prefix,
            "BENCH_BASELINE_KUBECONFIG": str(cluster.kubeconfig),
            "BENCH_BASELINE_COUNTDOWN_S": str(COUNTDOWN_S),
        }
        worker = baseline_worker(ctx.work_dir, env, name=f"baseline-worker-{n}")
        producer = Celery("bench-baseline-producer", broker=ctx.redis_url, set_as_current=False)
        producer.conf.update(broker_transport_options={"global_keyprefix": f"{prefix}:"})

        def start_jobs(steps: Sequence[int]) -> None:
            for k in steps:
                producer.send_task(
                    baseline_app.CREATE_TASK, args=[BASELINE_NAMESPACE, _baseline_name(), _ms(knobs, k)],
                    queue=baseline_app.QUEUE,
                )  # fmt: skip

        def pre_create(steps: Sequence[int]) -> None:
            """The Jobs and their pending checks, while the worker starts; returns once it is ready."""
            names = [_baseline_name() for _ in steps]
            bodies = [baseline_app.job_body(name, _ms(knobs, k)) for name, k in zip(names, steps)]
            rawhttp.create_jobs(cluster, BASELINE_NAMESPACE, bodies, clients=PRE_CREATE_CLIENTS)
            # each Job's check already pending, as in a running system: due at spread instants
            for i, name in enumerate(names):
                producer.send_task(
                    baseline_app.CHECK_TASK, args=[BASELINE_NAMESPACE, name], countdown=COUNTDOWN_S * ((i * GOLDEN) % 1.0),
                    queue=baseline_app.QUEUE,
                )  # fmt: skip
            wait_for_log(worker, " ready.", timeout=services.START_TIMEOUT_S)

        try:
            worker.start()
            with steady(cluster, BASELINE_NAMESPACE, n, pre_create=pre_create, start_jobs=start_jobs,
                        details=lambda: worker.log_tail(20)) as watch:  # fmt: skip
                window = measure(cluster, watch, knobs.window_s)
        finally:
            worker.stop()
            producer.close()
    return window


def _baseline_name() -> str:
    return f"base-{uuid.uuid4().hex[:16]}"


def _ms(knobs: Knobs, k: int) -> int:
    return round(1000 * knobs.job_s * k / STEPS)


def baseline_worker(work_dir: Path, env: dict[str, str], *, name: str) -> ManagedProcess:
    """`celery -A bench.baseline_app worker` on the baseline's own queue."""
    argv = [
        sys.executable, "-m", "celery", "-A", "bench.baseline_app", "worker", "--loglevel=INFO",
        f"--hostname={name}@%h", f"--concurrency={CONCURRENCY}", "-Q", baseline_app.QUEUE,
        "--without-mingle", "--without-gossip",
    ]  # fmt: skip
    return ManagedProcess(name, argv, project_env(env), work_dir / f"{name}.log")


# --- the figures ---------------------------------------------------------------------------


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _report(result: BenchResult, n: int, ours: Window, baseline: Window, knobs: Knobs) -> None:
    at_target = n == TARGET_JOBS
    result.figures += [
        Figure(f"requests_per_job_ours_{n}", f"requests per finished Job, ours, {n:,} Jobs", "requests",
               [ours.per_job], target=REQUESTS_PER_JOB if at_target else None, ref="8.2"),
        Figure(f"requests_per_job_baseline_{n}", f"requests per finished Job, baseline, {n:,} Jobs", "requests",
               [baseline.per_job], ref="8.2"),
        Figure(f"requests_per_s_ours_{n}", f"requests/s at the API server, ours, {n:,} Jobs", "requests/s",
               [ours.per_s], ref="8.2"),
        Figure(f"requests_per_s_baseline_{n}", f"requests/s at the API server, baseline, {n:,} Jobs", "requests/s",
               [baseline.per_s], ref="8.2"),
    ]  # fmt: skip
    # Finding finished Jobs, apart from each Job's own create and clean-up: ours LISTs pages
    # (every poll, and the sweep), the baseline GETs each Job every COUNTDOWN_S.
    result.figures += [
        Figure(f"finding_requests_per_s_ours_{n}", f"requests/s finding finished Jobs, ours (LIST pages of "
               f"{PAGE_SIZE}: {math.ceil(n / PAGE_SIZE)} a poll), {n:,} Jobs", "requests/s",
               [ours.requests[("LIST", "jobs", "", 200)] / ours.seconds], ref="8.2"),
        Figure(f"finding_requests_per_s_baseline_{n}", f"requests/s finding finished Jobs, baseline (a GET per Job), "
               f"{n:,} Jobs", "requests/s", [baseline.requests[("GET", "jobs", "", 200)] / baseline.seconds], ref="8.2"),
    ]  # fmt: skip
    if ours.latencies_s:
        result.figures += [
            Figure(f"completion_latency_p50_s_{n}", f"Job finished -> terminal event, p50, {n:,} Jobs", "s",
                   [_percentile(ours.latencies_s, 0.5)], ref="8.3"),
            Figure(f"completion_latency_p99_s_{n}", f"Job finished -> terminal event, p99, {n:,} Jobs", "s",
                   [_percentile(ours.latencies_s, 0.99)], target=LATENCY_P99 if at_target else None, ref="8.3"),
        ]  # fmt: skip
    result.ratios.append(
        Ratio(f"baseline_vs_ours_requests_per_s_{n}", f"requests/s, baseline / ours, {n:,} Jobs",
              [baseline.per_s / max(ours.per_s, 1e-9)], ref="8.2")
    )  # fmt: skip
    expected = knobs.window_s * n / knobs.job_s
    for name, window in (("ours", ours), ("baseline", baseline)):
        result.params[f"{name}_{n}"] = {
            "window_s": round(window.seconds, 2),
            "requests": window.total,
            "jobs_finished": len(window.finished),
            "jobs_finished_expected": round(expected),
            "jobs_in_flight_at_start_and_end": list(window.in_flight),
            "watch_lag_p99_s": round(window.watch_lag_p99_s, 3),
            "requests_by_verb": {f"{v} {r}{'/' + s if s else ''} {c}": k for (v, r, s, c), k in window.requests.items()},
        }
        result.notes.append(
            f"{name}, {n:,} Jobs: {window.total} requests, {len(window.finished)} Jobs finished in {window.seconds:.1f}s "
            f"(~{expected:.0f} expected; {window.in_flight[0]}/{window.in_flight[1]} in flight at start/end"
            f"{'' if min(window.in_flight) >= 0.95 * n else ': N not sustained'}; the watch saw Jobs finish "
            f"{window.watch_lag_p99_s:.1f}s after their completionTime at p99, 0-1 s being on time): {breakdown(window.requests, seconds=window.seconds)}"
            + (f"; worker tasks over the whole run: {window.tasks}" if window.tasks else "")
        )
    if ours.unrecorded:
        result.notes.append(
            f"ours, {n:,} Jobs: {ours.unrecorded} of {len(ours.finished)} finished Jobs had no terminal event by the "
            "deadline; their latency counts as the time waited (a lower bound)"
        )
    if min(baseline.in_flight) < 0.95 * n:
        demanded = n / COUNTDOWN_S + 2 * n / knobs.job_s
        result.notes.append(
            f"baseline, {n:,} Jobs: its worker fell behind, so its figures understate the pattern's load: kept up, it "
            f"would make {demanded:,.0f} requests/s ({n / COUNTDOWN_S:,.0f} GETs/s) and "
            f"{knobs.job_s / COUNTDOWN_S + 2:.0f} requests per Job"
        )
