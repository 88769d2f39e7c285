"""`k8s-dispatch demo`: the whole system on embedded defaults, its worker killed mid-run.

Starts localcluster (exec mode: Jobs run as local processes), a broker (the configured Redis
if it answers, else an embedded fakeredis server), SQLite in a temporary directory (or the
configured database), a real `celery -A k8s_dispatch.tasks worker` and `beat`; schedules a few dozen
dispatches over the three demo capabilities, SIGKILLs the worker mid-run, drops the queued
messages, restarts it and shows what its start-up sweep found and did; then checks that every
dispatch ended exactly once with the right output. One of them (`demo.report`) makes a result of
a few MiB, which goes to an object store: a directory in the demo's temporary directory, whose
file:// "presigned" URLs the Jobs (local processes) write; at the end the demo reads it back
through `k8s_dispatch.api` and checks its SHA-256 against the bytes it expects. One tenancy runs
under a fair-share limit (`DEMO_LIMITS`, in the demo's capability file): its dispatches wait,
queued in the database, and are admitted in turn; the demo samples the cluster's running Jobs of
that tenancy and the database's queue, and checks that the limit was never exceeded. Everything
it starts is stopped, and its files (the object store's too) removed, on the way out (also on
Ctrl-C and SIGTERM).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import tempfile
import threading
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis
import sqlalchemy as sa
import yaml
from celery import Celery
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from sqlalchemy.engine import make_url

from k8s_dispatch import api
from k8s_dispatch import celeryconfig as names
from k8s_dispatch.artifacts.errors import InvalidResultReference
from k8s_dispatch.artifacts.reference import parse_reference
from k8s_dispatch.core.errors import Transient
from k8s_dispatch.core.settings import Settings, load_settings
from k8s_dispatch.demo import functions as demo_functions
from k8s_dispatch.demo.localcluster import LocalCluster
from k8s_dispatch.ops import interrupts, processes
from k8s_dispatch.store import admission, dispatches, scheduling
from k8s_dispatch.store.db import make_engine, make_sessionmaker, transaction
from k8s_dispatch.store.migrate import upgrade
from k8s_dispatch.store.models import TERMINAL_EVENT_TYPES, TERMINAL_STATES, CaseEvent, Dispatch, DispatchState
from k8s_dispatch.tasks.recovery_tasks import STARTUP_SWEEP_DONE
from k8s_dispatch.tasks.scheduling import schedule_many_in_session
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.job_status import job_state
from k8s_dispatch.workers.kube import KubeClient
from k8s_dispatch.workers.resolver import DEMO_FUNCTIONS, DEMO_STORED_FUNCTIONS, CapabilityResolver, demo_config

WORKER_NAME = "demo-worker"
WORKER_DOWN = "worker DOWN"  # the phase in which the worker is dead on purpose
NAMESPACE = "default"
# Short intervals so that recovery shows within seconds (production defaults are 2 s / 30 s / 30 s).
DEMO_SETTINGS = {
    "POLL_INTERVAL_S": "0.5",
    "SWEEP_INTERVAL_S": "4",
    "SWEEP_GRACE_S": "2",
    "GUARD_LEASE_MS": "5000",  # a claim held by the killed worker expires after this
    "BROKER_VISIBILITY_TIMEOUT_S": "10",  # the killed worker's unacknowledged messages come back after this
    "WORKER_CONCURRENCY": "4",
}
KILL_AT = 0.35  # of the first wave ended
FIRST_WAVE = 0.7  # of the dispatches; the rest is scheduled while the worker is down
BAD_INPUT = {"limit": demo_functions.MAX_PRIMES_LIMIT + 1}  # refused by the function: must fail
# The dispatch whose result goes to the object store: early in the first wave, on the tenancy with
# no limit, so its Job runs while the worker is still up to be killed.
REPORT_AT = 1
REPORT_ROWS = 100_000  # about 3.4 MiB of CSV: far more than a termination message's 4 KiB
REFRESH_S = 0.25
# One tenancy limited to a few Jobs at once: the rest of its dispatches wait their turn.
LIMITED_TENANCY = "acme"
LIMITED_MAX_RUNNING = 2
DEMO_LIMITS = {"tenancies": {LIMITED_TENANCY: {"maxRunning": LIMITED_MAX_RUNNING}}}


# --- what the demo asks for and what it expects (pure) --------------------------------------

_TEXTS = (
    "the quick brown fox jumps over the lazy dog",
    "to be, or not to be,\nthat is the question",
    "exactly once, through crashes and restarts",
    "jobs carry labels;\nlabels carry the truth;\nthe sweep reads them",
    "a finalizer keeps the result until it is recorded",
)


@dataclass(frozen=True)
class DemoRequest:
    capability: str
    input: dict[str, Any]
    case_id: str
    tenancy_id: str
    idempotency_key: str
    expected: Any = None  # the output it must produce; None when it must fail
    must_fail: bool = False
    stored: bool = False  # its result goes to the object store: `expected` is then its size and SHA-256

    def request(self) -> scheduling.ScheduleRequest:
        return scheduling.ScheduleRequest(
            self.case_id, self.tenancy_id, self.capability, self.input, self.idempotency_key
        )


def plan_requests(count: int, *, run_id: str) -> list[DemoRequest]:
    """`count` dispatches over the three demo capabilities, on 2 tenancies and 6 cases; the 4th
    has input its function refuses, so one dispatch must end FAILED with a reason; the 2nd is a
    `demo.report`, whose result of a few MiB goes to the object store."""
    capabilities = sorted(DEMO_FUNCTIONS)  # demo.primes, demo.sha256, demo.wordcount
    (stored_capability,) = DEMO_STORED_FUNCTIONS  # demo.report
    requests = []
    for i in range(count):
        capability = stored_capability if i == REPORT_AT else capabilities[i % len(capabilities)]
        must_fail = i == 3
        if capability == stored_capability:
            data: dict[str, Any] = {"rows": REPORT_ROWS, "seed": i}
        elif capability == "demo.primes":
            data = BAD_INPUT if must_fail else {"limit": 10_000 + 7_919 * i}
        else:
            data = {"text": f"{_TEXTS[i % len(_TEXTS)]} #{i}"}
        target = (DEMO_FUNCTIONS | DEMO_STORED_FUNCTIONS)[capability][1]
        function = getattr(demo_functions, target.split(":")[1])
        expected = None if must_fail else function(data)
        if isinstance(expected, bytes):
            expected = {"size": len(expected), "sha256": hashlib.sha256(expected).hexdigest()}
        tenancy = ("acme", "globex")[i % 2]
        requests.append(
            DemoRequest(
                capability=capability,
                input=data,
                case_id=f"demo-{run_id}-{tenancy}-{i % 3}",
                tenancy_id=tenancy,
                idempotency_key=f"demo-{run_id}-{i}",
                expected=expected,
                must_fail=must_fail,
                stored=capability == stored_capability,
            )
        )
    return requests


def right_output(request: DemoRequest, output: Any) -> bool:
    """Whether a completed dispatch's recorded output is the one `request` expects: for a stored
    result, a reference whose size and SHA-256 are the expected bytes'."""
    if not request.stored:
        return bool(output == request.expected)
    try:
        reference = parse_reference(output)
    except InvalidResultReference:
        return False
    return {"size": reference.size, "sha256": reference.sha256} == request.expected


@dataclass(frozen=True)
class Outcome:
    """What the database says of one dispatch at the end."""

    state: str
    output: Any
    reason: str | None
    terminal_events: int
    notified: bool


@dataclass(frozen=True)
class ReadBack:
    """A stored result at the end: the reference its terminal event recorded, and its bytes as
    `k8s_dispatch.api.read_result` streams them."""

    capability: str
    dispatch_id: str
    expected_size: int
    expected_sha256: str  # of the bytes the demo computed itself
    recorded_size: int | None = None  # None: no reference recorded
    recorded_sha256: str | None = None
    read_size: int = 0
    read_sha256: str | None = None  # None: not read (see error)
    seconds: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return (
            self.error is None
            and self.expected_size == self.recorded_size == self.read_size
            and self.expected_sha256 == self.recorded_sha256 == self.read_sha256
        )


@dataclass
class Summary:
    dispatched: int = 0
    completed: int = 0
    failed: int = 0
    failed_as_intended: int = 0
    lost: int = 0  # not ended at the deadline
    duplicates: int = 0  # terminal events beyond the first
    right_outputs: int = 0
    wrong: list[str] = field(default_factory=list)  # dispatches whose end is not the expected one
    unnotified: int = 0  # ended, the engine not told
    jobs_left: int = 0  # Jobs of ours still in the cluster
    # The limited tenancy: the most of its Jobs seen running at once (the cluster, sampled every
    # REFRESH_S), the most of its dispatches holding a slot and waiting for one (the database).
    max_running: int = 0
    max_holding: int = 0
    max_queued: int = 0
    limit: int = LIMITED_MAX_RUNNING
    stored: int = 0  # dispatches whose result goes to the object store
    read_back: list[ReadBack] = field(default_factory=list)  # their results, read back at the end
    elapsed_s: float = 0.0
    problems: list[str] = field(default_factory=list)  # the run itself went wrong (a process died...)

    @property
    def ok(self) -> bool:
        return (
            self.dispatched > 0
            and self.lost == 0
            and self.duplicates == 0
            and not self.wrong
            and self.unnotified == 0
            and self.jobs_left == 0
            and self.max_running <= self.limit
            and self.max_holding <= self.limit
            and len(self.read_back) == self.stored
            and all(r.ok for r in self.read_back)
            and not self.problems
        )

    def line(self) -> str:
        verdict = "demo OK" if self.ok else "demo FAILED"
        return (
            f"{verdict}: dispatched={self.dispatched} completed={self.completed} failed={self.failed} "
            f"(as intended: {self.failed_as_intended}) lost={self.lost} duplicates={self.duplicates} "
            f"right_outputs={self.right_outputs}/{self.completed} jobs_left={self.jobs_left} "
            f"{LIMITED_TENANCY}: max_running={self.max_running}/{self.limit} max_queued={self.max_queued} "
            f"in {self.elapsed_s:.1f}s"
        )


def summarise(
    requests: list[DemoRequest],
    ids: list[str],
    outcomes: Mapping[str, Outcome],
    *,
    jobs_left: int,
    elapsed_s: float,
) -> Summary:
    """Check every dispatch: one terminal event, the expected end, the right output."""
    s = Summary(dispatched=len(ids), jobs_left=jobs_left, elapsed_s=elapsed_s, stored=sum(r.stored for r in requests))
    for request, dispatch_id in zip(requests, ids, strict=True):
        outcome = outcomes.get(dispatch_id)
        if outcome is None or outcome.terminal_events == 0:
            s.lost += 1
            continue
        s.duplicates += outcome.terminal_events - 1
        s.unnotified += not outcome.notified
        if outcome.state == "COMPLETED":
            s.completed += 1
            if not request.must_fail and right_output(request, outcome.output):
                s.right_outputs += 1
                continue
        elif outcome.state == "FAILED":
            s.failed += 1
            if request.must_fail:
                s.failed_as_intended += 1
                continue
        s.wrong.append(f"{dispatch_id} {request.capability}: {outcome.state} {outcome.reason or ''}".rstrip())
    return s


_COUNTS = re.compile(r"\b([a-z_]+)=(\d+)/(\d+)(?:/\d+)*")


def parse_sweep_line(line: str) -> list[tuple[str, int, int]]:
    """(category, found, acted) from a sweep's summary line (`... finished_unrecorded=3/3/0 ...`)."""
    return [(name, int(found), int(acted)) for name, found, acted in _COUNTS.findall(line)]


# --- the services the demo starts ---------------------------------------------------------


@dataclass
class Broker:
    url: str
    description: str
    close: Callable[[], None]


def open_broker(mode: str, redis_url: str) -> Broker:
    """The Redis at `redis_url` if it answers (mode auto/redis), else an embedded fakeredis server.

    Raises:
        RuntimeError: mode "redis" and Redis does not answer.
    """
    if mode in ("auto", "redis"):
        client = redis.Redis.from_url(redis_url, socket_connect_timeout=0.5, socket_timeout=0.5)
        try:
            client.ping()
            return Broker(redis_url, f"Redis at {redis_url}", lambda: None)
        except redis.RedisError as e:
            if mode == "redis":
                raise RuntimeError(f"Redis at {redis_url} does not answer: {e}") from e
        finally:
            client.close()
    from fakeredis import TcpFakeServer

    server = TcpFakeServer(("127.0.0.1", 0), server_type="redis")
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="embedded-redis", daemon=True)
    thread.start()
    port = server.server_address[1]  # bound to 127.0.0.1 above

    def close() -> None:
        server.shutdown()
        server.server_close()
        thread.join(5)

    return Broker(f"redis://127.0.0.1:{port}/0", f"embedded fakeredis at 127.0.0.1:{port} (no Redis answered)", close)


# --- the run ------------------------------------------------------------------------------


def run_demo(
    *,
    count: int = 30,
    broker: str = "auto",
    timeout_s: float = 90.0,
    keep: bool = False,
    console: Console | None = None,
) -> Summary:
    """Run the demo; returns its summary (`.ok` says whether every check held)."""
    console = console or Console()
    with interrupts.interrupts(), ExitStack() as stack:
        return _Demo(console=console, stack=stack, count=count, timeout_s=timeout_s, keep=keep).run(broker)


class _Demo:
    def __init__(self, *, console: Console, stack: ExitStack, count: int, timeout_s: float, keep: bool) -> None:
        self.console = console
        self.stack = stack
        self.count = count
        self.started = time.monotonic()
        self.deadline = self.started + timeout_s
        self.keep = keep
        self.run_id = uuid.uuid4().hex[:6]
        self.ids: list[str] = []
        self.phase = "starting"
        # The limited tenancy, sampled at each refresh (see Summary).
        self.max_running = self.max_holding = self.max_queued = 0

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def note(self, text: str) -> None:
        interrupts.check()
        elapsed = time.monotonic() - self.started
        self.console.print(f"[dim]{elapsed:5.1f}s[/dim]  {text}")

    # --- set-up -----------------------------------------------------------------------

    def run(self, broker_mode: str) -> Summary:
        tmp = Path(tempfile.mkdtemp(prefix="k8s-dispatch-demo-"))
        self.stack.callback(self._remove_tmp, tmp)
        # A library's temporary files in this process go there too, and are removed with it: the
        # Kubernetes client writes a kubeconfig's CA to one, and a Ctrl-C between its write and
        # its atexit registration would leave it behind.
        self.stack.callback(setattr, tempfile, "tempdir", tempfile.tempdir)
        tempfile.tempdir = str(tmp)
        env_values = self._start_services(tmp, broker_mode)
        self.settings = load_settings(env_values)
        child_env = {k: v for k, v in processes.project_env({}).items() if not k.startswith("K8S_DISPATCH_")}
        child_env.update(env_values)
        child_env["TMPDIR"] = str(tmp)  # beat's and Celery's state files stay in the demo's directory
        self.worker = processes.celery_worker(
            WORKER_NAME, env=child_env, log_dir=tmp, concurrency=int(DEMO_SETTINGS["WORKER_CONCURRENCY"])
        )
        self.beat = processes.celery_beat(env=child_env, log_dir=tmp)
        self.stack.callback(self._stop_processes)

        self.worker.start()
        self.beat.start()
        try:
            processes.wait_for_log(self.worker, STARTUP_SWEEP_DONE, timeout=min(45.0, self.remaining()))
            processes.wait_for_log(self.beat, "beat: Starting", timeout=min(20.0, self.remaining()))
        except (processes.WaitTimeout, RuntimeError) as e:
            return self._failed_run(f"the worker or beat did not start: {e}")
        self.note(f"worker [bold]{WORKER_NAME}[/bold] (pid {self.worker.pid}) and beat (pid {self.beat.pid}) running")
        return self._run_dispatches()

    def _start_services(self, tmp: Path, broker_mode: str) -> dict[str, str]:
        """Broker, database, cluster; returns the K8S_DISPATCH_* settings for the worker and beat."""
        configured = {k: v for k, v in os.environ.items() if k.startswith("K8S_DISPATCH_")}
        redis_url = configured.get("K8S_DISPATCH_REDIS_URL", Settings.model_fields["redis_url"].default)
        broker = open_broker(broker_mode, redis_url)
        self.stack.callback(broker.close)
        self.broker = broker
        prefix = f"k8s-dispatch-demo-{self.run_id}"
        self.stack.callback(self._forget_keys, broker.url, prefix)

        database_url = configured.get("K8S_DISPATCH_DATABASE_URL") or f"sqlite:///{tmp / 'demo.db'}"
        upgrade(database_url)

        cluster = LocalCluster(mode="exec", kubeconfig_path=tmp / "kubeconfig")
        cluster.start()
        self.stack.callback(cluster.stop)
        self.cluster = cluster

        metrics_port = processes.free_port()
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        header = Table.grid(padding=(0, 2))
        header.add_row("cluster", f"localcluster at {cluster.url} (exec mode: Jobs are local processes)")
        header.add_row("broker", broker.description)
        header.add_row("database", _redacted(database_url))
        header.add_row("files", f"{tmp} (removed at the end)" if not self.keep else str(tmp))
        header.add_row("metrics", self.metrics_url)
        # The object store: a directory beside the rest, removed with it. Its "presigned" URLs are
        # file:// paths, which the Jobs can write because in exec mode they are local processes.
        objects = tmp / "objects"
        objects.mkdir()
        header.add_row(
            "object store", f"directory {objects.name}/ under files (its file:// URLs work: Jobs are local processes)"
        )
        capabilities = tmp / "capabilities.yaml"
        capabilities.write_text(yaml.safe_dump(demo_config(object_store=True) | {"limits": DEMO_LIMITS}))
        header.add_row(
            "limits", f"tenancy {LIMITED_TENANCY}: at most {LIMITED_MAX_RUNNING} Jobs at once (the rest wait, queued)"
        )
        self.console.rule("[bold]k8s-dispatch demo")
        self.console.print(header)
        values = {
            "K8S_DISPATCH_CAPABILITIES": str(capabilities),
            "K8S_DISPATCH_DATABASE_URL": database_url,
            "K8S_DISPATCH_REDIS_URL": broker.url,
            "K8S_DISPATCH_KEY_PREFIX": prefix,
            "K8S_DISPATCH_NAMESPACE": NAMESPACE,
            "K8S_DISPATCH_KUBECONFIG": str(cluster.kubeconfig),
            "K8S_DISPATCH_METRICS_PORT": str(metrics_port),
            "K8S_DISPATCH_OBJECT_STORE_ENDPOINT": objects.as_uri(),
        }
        values.update({f"K8S_DISPATCH_{k}": v for k, v in DEMO_SETTINGS.items()})
        return values

    # --- the dispatches -----------------------------------------------------------------

    def _run_dispatches(self) -> Summary:
        producer = Celery("k8s-dispatch-demo", set_as_current=False)
        producer.conf.update(names.config(self.settings))
        self.stack.callback(producer.close)
        engine = make_engine(self.settings.database_url)
        self.stack.callback(engine.dispose)
        self.sessions = make_sessionmaker(engine)
        self.kube = KubeClient(self.settings.kubeconfig)
        self.stack.callback(self.kube.close)
        self.producer = producer

        requests = plan_requests(self.count, run_id=self.run_id)
        first = max(1, int(len(requests) * FIRST_WAVE))
        self.total = len(requests)

        progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
        )
        self.bar = progress.add_task("ended", total=self.total)
        self.progress = progress
        with Live(self._view(), console=self.console, refresh_per_second=8, transient=False) as live:
            self.live = live
            try:
                self._schedule(requests[:first])
                self.note(
                    f"scheduled {first} dispatches over {', '.join(sorted({r.capability for r in requests[:first]}))}"
                )
                holding, queued = self._queue()
                limited = sum(r.tenancy_id == LIMITED_TENANCY for r in requests[:first])
                self.note(
                    f"tenancy [bold]{LIMITED_TENANCY}[/bold] may run {LIMITED_MAX_RUNNING} Jobs at once: "
                    f"{queued} of its {limited} dispatches wait their turn, queued in the database ({holding} admitted)"
                )
                self._watch(lambda ended, _jobs: ended >= max(1, int(first * KILL_AT)), "some dispatches end")
                self._kill_and_recover(requests[first:])
                self.phase = "finishing"
                settled = self._watch(self._settled, "every dispatch ended, told and cleaned up", allow_timeout=True)
                if not settled:
                    self.note("[red]the deadline passed before everything settled[/red]")
            except _Stop as e:
                self.console.print()
                return self._failed_run(str(e), requests=requests)
        self.console.print()
        return self._finish(requests)

    def _schedule(self, requests: list[DemoRequest]) -> None:
        resolver = CapabilityResolver.from_settings(self.settings)
        with transaction(self.sessions) as session:
            for request in requests:
                scheduling.create_case(session, case_id=request.case_id, tenancy_id=request.tenancy_id)
                (result,) = schedule_many_in_session(
                    session, [request.request()], router=resolver,
                    max_input_bytes=self.settings.max_input_bytes, via=self.producer,
                )  # fmt: skip
                self.ids.append(result.dispatch_id)

    def _kill_and_recover(self, second_wave: list[DemoRequest]) -> None:
        pid = self.worker.pid
        self.worker.kill(signal.SIGKILL)
        self.phase = WORKER_DOWN
        self.note(f"[bold red]SIGKILL[/bold red] to the worker (pid {pid}) in the middle of its work")
        killed_at = time.monotonic()
        if second_wave:
            self._schedule(second_wave)
            self.note(f"scheduled {len(second_wave)} more dispatches while no worker runs")
        dropped = self._drop_queued_messages()
        self.note(f"the broker loses its queues too: [bold]{dropped}[/bold] queued task messages dropped")
        # Long enough for Jobs to finish with nobody to record them, and for the second wave
        # to pass the sweep's grace period.
        grace = float(DEMO_SETTINGS["SWEEP_GRACE_S"])

        def long_enough(_ended: int, jobs: tuple[int, int]) -> bool:
            down_s = time.monotonic() - killed_at
            return (down_s >= grace and jobs[1] > 0) or down_s >= 3 * grace

        self._watch(long_enough, "Jobs finish with no worker")
        jobs_running, jobs_finished = self._jobs()
        self.note(f"meanwhile: {jobs_finished} Jobs finished with nobody to record them, {jobs_running} still running")
        self.worker.start()
        self.phase = "worker restarting"
        self.note(f"worker restarted (pid {self.worker.pid}): its start-up sweep runs before any task")
        try:
            line = processes.wait_for_log(self.worker, STARTUP_SWEEP_DONE, timeout=min(45.0, self.remaining()))
        except (processes.WaitTimeout, RuntimeError) as e:
            raise _Stop(f"the restarted worker did not finish its start-up sweep: {e}") from e
        self.phase = "recovered"
        self.note("the restarted worker's start-up sweep found and did:")
        self.live.console.print(self._sweep_table(line))

    def _drop_queued_messages(self) -> int:
        """Delete the task queues' pending messages, as a broker that lost its data would."""
        client = redis.Redis.from_url(self.broker.url)
        try:
            keys = [f"{self.settings.key_prefix}:{q}" for q in (names.JOBS_QUEUE, names.COMPLETE_QUEUE)]
            pipe = client.pipeline()
            for key in keys:
                pipe.llen(key)
            for key in keys:
                pipe.delete(key)
            return sum(pipe.execute()[: len(keys)])
        finally:
            client.close()

    def _sweep_table(self, line: str) -> Any:
        rows = parse_sweep_line(line)
        if not rows:
            return f"start-up sweep: {line.strip()}"
        table = Table()
        table.add_column("category")
        table.add_column("found", justify="right")
        table.add_column("acted", justify="right")
        for name, found, acted in rows:
            style = "bold green" if acted else ("yellow" if found else "dim")
            table.add_row(name.replace("_", " "), str(found), str(acted), style=style)
        return table

    # --- watching -----------------------------------------------------------------------

    def _watch(self, done: Callable[[int, tuple[int, int]], bool], what: str, *, allow_timeout: bool = False) -> bool:
        while True:
            states = self._states()
            jobs = self._jobs()
            self._queue()
            ended = sum(n for s, n in states.items() if DispatchState(s) in TERMINAL_STATES)
            self.progress.update(self.bar, completed=ended)
            self.live.update(self._view(states, jobs))
            if done(ended, jobs):
                return True
            if not self.worker.alive and self.phase != WORKER_DOWN:
                raise _Stop(f"the worker exited ({self.worker.returncode})")
            if time.monotonic() >= self.deadline:
                if allow_timeout:
                    return False
                raise _Stop(f"timed out waiting until {what}")
            interrupts.check()
            time.sleep(REFRESH_S)

    def _settled(self, ended: int, jobs: tuple[int, int]) -> bool:
        if ended < self.total or sum(jobs) != 0:
            return False
        return self._unnotified() == 0

    def _states(self) -> Counter[str]:
        with transaction(self.sessions) as session:
            rows = dispatches.get_dispatches(session, self.ids)
            return Counter(DispatchState(row.state).value for row in rows.values())

    def _unnotified(self) -> int:
        with transaction(self.sessions) as session:
            rows = dispatches.get_dispatches(session, self.ids)
            return sum(1 for row in rows.values() if row.notified_at is None)

    def _jobs(self) -> tuple[int, int]:
        """(running, finished) Jobs of ours in the cluster; notes the most of the limited
        tenancy's running at once (by its label)."""
        running = finished = limited = 0
        try:
            for page in self.kube.iter_jobs(
                NAMESPACE, label_selector=job_labels.selector(self.settings.effective_deployment)
            ):
                for job in page:
                    if job_state(job).terminal:
                        finished += 1
                    else:
                        running += 1
                        labels = (job.get("metadata") or {}).get("labels") or {}
                        limited += labels.get(job_labels.TENANCY_ID_KEY) == LIMITED_TENANCY
        except Transient:
            return (0, 0)
        self.max_running = max(self.max_running, limited)
        return running, finished

    def _queue(self) -> tuple[int, int]:
        """The limited tenancy's dispatches (holding a slot, queued) in the database; notes the most of each."""
        with transaction(self.sessions) as session:
            holding, queued = admission.by_tenancy(admission.summary(session)).get(LIMITED_TENANCY, (0, 0))
        self.max_holding = max(self.max_holding, holding)
        self.max_queued = max(self.max_queued, queued)
        return holding, queued

    def _waits(self) -> list[float]:
        """How long each of the limited tenancy's admitted dispatches waited in the queue (s)."""
        with transaction(self.sessions) as session:
            rows = session.execute(
                sa.select(Dispatch.created_at, Dispatch.admitted_at).where(
                    Dispatch.dispatch_id.in_(self.ids),
                    Dispatch.tenancy_id == LIMITED_TENANCY,
                    Dispatch.admitted_at.is_not(None),
                )
            ).all()
        return sorted(
            max(0.0, (_utc(admitted) - _utc(created)).total_seconds()) for created, admitted in rows if admitted
        )

    def _view(self, states: Mapping[str, int] | None = None, jobs: tuple[int, int] = (0, 0)) -> Group:
        states = states or {}
        table = Table(title=f"dispatches — {self.phase}", title_justify="left")
        for column in ("QUEUED", "SCHEDULED", "CREATED", "COMPLETED", "FAILED", "Jobs run", "Jobs done", "worker"):
            table.add_column(column, justify="right", no_wrap=True)
        worker = f"up {self.worker.pid}" if self.worker.alive else "[bold red]DOWN[/bold red]"
        table.add_row(
            *(str(states.get(s, 0)) for s in ("QUEUED", "SCHEDULED", "CREATED", "COMPLETED", "FAILED")),
            str(jobs[0]),
            str(jobs[1]),
            worker,
        )
        return Group(self.progress, table)

    # --- the end ------------------------------------------------------------------------

    def _outcomes(self) -> dict[str, Outcome]:
        with transaction(self.sessions) as session:
            terminal = dict(
                session.execute(
                    sa.select(CaseEvent.dispatch_id, sa.func.count())
                    .where(
                        CaseEvent.dispatch_id.in_(self.ids),
                        CaseEvent.type.in_(sorted(t.value for t in TERMINAL_EVENT_TYPES)),
                    )
                    .group_by(CaseEvent.dispatch_id)
                ).all()
            )
            rows = session.scalars(sa.select(Dispatch).where(Dispatch.dispatch_id.in_(self.ids))).all()
            return {
                row.dispatch_id: Outcome(
                    state=DispatchState(row.state).value,
                    output=row.output,
                    reason=row.reason,
                    terminal_events=int(terminal.get(row.dispatch_id, 0)),
                    notified=row.notified_at is not None,
                )
                for row in rows
            }

    def _finish(self, requests: list[DemoRequest], problems: list[str] | None = None) -> Summary:
        running, finished = self._jobs() if hasattr(self, "kube") else (0, 0)
        summary = summarise(
            requests[: len(self.ids)],
            self.ids,
            self._outcomes() if self.ids else {},
            jobs_left=running + finished,
            elapsed_s=time.monotonic() - self.started,
        )
        summary.max_running, summary.max_holding, summary.max_queued = (
            self.max_running, self.max_holding, self.max_queued,
        )  # fmt: skip
        if self.ids:
            summary.read_back = self._read_back(requests[: len(self.ids)])
        summary.problems.extend(problems or [])
        self.console.print(self._summary_table(summary))
        if self.ids:
            waits = self._waits()
            if waits:
                self.console.print(
                    f"tenancy {LIMITED_TENANCY} (maxRunning {LIMITED_MAX_RUNNING}): {len(waits)} dispatches admitted "
                    f"in turn, after waiting {waits[0]:.1f}s to {waits[-1]:.1f}s in the queue; at most "
                    f"{summary.max_running} of its Jobs ran at once (the cluster, sampled every {REFRESH_S:g}s), "
                    f"{summary.max_holding} held a slot and {summary.max_queued} waited at once (the database)",
                    markup=False, highlight=False, soft_wrap=True,
                )  # fmt: skip
        for r in summary.read_back:
            self.console.print(_read_back_line(r), markup=False, highlight=False, soft_wrap=True)
        for text in summary.wrong[:10]:
            self.console.print(f"[red]unexpected end:[/red] {text}")
        for text in summary.problems:
            self.console.print(f"[red]problem:[/red] {text}")
        extra = self._extra_facts()
        if extra:
            self.console.print(extra, markup=False, highlight=False, soft_wrap=True)
        if not summary.ok:
            self.console.print(f"[dim]--- the worker's log ({self.worker.log_path}) ---[/dim]")
            self.console.print(self.worker.log_tail(30), markup=False, highlight=False)
        verdict_style = "bold green" if summary.ok else "bold red"
        self.console.print(summary.line(), soft_wrap=True, markup=False, highlight=False, style=verdict_style)
        return summary

    def _summary_table(self, s: Summary) -> Table:
        table = Table(title="summary", title_justify="left")
        table.add_column("check")
        table.add_column("value", justify="right")
        table.add_column("")

        def mark(good: bool) -> str:
            return "[green]✓[/green]" if good else "[red]✗[/red]"

        table.add_row("dispatched", str(s.dispatched), "")
        table.add_row("completed", str(s.completed), mark(s.right_outputs == s.completed))
        table.add_row(
            "  with the right output", f"{s.right_outputs}/{s.completed}", mark(s.right_outputs == s.completed)
        )
        table.add_row(
            "failed (bad input, as intended)",
            f"{s.failed} ({s.failed_as_intended})",
            mark(s.failed == s.failed_as_intended),
        )
        table.add_row("lost", str(s.lost), mark(s.lost == 0))
        table.add_row("duplicates (second terminal events)", str(s.duplicates), mark(s.duplicates == 0))
        table.add_row("engine not told", str(s.unnotified), mark(s.unnotified == 0))
        table.add_row("Jobs left in the cluster", str(s.jobs_left), mark(s.jobs_left == 0))
        table.add_row(
            f"{LIMITED_TENANCY}: most Jobs running at once / limit",
            f"{max(s.max_running, s.max_holding)}/{s.limit}",
            mark(max(s.max_running, s.max_holding) <= s.limit),
        )
        table.add_row(f"{LIMITED_TENANCY}: most dispatches queued at once", str(s.max_queued), "")
        for r in s.read_back:
            value = f"{r.read_size / (1 << 20):.1f} MiB" if r.error is None else r.error[:40]
            table.add_row(f"{r.capability}: object store result read back, SHA-256 as expected", value, mark(r.ok))
        if s.stored > len(s.read_back):
            table.add_row("object store results not read back", str(s.stored - len(s.read_back)), mark(False))
        table.add_row("wall time", f"{s.elapsed_s:.1f}s", "")
        return table

    def _read_back(self, requests: list[DemoRequest]) -> list[ReadBack]:
        """The stored results of the dispatches that completed, as an engine reads them: the
        reference through `api.stored_result`, the bytes streamed by `api.read_result`."""
        found = []
        for request, dispatch_id in zip(requests, self.ids, strict=True):
            if not request.stored:
                continue
            expected = ReadBack(request.capability, dispatch_id, request.expected["size"], request.expected["sha256"])
            started = time.monotonic()
            digest, size = hashlib.sha256(), 0
            try:
                with transaction(self.sessions) as session:
                    reference = api.stored_result(session, dispatch_id)
                    if reference is None:
                        continue  # not completed: already counted as a wrong end
                    chunks = api.read_result(session, dispatch_id, settings=self.settings)
                for chunk in chunks:
                    digest.update(chunk)
                    size += len(chunk)
            except api.DispatchError as e:
                found.append(replace(expected, error=f"{type(e).__name__}: {e}"))
                continue
            found.append(
                replace(
                    expected,
                    recorded_size=reference.size,
                    recorded_sha256=reference.sha256,
                    read_size=size,
                    read_sha256=digest.hexdigest(),
                    seconds=time.monotonic() - started,
                )
            )
        return found

    def _extra_facts(self) -> str:
        """Cluster-wide counters from Redis and the restarted worker's Prometheus metrics."""
        facts = []
        client = redis.Redis.from_url(self.broker.url, socket_timeout=2)
        try:
            prevented = client.get(f"{self.settings.key_prefix}:stats:duplicates_prevented")
            sweeps = client.get(f"{self.settings.key_prefix}:stats:sweeps_run")
            facts.append(
                f"second deliveries stopped by the guard: {int(prevented or 0)}; recovery sweeps run: {int(sweeps or 0)}"
            )
        except redis.RedisError:
            pass
        finally:
            client.close()
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=2) as response:
                text = response.read().decode()
            changes = re.findall(r'k8s_dispatch_dispatch_state_changes_total\{state="(\w+)"\} ([0-9.e+]+)', text)
            if changes:
                facts.append(
                    "the restarted worker's metrics: "
                    + ", ".join(f"{state.lower()} {float(value):.0f}" for state, value in changes)
                )
        except OSError:
            pass
        log_lines = self.worker.log_path.read_text(errors="replace").splitlines()
        sample = next((line for line in log_lines if "state-change state=COMPLETED" in line), None)
        if sample is not None:
            facts.append("one line per state change in the worker's log, e.g.:\n  " + sample.split("] ", 1)[-1])
        return "\n".join(facts)

    def _failed_run(self, problem: str, *, requests: list[DemoRequest] | None = None) -> Summary:
        self.console.print(f"[bold red]{problem}[/bold red]")
        if requests is not None and hasattr(self, "sessions"):
            return self._finish(requests, [problem])
        for process in (self.worker, self.beat):
            self.console.print(f"[dim]--- {process.name} ({process.log_path}) ---[/dim]")
            self.console.print(process.log_tail(30), markup=False, highlight=False)
        summary = Summary(problems=[problem], elapsed_s=time.monotonic() - self.started)
        self.console.print(summary.line(), soft_wrap=True, markup=False, highlight=False, style="bold red")
        return summary

    # --- clean-up -----------------------------------------------------------------------

    def _stop_processes(self) -> None:
        """SIGTERM (Celery's warm shutdown) to beat and worker at once, then wait for each."""
        for process in (self.beat, self.worker):
            process.kill(signal.SIGTERM)
        for process in (self.beat, self.worker):
            process.stop(10.0)

    def _forget_keys(self, url: str, prefix: str) -> None:
        client = redis.Redis.from_url(url, socket_timeout=2)
        try:
            keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
            for start in range(0, len(keys), 500):
                client.delete(*keys[start : start + 500])
        except redis.RedisError:
            pass
        finally:
            client.close()

    def _remove_tmp(self, tmp: Path) -> None:
        if self.keep:
            self.console.print(f"kept: {tmp}")
            return
        shutil.rmtree(tmp, ignore_errors=True)


class _Stop(Exception):
    """The run cannot go on (a process died, a wait timed out): summarise and stop."""


def _read_back_line(r: ReadBack) -> str:
    if r.error is not None:
        return f"{r.capability} {r.dispatch_id}: its stored result could not be read back: {r.error}"
    same = "the same bytes as" if r.ok else "NOT the bytes of"
    return (
        f"{r.capability} {r.dispatch_id}: its terminal event recorded a reference to {r.recorded_size:,} bytes, "
        f"SHA-256 {r.recorded_sha256}; k8s_dispatch.api.read_result streamed {r.read_size:,} bytes with "
        f"SHA-256 {r.read_sha256} in {r.seconds:.2f}s: {same} the CSV the demo computed itself"
    )


def _utc(moment: datetime) -> datetime:
    """A naive UTC datetime (SQLite gives back naive ones, PostgreSQL aware ones)."""
    return moment.astimezone(UTC).replace(tzinfo=None) if moment.tzinfo is not None else moment


def _redacted(url: str) -> str:
    return make_url(url).render_as_string(hide_password=True)
