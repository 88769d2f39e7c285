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
- Baseline (`lab/bench/baseline_app.py`, its own worker on the same Redis): one task per Job creates
  it; a task GETs the Job every COUNTDOWN_S (`countdown`) until it has ended, then deletes it.

Requests are what the server itself counted (`apiserver_request_total` on its /metrics, the
difference of two scrapes around a window; a scrape is no resource request, and the bench's
own watch is counted by the server only when it ends, after the window): EVERY request in the
window, divided by the Jobs that finished in it. The bench sees Jobs finish through one raw
watch on their namespace (`?watch=true`): the instant an event first shows the Complete
condition. Figure 3 is, for our system, the time from that instant to the terminal event's
`created_at` in the database (both clocks this machine's; completionTime has whole seconds only).

The same steady state of ours runs on the real control plane too (`--cluster real|both`:
etcd, kube-apiserver, the real Job controller and garbage collector, our node agent in simulate
mode, on the same cores). Its `apiserver_request_total` cannot say who sent a request, so the
server's audit log (Metadata level: user and user agent of every answered request) splits the
window's requests between ours (the worker and beat: the admin user, but for the bench's own
user agent), the node agent (`system:node:*`) and each controller (`system:serviceaccount:kube-system:*`).
The baseline runs on localcluster only. With "kubelet" among the clusters, the same steady state
runs on the real control plane with the node agent and with a real node (`api_load_kubelet`).

What the server counted is `api_counts`, the steady state and its window `api_steady`.
"""

from __future__ import annotations

import contextlib
import math
import re
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import sqlalchemy as sa
import yaml
from celery import Celery
from sqlalchemy.orm import Session, sessionmaker

from k8s_dispatch.lab.bench import baseline_app, rawhttp, services, workload

# api_load before its split: what poll_cost, admission and the tests read here, re-exported
from k8s_dispatch.lab.bench.api_counts import (
    BENCH as BENCH,
)
from k8s_dispatch.lab.bench.api_counts import (
    CONTROLLERS as CONTROLLERS,
)
from k8s_dispatch.lab.bench.api_counts import (
    CREATED as CREATED,
)
from k8s_dispatch.lab.bench.api_counts import (
    NODE as NODE,
)
from k8s_dispatch.lab.bench.api_counts import (
    OTHER as OTHER,
)
from k8s_dispatch.lab.bench.api_counts import (
    OURS as OURS,
)
from k8s_dispatch.lab.bench.api_counts import (
    Key as Key,
)
from k8s_dispatch.lab.bench.api_counts import (
    _by_verb as _by_verb,
)
from k8s_dispatch.lab.bench.api_counts import (
    actor as actor,
)
from k8s_dispatch.lab.bench.api_counts import (
    actor_group as actor_group,
)
from k8s_dispatch.lab.bench.api_counts import (
    audited as audited,
)
from k8s_dispatch.lab.bench.api_counts import (
    breakdown as breakdown,
)
from k8s_dispatch.lab.bench.api_counts import (
    per_finished_job as per_finished_job,
)
from k8s_dispatch.lab.bench.api_counts import (
    pods_behind as pods_behind,
)
from k8s_dispatch.lab.bench.api_counts import (
    scrape as scrape,
)
from k8s_dispatch.lab.bench.api_steady import (
    GOLDEN as GOLDEN,
)
from k8s_dispatch.lab.bench.api_steady import (
    PAGE_SIZE as PAGE_SIZE,
)
from k8s_dispatch.lab.bench.api_steady import (
    POLL_INTERVAL_S as POLL_INTERVAL_S,
)
from k8s_dispatch.lab.bench.api_steady import (
    STEPS as STEPS,
)
from k8s_dispatch.lab.bench.api_steady import (
    Window as Window,
)
from k8s_dispatch.lab.bench.api_steady import (
    _listed_bytes_per_job as _listed_bytes_per_job,
)
from k8s_dispatch.lab.bench.api_steady import (
    _percentile as _percentile,
)
from k8s_dispatch.lab.bench.api_steady import (
    _pods_behind as _pods_behind,
)
from k8s_dispatch.lab.bench.api_steady import (
    deployment,
)
from k8s_dispatch.lab.bench.api_steady import (
    initial_steps as initial_steps,
)
from k8s_dispatch.lab.bench.api_steady import (
    measure as measure,
)
from k8s_dispatch.lab.bench.api_steady import (
    steady as steady,
)
from k8s_dispatch.lab.bench.results import BenchResult, Figure, Ratio, Target
from k8s_dispatch.lab.bench.sizes import Size
from k8s_dispatch.ops.processes import (
    ManagedProcess,
    WaitTimeout,
    free_port,
    project_env,
    wait_for_log,
    wait_until,
)
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import TERMINAL_EVENT_TYPES, CaseEvent, Dispatch
from k8s_dispatch.tasks.scheduling import schedule_in_session
from k8s_dispatch.workers.manifest import job_name
from k8s_dispatch.workers.resolver import CapabilityResolver


class Probe(Protocol):
    """What watches a steady state of ours from beside it (api_load_kubelet's Pod starts)."""

    namespaces: frozenset[str]  # its own Jobs' namespaces: left out of the split by sender

    def open(self, cluster: services.Cluster) -> AbstractContextManager[None]: ...

    def scheduled(self, job_names: Sequence[str], at: float) -> None: ...


COUNTDOWN_S = 5.0  # the baseline's re-check interval
CONCURRENCY = 8  # worker threads, ours and the baseline's alike
TARGET_JOBS = 1000  # the targets are stated at 1,000 concurrent Jobs
# Issue 8 set 3; issue 13 put our finalizer on every Pod, whose release is a patch per Pod: 3.5.
REQUESTS_PER_JOB = Target(3.5, at_least=False, inclusive=True)
LATENCY_P99 = Target(POLL_INTERVAL_S + 1, at_least=False, inclusive=True)
OURS_NAMESPACE = "bench-load"
BASELINE_NAMESPACE = "bench-load-baseline"
PRE_CREATE_CLIENTS = 4  # threads creating the first N Jobs straight into the cluster


@dataclass(frozen=True)
class Knobs:
    jobs: tuple[int, ...]  # the N concurrent Jobs, one steady state each
    job_s: float  # how long each Job runs
    window_s: float  # how long requests and completions are counted
    real_jobs: tuple[int, ...] = ()  # the N concurrent Jobs of ours on the real control plane
    kubelet_jobs: tuple[int, ...] = ()  # ... with the node agent and with the kubelet (api_load_kubelet)


KNOBS = {
    "smoke": Knobs(jobs=(10,), job_s=4.0, window_s=4.0, real_jobs=(10,), kubelet_jobs=(10,)),
    # where the targets are: ~150 finish. The real control plane (its start, and Pods for the first
    # N Jobs) adds about 35 s at 300 and 2 minutes at 1,000: 1,000 at full size only. A real node
    # on 2 cores starts 100 Pods at once in about a minute; 300 of them stall it (load above 200).
    "quick": Knobs(jobs=(TARGET_JOBS,), job_s=60.0, window_s=9.0, real_jobs=(300,), kubelet_jobs=(100,)),
    "full": Knobs(jobs=(100, 1000, 5000), job_s=60.0, window_s=60.0, real_jobs=(300, TARGET_JOBS), kubelet_jobs=(300,)),
}
# The controller manager's client budget (--kube-api-qps; Kubernetes' default, 20, cannot create
# and track ~17 Pods/s: each takes about 9 of the Job controller's requests).
REAL_KUBE_API_QPS = 400


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
            "clusters": list(ctx.clusters),
            "real_concurrent_jobs": list(knobs.real_jobs) if services.REAL in ctx.clusters else [],
            "real_kube_api_qps": REAL_KUBE_API_QPS,
        },
    )
    caps_file = ctx.work_dir / "api-load-capabilities.yaml"
    caps_file.write_text(yaml.safe_dump(capability_config(knobs.job_s)))
    caps = CapabilityResolver.from_mapping(capability_config(knobs.job_s), source=str(caps_file))
    local: dict[int, Window] = {}
    for i, n in enumerate(knobs.jobs if services.LOCAL in ctx.clusters else ()):
        variants = {
            "ours": partial(_ours, ctx, knobs, n, caps, caps_file),
            "baseline": partial(_baseline, ctx, knobs, n),
        }
        order = list(variants) if i % 2 == 0 else list(reversed(variants))
        windows = {name: variants[name]() for name in order}
        _report(result, n, windows["ours"], windows["baseline"], knobs)
        local[n] = windows["ours"]
    for n in knobs.real_jobs if services.REAL in ctx.clusters else ():
        _report_real(result, n, _ours(ctx, knobs, n, caps, caps_file, kind=services.REAL), knobs, local=local.get(n))
    from k8s_dispatch.lab.bench import api_load_kubelet  # it builds on this module

    for n in knobs.kubelet_jobs if api_load_kubelet.KUBELET in ctx.clusters else ():
        api_load_kubelet.report(result, n, api_load_kubelet.run_nodes(ctx, knobs, n), knobs)
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


# --- ours ----------------------------------------------------------------------------------


def _ours(
    ctx: services.BenchContext,
    knobs: Knobs,
    n: int,
    caps: CapabilityResolver,
    caps_file: Path,
    *,
    kind: str = services.LOCAL,
    extra_env: dict[str, str] | None = None,
    before_window: Callable[[services.Cluster, Any], None] | None = None,
    cluster_cm: Callable[[], AbstractContextManager[services.Cluster]] | None = None,
    probe: Probe | None = None,
) -> Window:
    """Ours in a steady state of `n` Jobs on a new API server of `kind` (services.LOCAL or REAL);
    `extra_env` (settings' names) changes the deployment's settings, `before_window(cluster,
    settings)` waits for what must have happened before the window opens. `cluster_cm` starts
    another server than `kind`'s (the kubelet node's); `probe` is opened on it before the steady
    state, told of every Job scheduled, and its namespaces left out of the split by sender."""
    name = f"{'lc' if kind == services.LOCAL else 'rc'}-load-{n}"
    with (
        services.database(ctx.pg_admin_url) as database_url,
        (
            cluster_cm or partial(services.cluster, ctx.work_dir, name=name, kind=kind, kube_api_qps=REAL_KUBE_API_QPS)
        )() as cluster,  # fmt: skip
        ExitStack() as probing,
    ):
        cluster.ensure_namespace(OURS_NAMESPACE)
        if probe is not None:
            probing.enter_context(probe.open(cluster))
        pids = cluster.pids()
        metrics_port = free_port()
        dep = probing.enter_context(
            deployment(
                {
                    "database_url": database_url,
                    "redis_url": ctx.redis_url,
                    # one of its own: a run after another on a new server never resumes its watch
                    "key_prefix": f"{ctx.key_prefix}-load-{kind}-{n}-{uuid.uuid4().hex[:6]}",
                    "namespace": OURS_NAMESPACE,
                    "kubeconfig": str(cluster.kubeconfig),
                    "capabilities": str(caps_file),
                    "poll_interval_s": str(POLL_INTERVAL_S),
                    "poll_page_size": str(PAGE_SIZE),
                    "worker_concurrency": str(CONCURRENCY),
                    "metrics_port": str(metrics_port),
                    **(extra_env or {}),
                }
            )
        )
        env, settings, sessions, producer = dep.env, dep.settings, dep.sessions, dep.producer
        case_id = workload.new_case(sessions)

        def start_jobs(steps: Sequence[int]) -> None:
            at, dispatch_ids = time.time(), []
            with transaction(sessions) as session:
                for k in steps:
                    scheduled = schedule_in_session(
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
                    dispatch_ids.append(scheduled.dispatch_id)
            if probe is not None:  # from the engine's call (its commit a few ms later)
                probe.scheduled([job_name(d) for d in dispatch_ids], at)

        def pre_create(steps: Sequence[int], ready: Callable[[], dict[str, int | None]]) -> None:
            """The rows and then the Jobs, once the worker and beat are ready: none finishes before
            the system can replace it, and the sweep's grace period (from the rows' writing) covers
            the creates even on the real server, a few times slower at them."""
            pids.update(ready())
            made = workload.created_dispatches(
                sessions, caps, count=len(steps), namespace=OURS_NAMESPACE, deployment=settings.effective_deployment,
                capability_of=lambda i: capability(steps[i]),
            )  # fmt: skip
            # exist_ok: on a starved machine the worker's sweep may create a row's Job first (its
            # grace period over before the bench's creates are), from the same row, under the same name
            rawhttp.create_jobs(cluster, OURS_NAMESPACE, [body for _, body in made], clients=PRE_CREATE_CLIENTS,
                                exist_ok=True)  # fmt: skip

        def details() -> str:
            return "\n".join(_log_tail(ctx.work_dir / f"{name}.log") for name in ("bench-worker", "bench-beat"))

        with services.worker_and_beat(ctx.work_dir, env, concurrency=CONCURRENCY) as ready:
            with steady(cluster, OURS_NAMESPACE, n, pre_create=partial(pre_create, ready=ready),
                        start_jobs=start_jobs, details=details) as watch:  # fmt: skip
                behind = _pods_behind(cluster, slack=max(2, round(2 * n / knobs.job_s))) if kind == services.REAL else 0
                if before_window is not None:
                    before_window(cluster, settings)
                window = measure(cluster, watch, knobs.window_s, pids=pids,
                                 worker_metrics=f"http://127.0.0.1:{metrics_port}/metrics",
                                 leave_out=probe.namespaces if probe is not None else frozenset())  # fmt: skip
                window.pods_behind = behind
                window.job_bytes = _listed_bytes_per_job(cluster, OURS_NAMESPACE)
            # The window's Jobs get their terminal events a poll or so later.
            window.latencies_s, window.unrecorded = _latencies(sessions, window.finished)
        window.tasks = task_times((ctx.work_dir / "bench-worker.log").read_text(errors="replace"), within=window.span)
    return window


TASK_DONE = re.compile(r"Task ([\w.-]+)\[[^\]]*\] succeeded in ([\d.]+)s")
LOGGED_AT = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})")  # Celery's "[%(asctime)s: ..."


def task_times(log: str, *, within: tuple[float, float] | None = None) -> str:
    """ "poll 20x p50 0.12s p99 0.30s, ..." for the tasks of the worker's latest start, from its
    log; with `within` (time.time() values), only those that ended in it, by the line's time
    (Celery writes this machine's local time): the setup's tasks are no steady state's."""
    latest = log[log.rfind("--- start #") :]
    seconds: dict[str, list[float]] = {}
    for line in latest.splitlines():
        done = TASK_DONE.search(line)
        if done is None or (within is not None and not within[0] <= _logged_at(line) <= within[1]):
            continue
        seconds.setdefault(done[1].rsplit(".", 1)[-1], []).append(float(done[2]))
    return ", ".join(
        f"{name} {len(v)}x p50 {_percentile(v, 0.5):.2f}s p99 {_percentile(v, 0.99):.2f}s"
        for name, v in sorted(seconds.items())
    )


def _logged_at(line: str) -> float:
    """The time a Celery log line was written (time.time()); NaN, outside every span, if it has none."""
    at = LOGGED_AT.match(line)
    if at is None:
        return math.nan
    return datetime.strptime(at[1], "%Y-%m-%d %H:%M:%S").timestamp() + int(at[2]) / 1000


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
            rows = session.execute(query).all()
            events.update({name: at.timestamp() for name, at in rows if name is not None})  # all: `in_(names)`
        return len(events) == len(names)

    with contextlib.suppress(WaitTimeout):  # what was not recorded in time is counted below
        wait_until(recorded, timeout=max(60.0, len(names) * POLL_INTERVAL_S / 100), interval=0.5,
                   what=f"terminal events of {len(names)} Jobs")  # fmt: skip
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
            bodies = [baseline_app.job_body(name, _ms(knobs, k)) for name, k in zip(names, steps, strict=True)]
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
                window = measure(cluster, watch, knobs.window_s, pids={**cluster.pids(), "worker": worker.pid})
        finally:
            worker.stop()
            producer.close()
    return window


def _baseline_name() -> str:
    return f"base-{uuid.uuid4().hex[:16]}"


def _ms(knobs: Knobs, k: int) -> int:
    return round(1000 * knobs.job_s * k / STEPS)


def baseline_worker(work_dir: Path, env: dict[str, str], *, name: str) -> ManagedProcess:
    """`celery -A k8s_dispatch.lab.bench.baseline_app worker` on the baseline's own queue."""
    argv = [
        sys.executable, "-m", "celery", "-A", "k8s_dispatch.lab.bench.baseline_app", "worker", "--loglevel=INFO",
        f"--hostname={name}@%h", f"--concurrency={CONCURRENCY}", "-Q", baseline_app.QUEUE,
        "--without-mingle", "--without-gossip",
    ]  # fmt: skip
    return ManagedProcess(name, argv, project_env(env), work_dir / f"{name}.log")


# --- the figures ---------------------------------------------------------------------------


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
        Figure(f"finding_requests_per_s_ours_{n}", f"requests/s finding finished Jobs, ours (a WATCH slice a "
               f"poll, or LIST pages of {PAGE_SIZE} where the watch must start again), {n:,} Jobs", "requests/s",
               [(ours.requests[("LIST", "jobs", "", 200)] + ours.requests[("WATCH", "jobs", "", 200)]) / ours.seconds],
               ref="8.2"),
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
            "requests_by_verb": _by_verb(window.requests),
            "cpu_percent_of_a_core": _cpu_percent(window),
            **({"listed_bytes_per_job": window.job_bytes} if window.job_bytes else {}),
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


def _cpu_percent(window: Window) -> dict[str, float]:
    return {
        name: round(100 * cpu / window.seconds, 1) for name, cpu in sorted(window.cpu_s.items(), key=lambda kv: -kv[1])
    }


def _report_real(result: BenchResult, n: int, real: Window, knobs: Knobs, *, local: Window | None) -> None:
    """Ours on the real control plane: every request its server counted per Job, and the share
    of each sender (the audit log's), beside localcluster's figures of the same run."""
    finished = len(real.finished)
    senders = {group: real.sent_by(group) for group in (OURS, NODE, CONTROLLERS, OTHER)}
    result.figures += [
        Figure(f"requests_per_job_real_{n}", f"requests per finished Job, real control plane, every sender, {n:,} Jobs",
               "requests", [real.per_job], ref="14"),
        Figure(f"requests_per_job_ours_real_{n}", f"requests per finished Job, real control plane, ours alone "
               f"(worker + beat), {n:,} Jobs", "requests", [per_finished_job(senders[OURS], finished)], ref="14"),
        Figure(f"requests_per_job_controllers_real_{n}", f"requests per finished Job, real control plane, "
               f"kube-controller-manager, {n:,} Jobs", "requests", [per_finished_job(senders[CONTROLLERS], finished)], ref="14"),
        Figure(f"requests_per_job_node_real_{n}", f"requests per finished Job, real control plane, the node agent, "
               f"{n:,} Jobs", "requests", [per_finished_job(senders[NODE], finished)], ref="14"),
        Figure(f"requests_per_s_real_{n}", f"requests/s at the real kube-apiserver, {n:,} Jobs", "requests/s",
               [real.per_s], ref="14"),
    ]  # fmt: skip
    if real.latencies_s:
        result.figures += [
            Figure(f"completion_latency_p50_s_real_{n}", f"Job finished -> terminal event, real control plane, p50, "
                   f"{n:,} Jobs", "s", [_percentile(real.latencies_s, 0.5)], ref="14"),
            Figure(f"completion_latency_p99_s_real_{n}", f"Job finished -> terminal event, real control plane, p99, "
                   f"{n:,} Jobs", "s", [_percentile(real.latencies_s, 0.99)], ref="14"),
        ]  # fmt: skip
    if local is not None:
        result.ratios += [
            Ratio(f"real_vs_local_requests_per_job_{n}", f"requests per finished Job, real control plane (every sender) / "
                  f"localcluster, {n:,} Jobs", [real.per_job / max(local.per_job, 1e-9)], ref="14"),
            Ratio(f"real_vs_local_ours_requests_per_job_{n}", f"requests per finished Job of ours alone, real control "
                  f"plane / localcluster, {n:,} Jobs", [per_finished_job(senders[OURS], finished) / max(local.per_job, 1e-9)],
                  ref="14"),
        ]  # fmt: skip
    expected = knobs.window_s * n / knobs.job_s
    audited_total = sum(sum(c.values()) for c in real.by_actor.values()) - sum(real.sent_by(BENCH).values())
    result.params[f"real_{n}"] = {
        "window_s": round(real.seconds, 2),
        "requests": real.total,
        "requests_audited": audited_total,
        "jobs_finished": finished,
        "jobs_finished_expected": round(expected),
        "jobs_in_flight_at_start_and_end": list(real.in_flight),
        "watch_lag_p99_s": round(real.watch_lag_p99_s, 3),
        "requests_by_verb": _by_verb(real.requests),
        "requests_by_sender": {who: _by_verb(c) for who, c in sorted(real.by_actor.items()) if who != BENCH},
        "cpu_percent_of_a_core": _cpu_percent(real),
        "unrecorded": real.unrecorded,
        "jobs_without_a_bound_pod_at_start": real.pods_behind,
        "server_ms_per_request": real.server_ms,
        "listed_bytes_per_job": real.job_bytes,
    }
    sustained = min(real.in_flight) >= 0.95 * n and finished >= 0.8 * expected and real.pods_behind <= 0.05 * n
    per_sender = "; ".join(
        f"{who} {per_finished_job(c, finished):.2f}/Job: {breakdown(c, seconds=real.seconds)}"
        for who, c in sorted(real.by_actor.items(), key=lambda kv: -sum(kv[1].values())) if who != BENCH
    )  # fmt: skip
    result.notes.append(
        f"real control plane, {n:,} Jobs: {real.total} requests counted by kube-apiserver ({audited_total} in its audit "
        f"log), {finished} Jobs finished in {real.seconds:.1f}s (~{expected:.0f} expected; {real.in_flight[0]}/"
        f"{real.in_flight[1]} in flight at start/end, {real.pods_behind} without a bound Pod at the start"
        f"{'' if sustained else ': N not sustained'}); by sender: {per_sender}; "
        f"CPU % of one core in the window: {', '.join(f'{k} {v:g}' for k, v in _cpu_percent(real).items())}; "
        f"the server's mean ms per request: {', '.join(f'{k} {v:g}' for k, v in list(real.server_ms.items())[:6])}"
        + (f"; worker tasks over the whole run: {real.tasks}" if real.tasks else "")
    )
    if real.unrecorded:
        result.notes.append(
            f"real control plane, {n:,} Jobs: {real.unrecorded} of {finished} finished Jobs had no terminal event by the "
            "deadline; their latency counts as the time waited (a lower bound)"
        )
