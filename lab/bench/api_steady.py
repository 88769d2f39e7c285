"""api_load's steady state: N Jobs always in flight, each finished one replaced at once; the bench's
own watch sees Jobs finish, and `measure` takes what the server counted over a window (the
requests, by sender on the real server; the CPU of each process; the watch events our worker read).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import queue
import socket
import threading
import time
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from celery import Celery
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.orm import Session, sessionmaker

from k8s_dispatch import celeryconfig
from k8s_dispatch.core.settings import Settings, load_settings
from k8s_dispatch.lab.bench import services
from k8s_dispatch.lab.bench.api_counts import (
    CREATED,
    Key,
    actor_group,
    audited,
    per_finished_job,
    pods_behind,
    scrape,
    server_ms,
)
from k8s_dispatch.lab.bench.dispatch_throughput import cpu_seconds
from k8s_dispatch.ops.processes import (
    WaitTimeout,
    wait_until,
)
from k8s_dispatch.store.db import make_engine, make_sessionmaker

POLL_INTERVAL_S = 2.0
PAGE_SIZE = 500  # poll's LIST pages (K8S_DISPATCH_POLL_PAGE_SIZE, its default)
STEPS = 60  # run times of the first N Jobs: JOB_S * k / STEPS, k = 0..STEPS
# After the first N Jobs are in flight, before the window opens: a poll interval, so that the
# system's first poll of them (it records those that finished while they were being created:
# requests whose Jobs the window would not count) is behind.
SETTLE_S = POLL_INTERVAL_S

GOLDEN = (5**0.5 - 1) / 2


def initial_steps(n: int) -> list[int]:
    """The run time (in STEPS) of each of the first n Jobs: spread evenly over 0..STEPS, and over
    any run of consecutive Jobs too (a golden-ratio sequence), so that however long creating
    them takes, they finish at an even rate: the N / JOB_S per second of the steady state."""
    return [round(STEPS * ((i * GOLDEN) % 1.0)) for i in range(n)]


@dataclass
class Window:
    """What one steady state showed in its window."""

    seconds: float
    requests: Counter[Key]  # counted by the server, the bench's own removed
    finished: dict[str, float]  # Job name -> the instant the bench saw it finish, inside the window
    in_flight: tuple[int, int]  # Jobs running at the window's start and end
    latencies_s: list[float] = field(default_factory=list)  # ours: finish -> terminal event
    unrecorded: int = 0  # ours: finished Jobs without a terminal event by `_latencies`' deadline
    tasks: str = ""  # ours: what the worker's tasks that ended in the window took, from its log
    span: tuple[float, float] = (0.0, 0.0)  # the window's start and end (time.time())
    watch_lag_p99_s: float = 0.0  # the bench's watch: seen finished - completionTime (< 1 s: on time)
    # the real server: the window's requests by who sent them (its audit log), the bench's left out
    by_actor: dict[str, Counter[Key]] = field(default_factory=dict)
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds of each process in the window
    pods_behind: int = 0  # the real server: Jobs still without a bound Pod when the window opened
    server_ms: dict[str, float] = field(default_factory=dict)  # the real server's mean ms per request, by verb
    job_bytes: int = 0  # ours: the JSON of one Job in a LIST page, on average (after the window)
    # objects the server sent in the window: "LIST jobs", "WATCH jobs", "LIST pods", ... (the
    # objects LISTs returned, from storage or the watch cache; watch events), the bench's own removed
    objects: Counter[str] = field(default_factory=Counter)
    # the watch events on Jobs our worker read in the window, by its own count: on the real server
    # "WATCH jobs" also counts the events sent to the controllers' informers
    events_read: int = 0

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
        return per_finished_job(self.requests, len(self.finished))

    def sent_by(self, group: str) -> Counter[Key]:
        """The requests of one group of senders (OURS, NODE, CONTROLLERS, ...), from the audit log."""
        out: Counter[Key] = Counter()
        for actor, requests in self.by_actor.items():
            if actor_group(actor) == group:
                out.update(requests)
        return out

    @property
    def per_s(self) -> float:
        return self.total / self.seconds


# --- seeing Jobs finish ------------------------------------------------------------------


@dataclass(frozen=True)
class Deployment:
    """A deployment as a bench drives it: the environment its worker and beat get, its settings,
    and an engine's handles on it (sessions on its database, a Celery producer on its broker)."""

    env: dict[str, str]
    settings: Settings
    sessions: sessionmaker[Session]
    producer: Celery


@contextmanager
def deployment(values: Mapping[str, str]) -> Iterator[Deployment]:
    """The deployment `values` (settings' names: `services.deployment_env`) make, with an
    engine's sessions and producer, closed at the end."""
    env = services.deployment_env(dict(values))
    settings = load_settings(env)
    engine = make_engine(settings.database_url)
    producer = Celery("bench-producer", set_as_current=False)
    producer.conf.update(celeryconfig.config(settings))
    try:
        yield Deployment(env, settings, make_sessionmaker(engine), producer)
    finally:
        producer.close()
        engine.dispose()


class RawWatch:
    """Raw watch requests on one collection (`path`, e.g. /api/v1/namespaces/NS/pods), one after
    another from the last resourceVersion seen, read on a thread: each object event is handed to
    `on_object` with the instant it was read. A failure is kept in `error` (the caller raises it);
    `stop` ends the request under way."""

    def __init__(self, cluster: services.Cluster, path: str, *, name: str) -> None:
        self._cluster = cluster
        self._path = path
        self.ended_at: list[float] = []  # when each of our watch requests ended (the server counts it then)
        self.events = 0  # events the server sent this watch (counted in its apiserver_watch_events_total)
        self.error: BaseException | None = None
        self._conn: http.client.HTTPConnection | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def on_object(self, obj: dict[str, Any], now: float) -> None:
        """An object as an ADDED, MODIFIED or DELETED event carried it, read at `now`."""
        raise NotImplementedError

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        conn = self._conn
        if conn is not None and conn.sock is not None:
            with suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        rv = ""
        try:
            while not self._stopping.is_set():
                rv = self._watch(rv)
        except Exception as e:  # the thread's end: the caller raises `error` in its own thread
            if not self._stopping.is_set():
                self.error = e

    def _watch(self, rv: str) -> str:
        """One watch request, from `rv` ("" = every object now, then changes); the last rv seen."""
        conn = self._cluster.connection(timeout=None)
        self._conn = conn
        query = urllib.parse.urlencode({"watch": "true", "timeoutSeconds": "3600", "resourceVersion": rv})
        try:
            conn.request("GET", f"{self._path}?{query}", headers=self._cluster.headers())
            response = conn.getresponse()
            if response.status != 200:
                raise RuntimeError(f"watch answered {response.status}: {response.read()[:200]!r}")
            for line in response:
                now = time.time()
                self.events += 1
                event = json.loads(line)
                obj = event["object"]
                if event["type"] == "ERROR":
                    raise RuntimeError(f"watch error: {obj.get('message')}")
                rv = (obj.get("metadata") or {}).get("resourceVersion", rv)
                if event["type"] != "BOOKMARK":
                    self.on_object(obj, now)
        finally:
            self.ended_at.append(time.time())
            conn.close()
        return rv


class JobWatch(RawWatch):
    """A watch of a namespace's Jobs: the instant each Job is first seen with a Complete or
    Failed condition, and the Jobs seen at all."""

    def __init__(self, cluster: services.Cluster, namespace: str, on_finished: Callable[[str], None]) -> None:
        super().__init__(cluster, f"/apis/batch/v1/namespaces/{namespace}/jobs", name=f"watch-{namespace}")
        self._on_finished = on_finished
        self.finished_at: dict[str, float] = {}
        # how late the watch saw each Job finish, against its completionTime (whole seconds: 0-1 s
        # is on time): the instrument's own lag, which would hide latency
        self.lag_s: dict[str, float] = {}
        self.seen: set[str] = set()

    @property
    def in_flight(self) -> int:
        """Jobs seen and not (yet) seen finished."""
        return len(self.seen) - len(self.finished_at)

    def on_object(self, obj: dict[str, Any], now: float) -> None:
        name = (obj.get("metadata") or {}).get("name")
        if name is None:
            return
        self.seen.add(name)
        if name not in self.finished_at and _finished(obj):
            self.finished_at[name] = now
            self.lag_s[name] = now - _completion_time(obj, default=now)
            self._on_finished(name)


def _completion_time(job: dict[str, Any], *, default: float) -> float:
    """The Job's status.completionTime (or, failed, its condition's time) as a Unix time."""
    status = job.get("status") or {}
    stamp = status.get("completionTime") or next(
        (c.get("lastTransitionTime") for c in status.get("conditions") or [] if c.get("type") == "Failed"), None
    )
    if not stamp:
        return default
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


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
                except Exception as e:
                    self.error = e
                    return
            if None in items:
                return


@contextmanager
def steady(
    cluster: services.Cluster,
    namespace: str,
    n: int,
    *,
    pre_create: Callable[[Sequence[int]], None],
    start_jobs: Callable[[Sequence[int]], None],
    details: Callable[[], str],
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
        with contextlib.suppress(WaitTimeout):
            wait_until(lambda: all_started() and watch.in_flight >= n - max(1, n // 20), timeout=10 + n / 100,
                       interval=0.2, what=f"{n} Jobs in flight")  # fmt: skip
        # And until Jobs finish: their run times count from their containers' start, which a real
        # node takes its time over when N Pods come at once (a minute for 300 on 2 cores).
        with contextlib.suppress(WaitTimeout):
            wait_until(lambda: all_started() and len(watch.finished_at) >= max(1, n // 20), timeout=60 + n / 5,
                       interval=0.2, what=f"the first of {n} Jobs finished")  # fmt: skip
        time.sleep(SETTLE_S)  # measurement, not synchronisation: let the first completions flow
        yield watch
    finally:
        refiller.stop()
        watch.stop()


def measure(
    cluster: services.Cluster,
    watch: JobWatch,
    window_s: float,
    *,
    pids: dict[str, int | None],
    worker_metrics: str | None = None,
    leave_out: frozenset[str] = frozenset(),
) -> Window:
    """Requests and completions over `window_s` seconds (a measurement window, not a wait), and
    the CPU each of `pids` (and the bench) used in it; on the real server, who sent the requests;
    the watch events our worker read (`worker_metrics`: its /metrics URL; the baseline has none);
    `leave_out`: namespaces whose requests the audit's split by sender leaves out."""
    audit_from = cluster.audit_log.stat().st_size if cluster.audit_log else 0
    cpu_before = _cpu(pids)
    read_before = events_read_by(worker_metrics)
    first, in_flight_at_start, own_events = scrape(cluster), watch.in_flight, watch.events
    time.sleep(window_s)
    last, in_flight_at_end, own_events = scrape(cluster), watch.in_flight, watch.events - own_events
    events_read = events_read_by(worker_metrics) - read_before
    objects = last.objects.copy()
    objects.subtract(first.objects)
    objects["WATCH jobs"] -= own_events  # the bench's own watch is no reader of ours
    cpu_after = _cpu(pids)
    t0, t1 = first.at, last.at
    after = last.requests.copy()
    after.subtract(first.requests)
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
    return Window(seconds=t1 - t0, span=(t0, t1), requests=+requests, finished=finished,
                  in_flight=(in_flight_at_start, in_flight_at_end),
                  watch_lag_p99_s=_percentile(lags, 0.99) if lags else 0.0,
                  by_actor=audited_window(cluster, offset=audit_from, leave_out=leave_out) if cluster.audit_log else {},
                  cpu_s={name: cpu_after[name] - cpu_before[name] for name in cpu_before},
                  server_ms=server_ms(first, last), objects=+objects, events_read=events_read)  # fmt: skip


WORKER_EVENTS = "k8s_dispatch_kube_watch_events_total"


def events_read_by(url: str | None) -> int:
    """The watch events on Jobs the worker has read (its own counter, from its /metrics)."""
    if url is None:
        return 0
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == WORKER_EVENTS and s.labels.get("resource") == "jobs":
                return int(s.value)
    return 0


def _pods_behind(cluster: services.Cluster, *, slack: int, timeout: float = 120.0) -> int:
    """Wait until at most `slack` Jobs lack a bound Pod (`pods_behind`): the steady state starts
    there, not when N Jobs exist. How many lacked one then (more than `slack` after `timeout`: not
    sustained, and measured anyway)."""
    behind = [0]

    def caught_up() -> bool:
        behind[0] = pods_behind(scrape(cluster).requests)
        return behind[0] <= slack

    with suppress(WaitTimeout):
        wait_until(caught_up, timeout=timeout, interval=1.0, what=f"Pods for all but {slack} Jobs")
    return behind[0]


def _listed_bytes_per_job(cluster: services.Cluster, namespace: str) -> int:
    """The bytes of one Job in a LIST page of PAGE_SIZE (what each poll reads), on average."""
    status, body = cluster.request("GET", f"/apis/batch/v1/namespaces/{namespace}/jobs?limit={PAGE_SIZE}")
    items = json.loads(body).get("items") or [] if status == 200 else []
    return round(len(body) / len(items)) if items else 0


def _cpu(pids: dict[str, int | None]) -> dict[str, float]:
    """CPU seconds so far of each process, the bench's own, and the whole machine's (every core's
    busy time, whoever used it: what shows the cores saturated)."""
    return {"bench": time.process_time(), **{name: cpu_seconds(pid) for name, pid in pids.items()},
            "machine": _machine_cpu_seconds()}  # fmt: skip


def _machine_cpu_seconds() -> float:
    """Busy CPU seconds of all cores since boot (/proc/stat: all but idle and iowait; 0 if unknown)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def audited_window(
    cluster: services.Cluster, *, offset: int, leave_out: frozenset[str] = frozenset()
) -> dict[str, Counter[Key]]:
    """The window's requests by sender, from the audit log written after byte `offset` (before the
    window's first scrape); read once the second scrape is in it (`audited`), or after 10 s."""
    assert cluster.audit_log is not None and cluster.plane is not None
    audit_log = cluster.audit_log
    found: dict[str, Counter[Key]] = {}

    def read() -> bool:
        with open(audit_log, encoding="utf-8", errors="replace") as f:
            f.seek(offset)
            found.update(audited(f.read().splitlines(), admin=cluster.plane.admin.name, leave_out=leave_out))
        return bool(found)

    with suppress(WaitTimeout):
        wait_until(read, timeout=10.0, interval=0.2, what="the window's second scrape in the audit log")
    return found


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]
