"""4 and 5 (issue 8): the recovery sweep at scale, over N managed Jobs and their dispatch rows.

Figure 4: one `recovery.sweep.run_sweep` against a raw paginated LIST of the same Jobs by the
official client (`BatchV1Api.list_namespaced_job`, `limit` + `_continue`, its default model
objects), interleaved; and the API requests the sweep made, counted by the server, against what
it should need: the LIST pages plus the calls of the Jobs that needed action.
Figure 5: the peak RSS of a fresh process (`python -m k8s_dispatch.lab.bench.sweep_child`: a Runtime built from
K8S_DISPATCH_* settings, one sweep, its peak RSS printed) for two N: flat if the sweep streams
page by page. The smaller N is the first Jobs and rows of the larger, measured before the rest
are added: one population serves both figures.

Setup is untimed and bulk: Jobs through `bench.rawhttp.create_jobs`, rows by COPY into the real
schema (the columns `store.dispatches.schedule` and `mark_created` write). Healthy Jobs are suspended
(a Job that is neither finished nor lost, with no Pod to simulate) and their rows CREATED an hour
ago (past the grace period, as for Jobs that run long). Before each sweep 1% more need action:
half finished and unrecorded (the sweep completes them), half rows whose Job is gone (re-created).
"""

from __future__ import annotations

import json
import logging
import math
import re
import subprocess
import sys
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import yaml
from kubernetes import client as k8s

from k8s_dispatch.core.settings import load_settings
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.lab import kubeclient
from k8s_dispatch.lab.bench import rawhttp, services, workload
from k8s_dispatch.lab.bench.results import BenchResult, Figure, Ratio, Target
from k8s_dispatch.lab.bench.sizes import Size
from k8s_dispatch.lab.bench.timing import Stopwatch, interleaved, paired_ratios
from k8s_dispatch.ops.processes import project_env, wait_until
from k8s_dispatch.recovery.plan import Category
from k8s_dispatch.recovery.sweep import run_sweep
from k8s_dispatch.store.models import DispatchState, EventType, utcnow
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.job_status import job_state
from k8s_dispatch.workers.manifest import build_job, job_name
from k8s_dispatch.workers.types import (
    CapabilityName,
    CaseId,
    DispatchId,
    DispatchRef,
    IdempotencyKey,
    TenancyId,
    WorkerName,
)

NAMESPACE = "bench-sweep"
JOBS = {"smoke": 200, "quick": 10_000, "full": 100_000}  # figure 4, and figure 5's largest N
SMALL_JOBS = {"smoke": 100, "quick": 2_000, "full": 10_000}  # figure 5's smallest N
ROUNDS = {"smoke": 1, "quick": 2, "full": 2}  # figure 4: each round a sweep and a LIST
MEMORY_ROUNDS = {"smoke": 1, "quick": 1, "full": 2}  # figure 5: sweeping processes per N (a peak RSS varies little)
ACTION_SHARE = 0.01  # of N, seeded before each sweep: half finished unrecorded, half lost
LONG = "bench.long"  # the healthy Jobs' capability: simulated for an hour (they are suspended anyway)
ROW_AGE = timedelta(hours=1)
CREATE_CHUNK = 2_000  # Job bodies serialised and created at a time (bounded bench memory)
CHILD_TIMEOUT_S = 1800.0

RATIO_TARGET = Target(1.5, at_least=False, inclusive=True)
RSS_TARGET = Target(200, at_least=False, inclusive=True)  # MB at the largest N
FLAT_TARGET = Target(1.25, at_least=False, inclusive=True)  # RSS(largest N) / RSS(smallest N)


def run(ctx: services.BenchContext, size: Size) -> BenchResult:
    n, small_n, rounds = JOBS[size.name], SMALL_JOBS[size.name], ROUNDS[size.name]
    memory_rounds = MEMORY_ROUNDS[size.name]
    seeded = max(2, round(n * ACTION_SHARE))
    finished, lost = seeded // 2, seeded - seeded // 2
    result = BenchResult(
        name="sweep",
        title=f"the recovery sweep over {n:,} Jobs vs the official client's LIST; its memory",
        rounds=rounds,
        params={
            "jobs": n,
            "finished_unrecorded": finished,
            "lost": lost,
            "memory_jobs": [small_n, n],
            "memory_rounds": memory_rounds,
        },
    )
    caps_file = ctx.work_dir / "sweep-capabilities.yaml"
    caps_file.write_text(yaml.safe_dump(capability_config()))
    with (
        _quiet("recovery"),
        services.database(ctx.pg_admin_url) as database_url,
        services.cluster(ctx.work_dir, name="lc-sweep") as cluster,
    ):
        env = {
            "database_url": database_url,
            "redis_url": ctx.redis_url,
            "key_prefix": f"{ctx.key_prefix}-sweep",
            "namespace": NAMESPACE,
            "kubeconfig": str(cluster.kubeconfig),
            "capabilities": str(caps_file),
        }
        settings = load_settings(services.deployment_env(env))
        with Runtime.from_settings(settings, notifier=lambda dispatch_id: None) as rt:
            population = Population(rt, cluster, clients=size.create_clients)
            with Stopwatch() as setup:
                population.add_healthy(small_n)
            memory = {small_n: _memory(env, small_n, rounds=memory_rounds)}
            with Stopwatch() as more:
                population.add_healthy(n - small_n)
            result.notes.append(f"setup of {n:,} Jobs and rows: {setup.seconds + more.seconds:.0f}s")
            _figure_4(result, rt, cluster, n=n, finished=finished, lost=lost, rounds=rounds)
            memory[n] = _memory(env, n, rounds=memory_rounds)
        _figure_5(result, memory)
    result.params["page_size"] = settings.poll_page_size
    return result


@contextmanager
def _quiet(logger: str) -> Iterator[None]:
    """Warnings off: the sweep logs one per lost Job it creates again, hundreds a round."""
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


# --- figure 4 ----------------------------------------------------------------------------------


def _figure_4(
    result: BenchResult, rt: Runtime, cluster: services.Cluster, *, n: int, finished: int, lost: int, rounds: int
) -> None:
    page_size = rt.settings.poll_page_size
    population = Population(rt, cluster, clients=2)
    requests: list[Counter[tuple[str, str]]] = []
    listed: list[int] = []
    namespaces: list[int] = []
    api_client = kubeclient.api_client(cluster.kubeconfig)
    batch = k8s.BatchV1Api(api_client)
    selector = job_labels.undelivered_selector(rt.settings.effective_deployment)  # the sweep's own

    def sweep() -> float:
        population.add_finished_unrecorded(finished)
        population.add_lost(lost)
        before = request_counts(cluster)
        with Stopwatch() as sw:
            report = run_sweep(rt)
        after = request_counts(cluster)
        done = {c: report.categories[c].acted for c in (Category.FINISHED_UNRECORDED, Category.JOB_LOST)}
        if done != {Category.FINISHED_UNRECORDED: finished, Category.JOB_LOST: lost} or report.errors:
            raise RuntimeError(f"the sweep did not do what was seeded ({finished} + {lost}):\n{report.table()}")
        if before is not None and after is not None:
            requests.append(after - before)
        listed.append(report.jobs_listed)
        namespaces.append(len(report.namespaces))
        return sw.seconds

    def client_list() -> float:
        count, token = 0, None
        with Stopwatch() as sw:
            while True:
                page = batch.list_namespaced_job(NAMESPACE, label_selector=selector, limit=page_size, _continue=token)
                count += len(page.items)
                token = page.metadata._continue if page.metadata else None
                if not token:
                    break
        if count < n:
            raise RuntimeError(f"the official client listed {count} of {n} Jobs")
        return sw.seconds

    try:
        seconds = interleaved({"sweep": sweep, "list": client_list}, rounds=rounds, warmup=False)
    finally:
        kubeclient.close(api_client)
    ratios = paired_ratios(seconds["sweep"], seconds["list"])
    result.figures += [
        Figure("sweep_s", f"one recovery sweep over {n:,} Jobs and rows (run_sweep)", "s", seconds["sweep"], ref="8.4"),
        Figure(
            "client_list_s",
            f"the official client's paginated LIST of them (pages of {page_size})",
            "s",
            seconds["list"],
            ref="8.4",
        ),
        Figure("sweep_vs_list", "sweep time / LIST time, per round", "x", ratios, RATIO_TARGET, ref="8.4"),
    ]
    result.ratios.append(
        Ratio("sweep_vs_client_list_time", f"{n:,} Jobs: one sweep / the official client's LIST", ratios)
    )
    pages = math.ceil(max(listed) / page_size)
    # And one LIST per namespace of the Jobs made before the deployment label (none here).
    lists = pages + max(namespaces)
    result.params["list_pages"] = pages
    result.params["job_lists_expected"] = lists
    if not requests:
        result.notes.append(f"the API server counts no requests (no /metrics): expected {lists} LISTs of Jobs")
        return
    job_lists = [float(c[("list", "jobs")]) for c in requests]
    per_action = [(sum(c.values()) - c[("list", "jobs")]) / (finished + lost) for c in requests]
    result.figures += [
        Figure(
            "sweep_job_lists",
            f"LISTs of Jobs one sweep made (the LIST's pages: {pages}, + {lists - pages} for unlabelled Jobs)",
            "requests",
            job_lists,
            Target(lists, at_least=False, inclusive=True),
            ref="8.4",
        ),
        Figure(
            "sweep_requests_per_action",
            f"other requests per Job that needed action ({finished} finished, {lost} lost)",
            "requests",
            per_action,
            ref="8.4",
        ),
    ]
    by_verb = ", ".join(f"{verb} {res}: {count}" for (verb, res), count in sorted(requests[-1].items()))
    result.notes.append(f"requests of the last sweep, counted by the API server: {by_verb}")


# --- figure 5 ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Memory:
    """Figure 5 at one N: each sweeping process's RSS before its sweep and at its peak, in MB."""

    start_mb: list[float]
    peak_mb: list[float]


def _memory(values: Mapping[str, str], size: int, *, rounds: int) -> Memory:
    """Sweep the `size` Jobs the settings name in `rounds` fresh processes, one after the other."""
    memory = Memory(start_mb=[], peak_mb=[])
    for _ in range(rounds):
        child = sweep_in_child(values)
        if child["jobs_listed"] < size or child["errors"]:
            raise RuntimeError(f"the child's sweep listed {child['jobs_listed']} of {size} Jobs: {child}")
        memory.start_mb.append(child["start_rss_kib"] / 1024)
        memory.peak_mb.append(child["peak_rss_kib"] / 1024)
    return memory


def _figure_5(result: BenchResult, memory: Mapping[int, Memory]) -> None:
    sizes = sorted(memory)
    for size in sizes:
        target = RSS_TARGET if size == sizes[-1] else None
        result.figures.append(
            Figure(
                f"sweep_peak_rss_{size}",
                f"peak RSS of a process sweeping {size:,} Jobs",
                "MB",
                memory[size].peak_mb,
                target,
                ref="8.5",
            )
        )
    result.figures.append(
        Figure(
            "sweep_rss_growth",
            f"peak RSS at {sizes[-1]:,} Jobs / at {sizes[0]:,}, per round",
            "x",
            paired_ratios(memory[sizes[-1]].peak_mb, memory[sizes[0]].peak_mb),
            FLAT_TARGET,
            ref="8.5",
        )
    )
    result.notes.append(
        "RSS of the sweep's process before it swept (imports + Runtime): "
        + ", ".join(f"{min(memory[size].start_mb):.0f} MB at {size:,}" for size in sizes)
    )


def sweep_in_child(values: Mapping[str, str]) -> dict[str, Any]:
    """Run `python -m k8s_dispatch.lab.bench.sweep_child` with these settings (and no other K8S_DISPATCH_*); its JSON."""
    ours = services.deployment_env(values)
    env = {k: v for k, v in project_env(ours).items() if not k.startswith(services.ENV_PREFIX) or k in ours}
    done = subprocess.run(
        [sys.executable, "-m", "k8s_dispatch.lab.bench.sweep_child"],
        env=env,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the sweep's process exited {done.returncode}:\n{done.stderr[-3000:]}")
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


# --- the population: Jobs and rows in bulk -----------------------------------------------------


def capability_config() -> dict[str, Any]:
    """The bench capabilities (`bench.d0`...: 0-50 ms), and `bench.long`, an hour."""
    config = workload.capability_config()
    config["capabilities"][LONG] = {
        "worker": workload.WORKER,
        "image": "k8s-dispatch-bench:simulated",
        "annotations": {f"{workload.SIM}duration-ms": str(3_600_000)},
        "activeDeadlineSeconds": 86_400,
        "backoffLimit": 0,
    }
    return config


@dataclass
class Population:
    """Writes dispatch rows (COPY) and their Jobs (bare HTTP) into one Runtime's database and namespace."""

    rt: Runtime
    cluster: services.Cluster
    clients: int

    def add_healthy(self, count: int) -> None:
        """`count` suspended Jobs with their rows, CREATED an hour ago: the sweep leaves them be."""
        for start in range(0, count, CREATE_CHUNK):
            refs = self._rows(min(CREATE_CHUNK, count - start), LONG)
            self._jobs(refs, suspend=True)

    def add_finished_unrecorded(self, count: int) -> None:
        """`count` instant Jobs, finished, whose rows say CREATED: the sweep completes them."""
        refs = self._rows(count, workload.INSTANT)
        self._jobs(refs, suspend=False)

        def all_finished() -> bool:
            return all(job_state(self.rt.kube.get_job(self.namespace, name)).terminal for name in names)

        names = [job_name(ref.dispatch_id) for ref in refs]
        wait_until(all_finished, timeout=120, interval=0.2, what=f"{count} finished Jobs")

    def add_lost(self, count: int) -> None:
        """`count` rows CREATED an hour ago whose Job is gone: the sweep creates them again."""
        self._rows(count, LONG)

    @property
    def namespace(self) -> str:
        return self.rt.settings.namespace

    def _rows(self, count: int, capability: str) -> list[DispatchRef]:
        case_id = workload.new_case(self.rt.sessions)
        refs = [_ref(case_id, capability) for _ in range(count)]
        insert_created(self.rt, refs, namespace=self.namespace, at=utcnow() - ROW_AGE)
        return refs

    def _jobs(self, refs: Sequence[DispatchRef], *, suspend: bool) -> None:
        bodies = []
        for ref in refs:
            spec = self.rt.resolver.spec(ref.capability)
            body = build_job(
                ref,
                input=_input(ref),
                spec=spec,
                namespace=self.namespace,
                deployment=self.rt.settings.effective_deployment,
            )
            if suspend:
                body["spec"]["suspend"] = True
            bodies.append(body)
        rawhttp.create_jobs(self.cluster, self.namespace, bodies, clients=self.clients)


def _ref(case_id: str, capability: str) -> DispatchRef:
    dispatch_id = str(uuid.uuid4())
    return DispatchRef(
        dispatch_id=DispatchId(dispatch_id),
        case_id=CaseId(case_id),
        tenancy_id=TenancyId(workload.TENANCY),
        capability=CapabilityName(capability),
        worker_name=WorkerName(workload.WORKER),
        idempotency_key=IdempotencyKey(f"key-{dispatch_id}"),
    )


def _input(ref: DispatchRef) -> dict[str, Any]:
    return {"text": f"bench dispatch {ref.dispatch_id}"}


DISPATCH_COLUMNS = (
    "dispatch_id", "case_id", "tenancy_id", "capability", "worker_name", "idempotency_key", "input", "state",
    "job_name", "job_namespace", "attempts", "created_at", "updated_at", "job_created_at",
)  # fmt: skip
EVENT_COLUMNS = ("case_id", "dispatch_id", "type", "payload", "created_at")


def insert_created(rt: Runtime, refs: Iterable[DispatchRef], *, namespace: str, at: datetime) -> None:
    """Rows as `store.schedule` then `store.mark_created` leave them (the dispatch, CREATED, and its
    WORKER_SCHEDULED event), written by COPY in one transaction."""
    raw = rt.engine.raw_connection()
    try:
        conn = raw.driver_connection
        assert conn is not None  # a pooled connection, open: its psycopg connection
        with conn.cursor() as cursor:
            refs = list(refs)
            with cursor.copy(f"COPY dispatches ({', '.join(DISPATCH_COLUMNS)}) FROM STDIN") as copy:
                for ref in refs:
                    copy.write_row((
                        ref.dispatch_id, ref.case_id, ref.tenancy_id, ref.capability, ref.worker_name,
                        ref.idempotency_key, json.dumps(_input(ref)), DispatchState.CREATED.value,
                        job_name(ref.dispatch_id), namespace, 0, at, at, at,
                    ))  # fmt: skip
            with cursor.copy(f"COPY case_events ({', '.join(EVENT_COLUMNS)}) FROM STDIN") as copy:
                for ref in refs:
                    payload = {"capability": ref.capability, "worker_name": ref.worker_name,
                               "idempotency_key": ref.idempotency_key, "input": _input(ref)}  # fmt: skip
                    event = EventType.WORKER_SCHEDULED.value
                    copy.write_row((ref.case_id, ref.dispatch_id, event, json.dumps(payload), at))
        conn.commit()
    finally:
        raw.close()


# --- the API server's request counts -----------------------------------------------------------

_SAMPLE = re.compile(r"^apiserver_request_total\{(?P<labels>[^}]*)\}\s+(?P<value>[0-9.eE+]+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def request_counts(cluster: services.Cluster) -> Counter[tuple[str, str]] | None:
    """Requests the API server has answered, by (verb, resource), from its `/metrics`
    (`apiserver_request_total`); None if it serves no such counter."""
    request = urllib.request.Request(f"{cluster.url}/metrics", headers={"Authorization": f"Bearer {cluster.token}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read().decode()
    except OSError:  # 404 (HTTPError is an OSError) or unreachable
        return None
    counts: Counter[tuple[str, str]] = Counter()
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if match:
            labels = dict(_LABEL.findall(match["labels"]))
            if labels.get("resource"):  # not /metrics itself, nor discovery
                counts[(labels.get("verb", "").lower(), labels["resource"])] += int(float(match["value"]))
    return counts if counts else None
