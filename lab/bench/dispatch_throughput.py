"""Figure 1, dispatch throughput: Jobs/s through the whole create path against the official
client creating the same Jobs straight, with the same concurrency, on the same localcluster.

Ours (targeted): ENGINE_THREADS engine threads schedule dispatches as an engine fans out work:
transactions of FANOUT dispatches each (`schedule_many_in_session`: one multi-row INSERT of
the rows and one of their events, then, after commit, `create_jobs` messages of up to
CREATE_BATCH dispatch ids); one `celery -A tasks worker` of `threads` threads takes a message,
reads its rows with one query, creates their Jobs one after the other and marks them created
in one transaction. The clock runs from the first schedule call to the last row's
`job_created_at` (set by the worker once the API answered 201); at the end every Job is
checked to exist in the cluster.

Ours, one per transaction (issue 16's figure 4): the same with every dispatch in a transaction
of its own (`schedule_in_session`): what an engine that schedules one step at a time pays. Its
commits' ids share messages only as far as `tasks/outbox.py` gathers them across threads. Its
targets: >= 0.5x the raw client beside it, and <= 1.5 ms of the engine process's CPU
(`time.process_time`, every thread of it: the schedules, the outbox's sends) per dispatch.

Raw: `kubernetes.client.BatchV1Api.create_namespaced_job(namespace, body)` from `threads`
threads sharing one ApiClient, with the client's defaults (the answer is deserialised into a
V1Job), for Jobs built the same way (`workers.manifest.build_job`).

Rounds are interleaved and the ratio is taken round by round: ours with raw, then the
one-per-transaction variant with raw rounds of its own. Their number and size are this module's
(`KNOBS`): rounds long enough that ours' fixed cost per round does not decide the ratio, and
enough of them that a burst of the shared machine's load moves few, so that the median of the
ratios holds from one run to the next. Each round also records the CPU
time each process spent per Job (Linux /proc): the worker's, the bench's (the engine's
threads, or the raw client's) and the API server's, which is what explains the ratio on a
machine whose cores are all busy.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC
from typing import Any, cast

import sqlalchemy as sa
from celery import Celery
from kubernetes import client as k8s
from sqlalchemy.orm import Session, sessionmaker

from k8s_dispatch import celeryconfig
from k8s_dispatch.core.settings import load_settings
from k8s_dispatch.lab import kubeclient
from k8s_dispatch.lab.bench import services, workload
from k8s_dispatch.lab.bench.results import BenchResult, Figure, Ratio, Target
from k8s_dispatch.lab.bench.sizes import Size
from k8s_dispatch.lab.bench.timing import interleaved, paired_ratios, rates
from k8s_dispatch.ops.processes import wait_until
from k8s_dispatch.store import scheduling
from k8s_dispatch.store.db import make_engine, make_sessionmaker, transaction
from k8s_dispatch.store.models import Dispatch, DispatchState
from k8s_dispatch.tasks.scheduling import CREATE_BATCH, schedule_in_session, schedule_many_in_session
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.kube import KubeClient
from k8s_dispatch.workers.resolver import CapabilityResolver

TARGET = Target(0.8, at_least=True)  # ours / raw, issue 8 figure 1
# Issue 16's figure 4: one dispatch per transaction / raw, and the engine's CPU per dispatch.
SINGLE_TARGET = Target(0.5, at_least=True)
SINGLE_ENGINE_CPU_TARGET = Target(1.5, at_least=False, inclusive=True)
OURS_NAMESPACE = "bench-dispatch"
RAW_NAMESPACE = "bench-dispatch-raw"
ENGINE_THREADS = 8  # the engine's threads scheduling
FANOUT = 50  # dispatches per engine transaction (schedule_many_in_session)
WARMUP_JOBS = 20  # per variant, untimed: connections opened, code paths warm


@dataclass(frozen=True)
class Knobs:
    jobs: int  # Jobs per variant per round
    rounds: int  # interleaved rounds of ours and raw (the targeted pair)
    single_rounds: int  # interleaved rounds of one per transaction and raw


# By size. Ours pays a fixed cost per round (the first message's trip, the last batch's marks)
# that the raw client does not: rounds of 200 Jobs (half a second) read about 0.7x where the
# issue's 2,000 read about 1x, and rounds of 1,000 still flipped across the target from one run
# to the next. So a quick round is the 2,000 Jobs too, in fewer rounds than full's; a
# burst of the shared machine's load lands on one or two of them, and the median is the others'.
KNOBS = {
    "smoke": Knobs(jobs=20, rounds=2, single_rounds=2),
    "quick": Knobs(jobs=2000, rounds=5, single_rounds=3),
    "full": Knobs(jobs=2000, rounds=9, single_rounds=5),
}


def run(ctx: services.BenchContext, size: Size) -> BenchResult:
    knobs = KNOBS[size.name]
    n, threads = knobs.jobs, size.dispatch_threads
    result = BenchResult(
        name="dispatch",
        title=f"dispatch throughput: {n:,} Jobs per round, ours vs the official client",
        rounds=knobs.rounds,
        params={
            "jobs_per_round": n,
            "rounds_single": knobs.single_rounds,
            "threads": threads,
            "engine_threads": ENGINE_THREADS,
            "engine_entry": "schedule_many_in_session",
            "fanout": FANOUT,
            "create_batch": CREATE_BATCH,
            "warmup_jobs": WARMUP_JOBS,
        },
    )
    caps_file = workload.write_capabilities(ctx.work_dir / "dispatch-capabilities.yaml")
    with (
        services.database(ctx.pg_admin_url) as database_url,
        services.cluster(ctx.work_dir, name="lc-dispatch") as cluster,
    ):
        env = services.deployment_env(
            {
                "database_url": database_url,
                "redis_url": ctx.redis_url,
                "key_prefix": f"{ctx.key_prefix}-dispatch",
                "namespace": OURS_NAMESPACE,
                "kubeconfig": str(cluster.kubeconfig),
                "capabilities": str(caps_file),
                "worker_concurrency": str(threads),
                "sweep_interval_s": "3600",  # the start-up sweep only: this measures the normal path
                # The raw client beside it has no rate limit: neither has ours here (a full round's
                # 2,000 creates would otherwise wait for the default budget, 300/s after 600).
                "kube_qps": "0",
            }
        )
        settings = load_settings(env)
        engine = make_engine(database_url, pool_size=ENGINE_THREADS + 2)
        producer = Celery("bench-engine", set_as_current=False)
        producer.conf.update(celeryconfig.config(settings))
        api_client = kubeclient.api_client(cluster.kubeconfig)
        try:
            with (
                services.worker(ctx.work_dir, env, concurrency=threads) as worker,
                KubeClient(cluster.kubeconfig) as kube,
            ):
                cpu = _CpuMeter({"worker": worker.pid, **cluster.pids()})  # and the server: localcluster here
                ours = _Ours(make_sessionmaker(engine), workload.resolver(), producer, settings.max_input_bytes, cpu)
                raw = _Raw(k8s.BatchV1Api(api_client), workload.resolver(), cpu, threads=threads)
                ours.round(WARMUP_JOBS, fanout=FANOUT)
                ours.round(WARMUP_JOBS, fanout=1)
                raw.round(WARMUP_JOBS)
                ours.schedule_seconds.clear()
                cpu.ms_per_job.clear()
                # The targeted pair side by side; then the slow untargeted variant, against raw
                # rounds of its own: its aftermath (PostgreSQL vacuuming 2,000 one-row
                # transactions, the server finishing their Jobs) lands on what runs next.
                seconds = interleaved(
                    {"ours": lambda: ours.round(n, fanout=FANOUT), "raw": lambda: raw.round(n)},
                    rounds=knobs.rounds,
                )
                single = interleaved(
                    {"single": lambda: ours.round(n, fanout=1), "raw": lambda: raw.round(n)},
                    rounds=knobs.single_rounds,
                )
                _check_jobs(kube, OURS_NAMESPACE, ours.created)
                _check_jobs(kube, RAW_NAMESPACE, raw.created)
        finally:
            kubeclient.close(api_client)
            producer.close()
            engine.dispose()

    ours_rate, raw_rate = rates(n, seconds["ours"]), rates(n, seconds["raw"])
    single_rate, raw_beside_single = rates(n, single["single"]), rates(n, single["raw"])
    result.figures += [
        Figure(
            "dispatch_jobs_per_s_ours",
            f"ours: {FANOUT} schedules per transaction -> worker ({threads} threads) -> Job",
            "jobs/s",
            ours_rate,
        ),
        Figure(
            "dispatch_jobs_per_s_ours_single",
            f"ours, one schedule per transaction -> worker ({threads} threads) -> Job",
            "jobs/s",
            single_rate,
        ),
        Figure("dispatch_jobs_per_s_raw", f"raw: create_namespaced_job from {threads} threads", "jobs/s", raw_rate),
        Figure(
            "dispatch_engine_side_per_s",
            f"ours, the engine's side: rows written and create_jobs sent ({ENGINE_THREADS} threads, {FANOUT} per transaction)",
            "dispatches/s",
            rates(n, ours.schedule_seconds[FANOUT]),
        ),
        Figure(
            "dispatch_engine_side_per_s_single",
            f"ours, the engine's side: rows written and create_jobs sent ({ENGINE_THREADS} threads, 1 per transaction)",
            "dispatches/s",
            rates(n, ours.schedule_seconds[1]),
        ),
    ]
    cpu_labels = {
        ("ours", "worker"): "CPU per Job, ours: the worker process",
        ("ours", "bench"): f"CPU per Job, ours: the engine's threads ({FANOUT} per transaction)",
        ("ours", "localcluster"): "CPU per Job, ours: the API server",
        ("single", "worker"): "CPU per Job, ours one per transaction: the worker process",
        ("single", "bench"): "CPU per dispatch, one per transaction: the engine's process (time.process_time)",
        ("raw", "bench"): "CPU per Job, raw: the official client's threads",
        ("raw", "localcluster"): "CPU per Job, raw: the API server",
    }
    for (variant, process), label in cpu_labels.items():
        samples = cpu.ms_per_job[variant].get(process)
        if samples and all(s > 0 for s in samples):  # no /proc (not Linux): no CPU figures
            targeted = (variant, process) == ("single", "bench")
            result.figures.append(
                Figure(
                    f"dispatch_cpu_ms_{variant}_{process}",
                    label,
                    "ms",
                    samples,
                    SINGLE_ENGINE_CPU_TARGET if targeted else None,
                    ref="16.4" if targeted else None,
                )
            )
    result.ratios.append(
        Ratio(
            "dispatch_throughput_ratio",
            "dispatch throughput, ours / the raw client (Jobs/s)",
            paired_ratios(ours_rate, raw_rate),
            TARGET,
            ref="8.1",
        )
    )
    result.ratios.append(
        Ratio(
            "dispatch_throughput_ratio_single",
            "dispatch throughput, one schedule per transaction / the raw client (Jobs/s)",
            paired_ratios(single_rate, raw_beside_single),
            SINGLE_TARGET,
            ref="16.4",
        )
    )
    result.notes.append(
        f"one worker process ({threads} threads, no beat), {ENGINE_THREADS} engine threads, localcluster "
        "--mode simulate; ours' clock: first schedule call -> last row marked created"
    )
    result.notes.append(
        f"ours (targeted): the engine's threads write transactions of {FANOUT} dispatches "
        f"(schedule_many_in_session), each sent as create_jobs messages of up to {CREATE_BATCH} ids; "
        "the worker reads a message's rows in one query, creates its Jobs one after the other and marks "
        "them in one transaction. 'one per transaction': every dispatch in its own transaction "
        "(schedule_in_session), one id per message. raw: create_namespaced_job from the worker's number of threads"
    )
    return result


class _Ours:
    """Dispatches scheduled by engine threads; done when the worker marked every row created."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        caps: CapabilityResolver,
        producer: Celery,
        max_input: int,
        cpu: _CpuMeter,
    ):
        self._sessions, self._caps, self._producer, self._max_input = sessions, caps, producer, max_input
        self._cpu = cpu
        self.created = 0
        self.schedule_seconds: dict[int, list[float]] = {}  # the engine's side of each round, by fanout

    def round(self, n: int, *, fanout: int) -> float:
        """`n` dispatches in transactions of `fanout`, from ENGINE_THREADS threads; the seconds
        from the first schedule call to the last Job created."""
        case_id = workload.new_case(self._sessions)
        requests = [
            scheduling.ScheduleRequest(
                case_id, workload.TENANCY, workload.capability_for(i), workload.input_for(i), f"key-{uuid.uuid4()}"
            )
            for i in range(n)
        ]
        chunks = [requests[i : i + fanout] for i in range(0, n, fanout)]

        def schedule(chunk: int) -> None:
            with transaction(self._sessions) as session:
                if fanout == 1:  # the one-dispatch entry, as an engine calls it
                    (request,) = chunks[chunk]
                    schedule_in_session(
                        session, via=self._producer, router=self._caps, max_input_bytes=self._max_input, **vars(request)
                    )
                else:
                    schedule_many_in_session(
                        session, chunks[chunk], router=self._caps, max_input_bytes=self._max_input, via=self._producer
                    )

        variant = "ours" if fanout > 1 else "single"
        with self._cpu.measuring(variant, n):
            started, scheduled = _concurrently(schedule, len(chunks), threads=min(ENGINE_THREADS, len(chunks)))
            # The end time is read from the rows: polling slowly costs no accuracy, little CPU.
            wait_until(
                lambda: self._created_count(case_id) == n, timeout=60 + n / 5, interval=0.2, what=f"{n} Jobs created"
            )
        self.created += n
        self.schedule_seconds.setdefault(fanout, []).append(scheduled - started)
        return self._last_created(case_id) - started

    def _created_count(self, case_id: str) -> int:
        with transaction(self._sessions) as session:
            return (
                session.scalar(
                    sa.select(sa.func.count()).where(
                        Dispatch.case_id == case_id, Dispatch.state == DispatchState.CREATED
                    )
                )
                or 0
            )

    def _last_created(self, case_id: str) -> float:
        """The latest `job_created_at` of the case's rows, as a `time.time()` value."""
        with transaction(self._sessions) as session:
            last = session.scalar(sa.select(sa.func.max(Dispatch.job_created_at)).where(Dispatch.case_id == case_id))
        if last is None:
            raise RuntimeError(f"no Job created for case {case_id}")
        return (last if last.tzinfo else last.replace(tzinfo=UTC)).timestamp()


class _Raw:
    """The official client's `create_namespaced_job` from `threads` threads, its defaults."""

    def __init__(self, batch: k8s.BatchV1Api, caps: CapabilityResolver, cpu: _CpuMeter, *, threads: int):
        self._batch, self._caps, self._cpu, self._threads = batch, caps, cpu, threads
        self.created = 0

    def round(self, n: int) -> float:
        bodies = workload.job_bodies(n, namespace=RAW_NAMESPACE, caps=self._caps)
        with self._cpu.measuring("raw", n):
            started, finished = _concurrently(
                # a dict body, as the client takes it (validated into its V1Job) though typed V1Job
                lambda i: self._batch.create_namespaced_job(RAW_NAMESPACE, cast(k8s.V1Job, bodies[i])),
                n,
                threads=self._threads,
            )
        self.created += n
        return finished - started


def _concurrently(fn: Callable[[int], Any], n: int, *, threads: int) -> tuple[float, float]:
    """`fn(0)` ... `fn(n - 1)` from `threads` threads (started before the clock); the
    `time.time()` just before the first call and just after the last one returned."""
    errors: list[BaseException] = []
    start = threading.Barrier(threads + 1)

    def work(share: range) -> None:
        start.wait()
        try:
            for i in share:
                fn(i)
        except Exception as e:
            errors.append(e)

    with ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(work, range(t, n, threads)) for t in range(threads)]
        started = time.time()
        start.wait()
        for future in futures:
            future.result()
        finished = time.time()
    if errors:
        raise RuntimeError(f"{len(errors)} thread(s) failed; first: {errors[0]!r}") from errors[0]
    return started, finished


class _CpuMeter:
    """CPU seconds per Job of the bench's own process and of `pids`, per variant and round."""

    def __init__(self, pids: dict[str, int | None]):
        self._pids = pids
        self.ms_per_job: dict[str, dict[str, list[float]]] = {}

    @contextmanager
    def measuring(self, variant: str, jobs: int) -> Iterator[None]:
        before = self._now()
        yield
        after = self._now()
        per_process = self.ms_per_job.setdefault(variant, {})
        for name in before:
            per_process.setdefault(name, []).append(1000 * (after[name] - before[name]) / jobs)

    def _now(self) -> dict[str, float]:
        return {"bench": time.process_time(), **{name: cpu_seconds(pid) for name, pid in self._pids.items()}}


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of process `pid` (0.0 where /proc cannot tell)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _check_jobs(kube: KubeClient, namespace: str, expected: int) -> None:
    count = sum(len(page) for page in kube.iter_jobs(namespace, label_selector=job_labels.selector()))
    if count != expected:
        raise RuntimeError(f"{count} Jobs in {namespace}, expected {expected}")
