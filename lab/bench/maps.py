"""Issue 29's figures: N items as ONE map dispatch (an Indexed Job) against N single dispatches,
side by side in one run, each on a new API server with its own database, a real `celery -A
tasks worker` and `beat`: localcluster, and (`--cluster real|both`) the real control plane, where
the real Job controller runs the Indexed Job and our node agent its Pods.

Per variant, from the schedule (every row in one transaction, as an engine would) until every
item is recorded and no Job is left: our API requests per item and objects read per item (the
server's own counters, `api_counts.scrape`, around the run; the bench's own requests taken out),
the Job objects at peak (sampled by a LIST of one Job, its `remainingItemCount`), schedule ->
last item recorded, and item finished -> item recorded p99 (each Pod seen finished by the
bench's watch of Pods, against its item end's or its dispatch's terminal event's created_at).
Our worker never watches Pods: the bench's watch of them is left out of the counts whole. The
real server counts every sender's requests and watch events (the Job controller's, the node
agent's...): there ours come from its audit log and our worker's own count (`_ours`).
"""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
import yaml
from celery import Celery

from k8s_dispatch.lab.bench import services, workload
from k8s_dispatch.lab.bench.api_counts import BENCH, OURS, Key, Scrape, scrape
from k8s_dispatch.lab.bench.api_steady import POLL_INTERVAL_S, RawWatch, audited_window, deployment, events_read_by
from k8s_dispatch.lab.bench.results import BenchResult, Figure, Ratio, Target
from k8s_dispatch.lab.bench.sizes import Size
from k8s_dispatch.ops.processes import free_port, wait_until
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import TERMINAL_EVENT_TYPES, CaseEvent, Dispatch, MapItemEnd
from k8s_dispatch.tasks.maps import schedule_map_in_session
from k8s_dispatch.tasks.scheduling import schedule_in_session
from k8s_dispatch.workers.resolver import CapabilityResolver

SIM = "localcluster.k8s-dispatch.io/"
CAPABILITY = "bench.item"
NAMESPACE = "bench-maps"
CONCURRENCY = 8
MAP, SINGLES = "map", "singles"
JOB_NAME = "batch.kubernetes.io/job-name"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
REQUESTS_PER_ITEM = Target(1.3, at_least=False, inclusive=True)  # a Pod's release is the one it cannot share
RECORDED_P99 = Target(POLL_INTERVAL_S + 1.0, at_least=False, inclusive=True)


@dataclass(frozen=True)
class Knobs:
    items: int
    item_s: float
    parallelism: int


KNOBS = {
    "smoke": Knobs(items=30, item_s=1.0, parallelism=10),
    "quick": Knobs(items=2_000, item_s=2.0, parallelism=200),
    "full": Knobs(items=10_000, item_s=10.0, parallelism=500),  # the sizes
}
# The real control plane (etcd, kube-apiserver, the controller manager, our node agent) shares the
# machine's cores with ours and is several times slower at Pods than localcluster: a quick run is
# kept to a few minutes on 2 cores; the issue states its sizes for the real one at full.
REAL_KNOBS = {
    "smoke": Knobs(items=20, item_s=1.0, parallelism=10),
    "quick": Knobs(items=500, item_s=2.0, parallelism=100),
    "full": Knobs(items=10_000, item_s=10.0, parallelism=500),
}
KNOBS_OF = {services.LOCAL: KNOBS, services.REAL: REAL_KNOBS}
SUFFIX = {services.LOCAL: "", services.REAL: "_real"}  # of figure names: localcluster's keep their first names
WHERE = {services.LOCAL: "localcluster", services.REAL: "the real control plane"}


@dataclass
class Run:
    """What one variant cost and how long it took."""

    variant: str
    kind: str  # services.LOCAL or REAL
    knobs: Knobs
    requests: Counter[tuple[str, str, str, int]]
    objects: Counter[str]
    peak_jobs: int
    last_recorded_s: float  # schedule -> last item recorded
    latencies_s: list[float]
    unrecorded: int  # Pods seen finished whose item had no end in time
    notes: list[str] = field(default_factory=list)

    @property
    def items(self) -> int:
        return self.knobs.items

    @property
    def requests_per_item(self) -> float:
        return sum(self.requests.values()) / self.items

    @property
    def objects_per_item(self) -> float:
        return sum(self.objects.values()) / self.items


def run(ctx: services.BenchContext, size: Size) -> BenchResult:
    """Both variants on each cluster asked for (`--cluster`); on localcluster when neither is."""
    kinds = [kind for kind in (services.LOCAL, services.REAL) if kind in ctx.clusters] or [services.LOCAL]
    knobs = {kind: KNOBS_OF[kind][size.name] for kind in kinds}
    result = BenchResult(
        name="maps",
        title="items as one map dispatch vs as single dispatches: "
        + ", ".join(f"{knobs[kind].items:,} on {WHERE[kind]}" for kind in kinds),
        rounds=1,
        params={**{key + SUFFIX[kind]: value for kind in kinds for key, value in knobs[kind].__dict__.items()},
                "clusters": kinds, "poll_interval_s": POLL_INTERVAL_S, "worker_concurrency": CONCURRENCY},
    )  # fmt: skip
    for kind in kinds:
        _report(result, {variant: _measure(ctx, knobs[kind], variant, kind) for variant in (MAP, SINGLES)})
    return result


def _report(result: BenchResult, runs: dict[str, Run]) -> None:
    """One cluster's figures, notes and ratios, named with its SUFFIX."""
    for variant, r in runs.items():
        tag, knobs = f"{variant}{SUFFIX[r.kind]}", r.knobs
        what = (
            f"{knobs.items:,} items of {knobs.item_s:g} s as "
            + (f"one map (parallelism {knobs.parallelism})" if variant == MAP else "single dispatches")
            + ("" if r.kind == services.LOCAL else ", real control plane")
        )
        judged = variant == MAP
        result.figures += [
            Figure(f"requests_per_item_{tag}", f"our API requests per item, {what}", "requests",
                   [r.requests_per_item], target=REQUESTS_PER_ITEM if judged else None, ref="29"),
            Figure(f"objects_per_item_{tag}", f"objects read per item, {what}", "objects",
                   [r.objects_per_item], ref="29"),
            Figure(f"peak_jobs_{tag}", f"Job objects at peak, {what}", "Jobs", [float(r.peak_jobs)], ref="29"),
            Figure(f"last_recorded_s_{tag}", f"schedule -> last item recorded, {what}", "s",
                   [r.last_recorded_s], ref="29"),
        ]  # fmt: skip
        if r.latencies_s:
            result.figures.append(
                Figure(f"recorded_p99_s_{tag}", f"item finished -> item recorded p99, {what}", "s",
                       [percentile(r.latencies_s, 0.99)], target=RECORDED_P99 if judged else None, ref="29")
            )  # fmt: skip
        result.notes.append(
            f"{what}: per item {_per_item(r.requests, r.items)}; objects {dict(r.objects)}; {r.unrecorded} Pods seen "
            "finished with no item recorded" + "".join(f"; {note}" for note in r.notes)
        )
    single, mapped = runs[SINGLES], runs[MAP]
    suffix, where = SUFFIX[mapped.kind], "" if mapped.kind == services.LOCAL else ", real control plane"
    result.ratios += [
        Ratio(f"requests_singles_vs_map{suffix}", f"our API requests per item, single dispatches / one map{where}",
              [single.requests_per_item / max(mapped.requests_per_item, 1e-9)], ref="29"),
        Ratio(f"objects_singles_vs_map{suffix}", f"objects read per item, single dispatches / one map{where}",
              [single.objects_per_item / max(mapped.objects_per_item, 1e-9)], ref="29"),
    ]  # fmt: skip


def _per_item(requests: Counter[Key], items: int) -> str:
    """ "PATCH pods 200 1.00, ..." per item, largest first."""
    return ", ".join(f"{v} {res}{'/' + sub if sub else ''} {code} {n / items:.2f}" for (v, res, sub, code), n
                     in sorted(requests.items(), key=lambda kv: -kv[1]))  # fmt: skip


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def capability_config(item_s: float) -> dict[str, Any]:
    spec = {"worker": "sim", "image": "sim:1", "backoffLimit": 0,
            "annotations": {SIM + "duration-ms": str(round(item_s * 1000))}}  # fmt: skip
    return {"capabilities": {CAPABILITY: spec}}


def _measure(ctx: services.BenchContext, knobs: Knobs, variant: str, kind: str) -> Run:
    name = f"{'lc' if kind == services.LOCAL else 'rc'}-maps-{variant}"
    caps_file = ctx.work_dir / f"{name}.yaml"
    caps_file.write_text(yaml.safe_dump(capability_config(knobs.item_s)))
    caps = CapabilityResolver.from_mapping(capability_config(knobs.item_s), source=str(caps_file))
    port = free_port()  # the worker's /metrics: the watch events it read
    metrics = f"http://127.0.0.1:{port}/metrics"
    with (
        services.database(ctx.pg_admin_url) as database_url,
        services.cluster(ctx.work_dir, name=name, kind=kind) as cluster,
        deployment(
            {
                "database_url": database_url,
                "redis_url": ctx.redis_url,
                "key_prefix": f"{ctx.key_prefix}-maps-{kind}-{variant}-{uuid.uuid4().hex[:6]}",
                "namespace": NAMESPACE,
                "kubeconfig": str(cluster.kubeconfig),
                "capabilities": str(caps_file),
                "poll_interval_s": str(POLL_INTERVAL_S),
                "worker_concurrency": str(CONCURRENCY),
                "metrics_port": str(port),
            }
        ) as dep,
    ):
        cluster.ensure_namespace(NAMESPACE)
        sessions = dep.sessions
        case_id = workload.new_case(sessions)
        with services.worker_and_beat(ctx.work_dir, dep.env, concurrency=CONCURRENCY) as ready:
            ready()
            with watching(cluster) as seen:
                audit_from = cluster.audit_log.stat().st_size if cluster.audit_log else 0
                read_before = events_read_by(metrics)
                before = scrape(cluster)
                started = time.time()
                ids = _schedule(sessions, dep.producer, caps, dep.settings.max_input_bytes, case_id, knobs, variant)
                # single dispatches have no parallelism of their own: every Job at once, as many as items
                deadline = max(300.0, 6 * knobs.items * knobs.item_s / knobs.parallelism, 0.3 * knobs.items)
                wait_until(lambda: seen.sample() == 0 and _all_ended(sessions, ids), timeout=deadline,
                           interval=0.5, what=f"{variant}: every item recorded and no Job left")  # fmt: skip
                after = scrape(cluster)
                events_read = events_read_by(metrics) - read_before
            recorded = _recorded(sessions, ids, variant)
        # the real server's requests by sender, read before its directory is removed
        by_sender = audited_window(cluster, offset=audit_from) if cluster.audit_log else None
    requests, objects = _ours(before, after, seen, by_sender=by_sender, events_read=events_read)
    latencies = [recorded[key] - at for key, at in seen.finished_at.items() if key in recorded]
    return Run(
        variant=variant, kind=kind, knobs=knobs, requests=requests, objects=objects, peak_jobs=seen.peak_jobs,
        last_recorded_s=max(recorded.values()) - started, latencies_s=latencies,
        unrecorded=sum(1 for key in seen.finished_at if key not in recorded),
        notes=_senders(by_sender, knobs.items) if by_sender is not None else [],
    )  # fmt: skip


def _schedule(
    sessions: Any, producer: Celery, caps: CapabilityResolver, max_bytes: int, case_id: str, knobs: Knobs, variant: str
) -> list[str]:
    """Every row in one transaction, the creates sent after its commit."""
    with transaction(sessions) as session:
        if variant == MAP:
            return [
                schedule_map_in_session(
                    session, case_id=case_id, tenancy_id=workload.TENANCY, capability=CAPABILITY,
                    items=[{"k": i} for i in range(knobs.items)], idempotency_key=f"map-{uuid.uuid4()}",
                    parallelism=knobs.parallelism, router=caps, max_input_bytes=max_bytes, via=producer,
                ).dispatch_id
            ]  # fmt: skip
        return [
            schedule_in_session(
                session, case_id=case_id, tenancy_id=workload.TENANCY, capability=CAPABILITY, input={"k": i},
                idempotency_key=f"one-{uuid.uuid4()}", router=caps, max_input_bytes=max_bytes, via=producer,
            ).dispatch_id
            for i in range(knobs.items)
        ]  # fmt: skip


def _all_ended(sessions: Any, ids: list[str]) -> bool:
    types = [t.value for t in TERMINAL_EVENT_TYPES]
    query = sa.select(sa.func.count(sa.distinct(CaseEvent.dispatch_id))).where(
        CaseEvent.dispatch_id.in_(ids), CaseEvent.type.in_(types)
    )
    with transaction(sessions) as session:
        return int(session.execute(query).scalar_one()) == len(ids)


def _recorded(sessions: Any, ids: list[str], variant: str) -> dict[tuple[str, int], float]:
    """When each item was recorded, by (Job name, completion index): a map's item ends, or each
    single dispatch's terminal event (its Job's one Pod is index 0)."""
    with transaction(sessions) as session:
        if variant == MAP:
            ends = session.execute(
                sa.select(Dispatch.job_name, MapItemEnd.item_index, MapItemEnd.created_at)
                .join(Dispatch, Dispatch.dispatch_id == MapItemEnd.dispatch_id)
                .where(MapItemEnd.dispatch_id.in_(ids))
            ).all()
            return {(str(name), int(index)): at.timestamp() for name, index, at in ends}
        types = [t.value for t in TERMINAL_EVENT_TYPES]
        rows = session.execute(
            sa.select(Dispatch.job_name, CaseEvent.created_at)
            .join(CaseEvent, CaseEvent.dispatch_id == Dispatch.dispatch_id)
            .where(Dispatch.dispatch_id.in_(ids), CaseEvent.type.in_(types))
        ).all()
        return {(str(name), 0): at.timestamp() for name, at in rows}


def _ours(
    before: Scrape, after: Scrape, seen: PodWatch, *, by_sender: dict[str, Counter[Key]] | None, events_read: int
) -> tuple[Counter[Any], Counter[str]]:
    """What ours sent and read between two scrapes, the bench's own (its watch of Pods, its LISTs
    of one Job) taken out. localcluster's counters are ours alone. The real server's count every
    sender's: there ours are the requests its audit log gives to ours (`by_sender`) and the watch
    events our worker read by its own count (`events_read`); LISTs stay the server's count (the
    others' informers list as they start, before the run: `_senders` says if any did in it). On
    both, objects listed include those the server lists for our deletecollection of Jobs."""
    objects = after.objects.copy()
    objects.subtract(before.objects)
    objects["LIST jobs"] -= seen.sampled_objects
    if by_sender is not None:
        listed = Counter({key: n for key, n in objects.items() if key.startswith("LIST ")})
        return +by_sender.get(OURS, Counter()), +(listed + Counter({"WATCH jobs": events_read}))
    requests = after.requests.copy()
    requests.subtract(before.requests)
    for key in list(requests):
        if key[:2] == ("WATCH", "pods") or requests[key] <= 0:
            del requests[key]
    requests[("LIST", "jobs", "", 200)] -= seen.samples
    del objects["WATCH pods"]
    return +requests, +objects


def _senders(by_sender: dict[str, Counter[Key]], items: int) -> list[str]:
    """The real server's requests per item by sender (its audit log), and the others' LISTs: their
    objects are in the server's count of objects listed."""
    senders = sorted(((who, c) for who, c in by_sender.items() if who != BENCH), key=lambda kv: -sum(kv[1].values()))
    lists = [f"{who} {resource} {n}" for who, c in senders if who != OURS
             for (verb, resource, _, _), n in c.items() if verb == "LIST"]  # fmt: skip
    return ["every sender's requests per item (audit log): "
            + ", ".join(f"{who} {sum(c.values()) / items:.2f}" for who, c in senders),
            f"LISTs by other senders in the run, their objects in the count: {', '.join(lists) or 'none'}"]  # fmt: skip


class PodWatch(RawWatch):
    """The bench's eye on the run: a watch of the namespace's Pods on a thread (when each Pod is
    first seen finished, by Job name and completion index), and `sample()`, the Jobs there now."""

    def __init__(self, cluster: services.Cluster) -> None:
        super().__init__(cluster, f"/api/v1/namespaces/{NAMESPACE}/pods", name="maps-pod-watch")
        self.finished_at: dict[tuple[str, int], float] = {}
        self.peak_jobs = 0
        self.samples = 0  # LISTs of one Job the bench made
        self.sampled_objects = 0

    def sample(self) -> int:
        """How many Jobs the namespace has now (a LIST of one, its remainingItemCount)."""
        if self.error is not None:
            raise RuntimeError(f"the bench's watch of Pods failed: {self.error}") from self.error
        status, body = self._cluster.request("GET", f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs?limit=1")
        if status != 200:
            raise RuntimeError(f"LIST jobs answered {status}: {body[:200]!r}")
        page = json.loads(body)
        items = len(page.get("items") or [])
        self.samples += 1
        self.sampled_objects += items
        count = items + int((page.get("metadata") or {}).get("remainingItemCount") or 0)
        self.peak_jobs = max(self.peak_jobs, count)
        return count

    def on_object(self, obj: dict[str, Any], now: float) -> None:
        if (obj.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
            return
        labels = (obj.get("metadata") or {}).get("labels") or {}
        key = (str(labels.get(JOB_NAME)), int(labels.get(COMPLETION_INDEX, 0)))
        self.finished_at.setdefault(key, now)


@contextmanager
def watching(cluster: services.Cluster) -> Iterator[PodWatch]:
    watch = PodWatch(cluster)
    watch.start()
    try:
        yield watch
    finally:
        watch.stop()
