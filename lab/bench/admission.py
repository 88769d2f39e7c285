"""Issue 17's admission cost: a pass costs no API request and stays O(freed slots), not
O(queued). Measured with N dispatches queued behind a full limit, N small and large side by side.

Two fresh migrated databases, one per N (`size.admission_queued`: 1,000 and 100,000 at quick),
and one localcluster (simulate mode) for both. Limits: tenancy LIMITED `maxRunning: SLOTS`,
tenancy OTHER `maxRunning: OTHER_SLOTS` (so its dispatches are queued too, and admitted by a
pass). In each database: SLOTS dispatches of LIMITED admitted and their Jobs created (the
slots full), then N more written as an engine writes a burst (`store.dispatches.schedule_many`,
CHUNK per transaction): QUEUED, waiting. Measured first right after the burst, the table's
autovacuum off (no statistics of the burst yet: the planner's guesses); then `VACUUM ANALYZE
dispatches`, what autovacuum does to a table after such a burst within a minute, for the rest.

Measured, each step on the small and the large queue in turn (the order alternating):
- right after the burst: a few passes as below, and their buffers (the "fresh" figures);
- a pass when one slot frees: a terminal event recorded for one holder (committed, untimed),
  then one pass (`store.admission.admit` in its own transaction, as `tasks.admission.run_pass`
  runs it), timed to its commit; the SQL statements it sent; it must admit exactly the head of
  LIMITED's queue;
- a pass when nothing is free: it must admit nothing;
- `schedule` -> Job created through the real path for a dispatch of OTHER (a free slot) while
  N wait in LIMITED's queue: `scheduling.schedule_many` (committed), a pass, then
  `delivery.create.create_jobs_for` against localcluster; and, for LIMITED, a holder's end ->
  a pass -> the admitted dispatch's Job created. (Celery's hop, the `admit` and `create_jobs`
  messages, is left out: it does not depend on N.)
- the shared buffers a freed-slot pass's statements touch (their `EXPLAIN (ANALYZE, BUFFERS)`,
  replayed in a transaction rolled back): what the database read, free of the machine's noise.

API requests: the Runtime's client counts what it sends, per step: a pass and a schedule send
none (else the bench fails), a create one. The server's own counter (`apiserver_request_total`)
over the whole measured phase must equal the Jobs created: the creates are the only requests.
Ratios large / small are taken per block of passes (BLOCKS of them): their p50s, side by side.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from k8s_dispatch.core.settings import load_settings
from k8s_dispatch.delivery.create import CreateOutcome, create_jobs_for
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.lab.bench import api_load, services, workload
from k8s_dispatch.lab.bench.results import BenchResult, Figure, Ratio, Target
from k8s_dispatch.lab.bench.sizes import Size
from k8s_dispatch.store import admission, dispatches, scheduling
from k8s_dispatch.store.db import database_now, transaction
from k8s_dispatch.store.models import EventType
from k8s_dispatch.workers.kube import KubeClient
from k8s_dispatch.workers.resolver import CapabilityResolver

LIMITED = "bench-limited"  # the tenancy whose slots are full, N of its dispatches waiting
OTHER = "bench-other"  # another tenancy, with free slots
SLOTS = 10
OTHER_SLOTS = 100
CAPABILITY = workload.INSTANT
CHUNK = 1_000  # dispatches per transaction while queueing N
BLOCKS = 5  # blocks of passes, one ratio each
NAMESPACE = "bench-admission"
# Issue 17: independent of what waits (~1.0x); a pass's statements exactly so.
RATIO_TARGET = Target(1.5, at_least=False, inclusive=True)
STATEMENTS_TARGET = Target(1.0, at_least=False, inclusive=True)
REQUESTS_TARGET = Target(1.0, at_least=False, inclusive=True)  # per Job created: its create alone
POST_JOBS = ("POST", "jobs", "", 201)
# `store.db.database_now`'s once-a-minute read of the database's clock: not admission's, not counted.
CLOCK = "statement_timestamp()"


def run(ctx: services.BenchContext, size: Size) -> BenchResult:
    small, big = size.admission_queued
    passes = size.admission_passes
    paths = max(BLOCKS, passes // 5)
    result = BenchResult(
        name="admission",
        title=f"admission with {small:,} vs {big:,} dispatches queued behind a full limit",
        rounds=BLOCKS,
        params={
            "queued": [small, big],
            "slots": SLOTS,
            "other_slots": OTHER_SLOTS,
            "passes": passes,
            "fresh_passes": max(BLOCKS, passes // 4),
            "paths": paths,
            "blocks": BLOCKS,
            "chunk": CHUNK,
            "capability": CAPABILITY,
        },
    )
    with (
        services.database(ctx.pg_admin_url) as small_url,
        services.database(ctx.pg_admin_url) as big_url,
        services.cluster(ctx.work_dir, name="lc-admission") as cluster,
        _side(ctx, cluster, small_url, n=small) as s,
        _side(ctx, cluster, big_url, n=big) as b,
    ):
        sides = (s, b)
        for side in sides:
            started = time.perf_counter()
            side.seed()
            result.notes.append(f"setup of {side.n:,} queued: {time.perf_counter() - started:.0f}s")
        before = api_load.scrape(cluster)
        # Right after the burst, before any statistics of it: what the planner does then.
        _alternate(sides, result.params["fresh_passes"], lambda side: side.freed_pass("fresh"))
        fresh = {side.n: side.explained_pass() for side in sides}
        for side in sides:
            side.vacuumed()
        _alternate(sides, passes, lambda side: side.freed_pass())
        explained = {side.n: side.explained_pass() for side in sides}
        _alternate(sides, passes, lambda side: side.idle_pass())
        _alternate(sides, paths, lambda side: side.other_path())
        _alternate(sides, paths, lambda side: side.freed_path())
        after = api_load.scrape(cluster)
        server_requests = _check_requests(before.requests, after.requests, sides)
    result.params["plans"] = {str(n): plans for n, (_, plans) in explained.items()}
    result.params["plans_fresh"] = {str(n): plans for n, (_, plans) in fresh.items()}
    buffers = {n: blocks for n, (blocks, _) in explained.items()}
    _report(result, s, b, buffers, {n: blocks for n, (blocks, _) in fresh.items()}, server_requests=server_requests)
    return result


@dataclass
class _Side:
    """One database with `n` dispatches queued behind LIMITED's full limit, and its measurements."""

    n: int
    rt: Runtime
    requests: Counter[str]  # what the Runtime's client sent, by verb
    statements: list[str] = field(default_factory=list)  # what the engine sent since last cleared
    holders: deque[str] = field(default_factory=deque)  # LIMITED's dispatches holding its slots, oldest first
    cases: dict[str, str] = field(default_factory=dict)  # tenancy -> its case
    created: list[str] = field(default_factory=list)  # Jobs created while measured
    samples: dict[str, list[float]] = field(default_factory=dict)  # kind -> one value per step
    _keys: Iterator[int] = field(default_factory=lambda: iter(range(10**9)))

    def record(self, kind: str, value: float) -> None:
        self.samples.setdefault(kind, []).append(value)

    # --- set-up ---

    def seed(self) -> None:
        self.sql("ALTER TABLE dispatches SET (autovacuum_enabled = false)")  # until `vacuumed`
        for tenancy in (LIMITED, OTHER):
            case_id = f"case-{tenancy}"
            with transaction(self.rt.sessions) as session:
                scheduling.create_case(session, case_id=case_id, tenancy_id=tenancy)
            self.cases[tenancy] = case_id
        self.schedule(LIMITED, SLOTS)
        admitted, _, _ = self.pass_()
        if len(admitted) != SLOTS:
            raise RuntimeError(f"the first pass admitted {len(admitted)}, expected {SLOTS}")
        self.create([a.dispatch_id for a in admitted])
        self.holders.extend(a.dispatch_id for a in admitted)
        for start in range(0, self.n, CHUNK):
            self.schedule(LIMITED, min(CHUNK, self.n - start))
        self.created.clear()

    def sql(self, statement: str) -> None:
        with self.rt.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql(statement)

    def vacuumed(self) -> None:
        """What autovacuum does within a minute of the burst: the table's statistics taken."""
        self.sql("VACUUM ANALYZE dispatches")
        self.sql("ALTER TABLE dispatches RESET (autovacuum_enabled)")

    def schedule(self, tenancy: str, count: int) -> list[str]:
        requests = [
            scheduling.ScheduleRequest(
                self.cases[tenancy], tenancy, CAPABILITY, workload.input_for(i), f"key-{next(self._keys)}"
            )
            for i in range(count)
        ]
        with transaction(self.rt.sessions) as session:
            results = scheduling.schedule_many(
                session, requests, router=self.rt.resolver, max_input_bytes=self.rt.settings.max_input_bytes
            )
        if any(r.state.value != "QUEUED" for r in results):
            raise RuntimeError(f"a dispatch of {tenancy} was not queued: the limit is not applied")
        return [r.dispatch_id for r in results]

    def pass_(self) -> tuple[list[admission.Admitted], float, int]:
        """One admission pass, committed, as `tasks.admission.run_pass` runs it: what it
        admitted, its seconds and its SQL statements."""
        self.statements.clear()
        started = time.perf_counter()
        with transaction(self.rt.sessions) as session:
            admitted = admission.admit(session, self.rt.resolver.limits, now=database_now(session))
        return admitted, time.perf_counter() - started, len(self.statements)

    def end(self, dispatch_id: str) -> None:
        with transaction(self.rt.sessions) as session:
            dispatches.record_terminals(
                session, [dispatches.TerminalEvent(dispatch_id, EventType.WORKER_COMPLETED, {"output": {"ok": True}})]
            )

    def create(self, ids: Sequence[str]) -> None:
        outcomes = create_jobs_for(self.rt, ids)
        if set(outcomes.values()) != {CreateOutcome.CREATED} or len(outcomes) != len(ids):
            raise RuntimeError(f"create_jobs_for: {outcomes}")
        self.created.extend(ids)

    def admitted_one(self, admitted: list[admission.Admitted], tenancy: str) -> str:
        if len(admitted) != 1 or admitted[0].tenancy_id != tenancy:
            raise RuntimeError(f"{self.n:,} queued: a pass admitted {admitted}, expected one of {tenancy}")
        return admitted[0].dispatch_id

    @contextmanager
    def no_requests(self, what: str) -> Iterator[None]:
        before = sum(self.requests.values())
        yield
        sent = sum(self.requests.values()) - before
        if sent:
            raise RuntimeError(f"{what} sent {sent} Kubernetes API request(s): {dict(self.requests)}")

    # --- the measured steps ---

    def freed_pass(self, kind: str = "freed") -> None:
        self.end(self.holders.popleft())
        with self.no_requests("an admission pass"):
            admitted, seconds, statements = self.pass_()
        self.holders.append(self.admitted_one(admitted, LIMITED))
        self.record(f"{kind}_ms", 1000 * seconds)
        self.record(f"{kind}_statements", statements)

    def idle_pass(self) -> None:
        with self.no_requests("an admission pass"):
            admitted, seconds, statements = self.pass_()
        if admitted:
            raise RuntimeError(f"a pass with no free slot admitted {admitted}")
        self.record("idle_ms", 1000 * seconds)
        self.record("idle_statements", statements)

    def other_path(self) -> None:
        """OTHER's dispatch, a slot free: schedule -> pass -> Job created (then ended, untimed)."""
        started = time.perf_counter()
        with self.no_requests("schedule and an admission pass"):
            (dispatch_id,) = self.schedule(OTHER, 1)
            admitted, seconds, _ = self.pass_()
        self.admitted_one(admitted, OTHER)
        self.create([dispatch_id])
        self.record("other_ms", 1000 * (time.perf_counter() - started))
        self.record("other_pass_ms", 1000 * seconds)
        self.end(dispatch_id)

    def freed_path(self) -> None:
        """LIMITED's slot frees: a holder's end recorded -> pass -> the admitted one's Job created."""
        started = time.perf_counter()
        with self.no_requests("recording an end and an admission pass"):
            self.end(self.holders.popleft())
            admitted, _, _ = self.pass_()
        dispatch_id = self.admitted_one(admitted, LIMITED)
        self.create([dispatch_id])
        self.holders.append(dispatch_id)
        self.record("freed_path_ms", 1000 * (time.perf_counter() - started))

    def explained_pass(self) -> tuple[int, list[str]]:
        """A freed-slot pass's statements replayed under `EXPLAIN (ANALYZE, BUFFERS)`: the shared
        buffers they touched (hit + read), and each one's plan in a line. The pass and the
        replay are rolled back; the end that freed the slot is committed (a holder less)."""
        self.end(self.holders.popleft())
        captured: list[tuple[str, Any]] = []

        def capture(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
            captured.append((statement, parameters))

        session = self.rt.sessions()
        try:
            sa.event.listen(self.rt.engine, "before_cursor_execute", capture)
            try:
                admission.admit(session, self.rt.resolver.limits, now=database_now(session))
            finally:
                sa.event.remove(self.rt.engine, "before_cursor_execute", capture)
            session.rollback()
            blocks, plans = 0, []
            for statement, parameters in captured:
                (plan,) = (
                    session.connection()
                    .exec_driver_sql(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {statement}", parameters)
                    .scalar_one()
                )
                top = plan["Plan"]
                blocks += _blocks(top)
                plans.append(f"{_plan_line(top)} | {' '.join(statement.split())[:160]}")
            session.rollback()
        finally:
            session.close()
        admitted, _, _ = self.pass_()  # the slot freed above, filled for real
        self.holders.append(self.admitted_one(admitted, LIMITED))
        return blocks, plans


def _blocks(plan: dict[str, Any]) -> int:
    """Shared buffers a plan node touched, its children's included (EXPLAIN's totals)."""
    return int(plan.get("Shared Hit Blocks", 0)) + int(plan.get("Shared Read Blocks", 0))


def _plan_line(plan: dict[str, Any]) -> str:
    """The plan's nodes, outermost first: type, index, rows."""
    parts = []
    node: dict[str, Any] | None = plan
    while node is not None:
        index = f" {node['Index Name']}" if "Index Name" in node else ""
        parts.append(f"{node['Node Type']}{index} rows={node.get('Actual Rows', '?')}")
        children = node.get("Plans") or []
        node = children[0] if len(children) == 1 else None
    return " > ".join(parts)


@contextmanager
def _side(ctx: services.BenchContext, cluster: services.Cluster, database_url: str, *, n: int) -> Iterator[_Side]:
    """A Runtime on its own database (the limits in its resolver), its client's requests counted."""
    settings = load_settings(
        services.deployment_env(
            {
                "database_url": database_url,
                "redis_url": ctx.redis_url,
                "key_prefix": f"{ctx.key_prefix}-admission-{n}",
                "namespace": NAMESPACE,
                "kubeconfig": str(cluster.kubeconfig),
                "kube_qps": "0",
            }
        )
    )
    requests: Counter[str] = Counter()
    resolver = CapabilityResolver.from_mapping(
        {**workload.capability_config(), "limits": limits_config()}, source="<bench admission>"
    )
    kube = KubeClient(cluster.kubeconfig, on_request=lambda verb, answer: requests.update([verb]))
    with Runtime.from_settings(settings, resolver=resolver, kube=kube) as rt:
        side = _Side(n=n, rt=rt, requests=requests)

        def count(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
            if CLOCK not in statement:
                side.statements.append(statement)

        sa.event.listen(rt.engine, "before_cursor_execute", count)
        yield side


def limits_config() -> dict[str, Any]:
    return {"tenancies": {LIMITED: {"maxRunning": SLOTS}, OTHER: {"maxRunning": OTHER_SLOTS}}}


def _alternate(sides: Sequence[_Side], steps: int, step: Callable[[_Side], None]) -> None:
    """`step` on each side in turn, `steps` times, the order alternating (A B, B A, ...)."""
    for i in range(steps):
        for side in sides if i % 2 == 0 else reversed(sides):
            step(side)


def _check_requests(before: Counter[api_load.Key], after: Counter[api_load.Key], sides: Sequence[_Side]) -> int:
    """The requests the server counted over the measured phase; raises unless they are one
    create per Job created and no other."""
    sent = after - before
    creates = sum(len(side.created) for side in sides)
    if sent != Counter({POST_JOBS: creates}):
        raise RuntimeError(f"the server counted {dict(sent)} while {creates} Jobs were created (and nothing else sent)")
    return sum(sent.values())


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (`q` in 0..100)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def block_p50s(values: Sequence[float], blocks: int = BLOCKS) -> list[float]:
    """The p50 of each of `blocks` consecutive runs of `values`."""
    size = max(1, len(values) // blocks)
    return [
        percentile(values[i * size : (i + 1) * size], 50) for i in range(blocks) if values[i * size : (i + 1) * size]
    ]


def _report(
    result: BenchResult,
    small: _Side,
    big: _Side,
    buffers: dict[int, int],
    fresh: dict[int, int],
    *,
    server_requests: int,
) -> None:
    timed = {
        "fresh_ms": "admission pass, one slot freed, right after the burst (no statistics yet)",
        "freed_ms": "admission pass, one slot freed",
        "idle_ms": "admission pass, no slot free",
        "other_ms": "schedule -> Job created, another tenancy's dispatch (slot free)",
        "other_pass_ms": "  of it, the admission pass",
        "freed_path_ms": "end recorded -> Job created, the limited tenancy's next",
    }
    for side in (small, big):
        for kind, label in timed.items():
            values = side.samples[kind]
            result.figures.append(
                Figure(f"admission_{kind}_p50_{side.n}", f"{label}, {side.n:,} queued: p50", "ms", values)
            )
            result.figures.append(
                Figure(
                    f"admission_{kind}_p99_{side.n}", f"{label}, {side.n:,} queued: p99", "ms", [percentile(values, 99)]
                )
            )
        for kind, label in (
            ("fresh_statements", "one slot freed, right after the burst"),
            ("freed_statements", "one slot freed"),
            ("idle_statements", "no slot free"),
        ):
            result.figures.append(
                Figure(
                    f"admission_{kind}_{side.n}",
                    f"SQL statements per pass, {label}, {side.n:,} queued",
                    "statements",
                    side.samples[kind],
                )
            )
        result.figures.append(
            Figure(
                f"admission_buffers_{side.n}",
                f"shared buffers a freed-slot pass touches, {side.n:,} queued",
                "blocks",
                [float(buffers[side.n])],
            )
        )
        result.figures.append(
            Figure(
                f"admission_buffers_fresh_{side.n}",
                f"shared buffers a freed-slot pass touches right after the burst (no statistics yet), {side.n:,} queued",
                "blocks",
                [float(fresh[side.n])],
            )
        )
    jobs = len(small.created) + len(big.created)
    result.figures.append(
        Figure(
            "admission_requests_per_job",
            "Kubernetes API requests per Job created, the server's count (admission and schedule: none)",
            "requests",
            [server_requests / jobs if jobs else math.inf],
            REQUESTS_TARGET,
            ref="17",
        )
    )
    n, m = small.n, big.n
    pairs = {
        "freed_ms": (
            "admission_pass_ratio",
            f"admission pass (one slot freed), {m:,} / {n:,} queued (target ~1.0x)",
            RATIO_TARGET,
        ),
        "freed_statements": (
            "admission_statements_ratio",
            f"SQL statements per pass, {m:,} / {n:,} queued",
            STATEMENTS_TARGET,
        ),
        "fresh_ms": (
            "admission_fresh_pass_ratio",
            f"admission pass (one slot freed) right after the burst, no statistics yet, {m:,} / {n:,} queued",
            None,
        ),
        "idle_ms": ("admission_idle_ratio", f"admission pass (no slot free), {m:,} / {n:,} queued", None),
        "other_ms": (
            "admission_other_path_ratio",
            f"schedule -> Job, another tenancy, {m:,} / {n:,} queued",
            RATIO_TARGET,
        ),
        "freed_path_ms": ("admission_freed_path_ratio", f"end -> Job, the limited tenancy, {m:,} / {n:,} queued", None),
    }
    for kind, (name, label, target) in pairs.items():
        samples = [b / a for a, b in zip(block_p50s(small.samples[kind]), block_p50s(big.samples[kind]), strict=True)]
        result.ratios.append(Ratio(name, label, samples, target, ref="17" if target else None))
    result.ratios.append(
        Ratio(
            "admission_buffers_ratio",
            f"shared buffers per freed-slot pass, {m:,} / {n:,} queued",
            [buffers[m] / buffers[n]],
        )
    )
    result.ratios.append(
        Ratio(
            "admission_buffers_fresh_ratio",
            f"shared buffers per freed-slot pass right after the burst, no statistics yet, {m:,} / {n:,} queued",
            [fresh[m] / fresh[n]],
        )
    )
    result.notes.append(
        f"tenancy {LIMITED} maxRunning {SLOTS} (full), {OTHER} maxRunning {OTHER_SLOTS}; N written QUEUED by "
        f"scheduling.schedule_many, {CHUNK} per transaction (autovacuum off for the table until measured 'right after the burst', then VACUUM ANALYZE and autovacuum back on); a pass: store.admission.admit in its own "
        "transaction, timed to its commit; the paths: scheduling.schedule_many -> admit -> delivery.create.create_jobs_for "
        "against localcluster (simulate), without Celery's hops; ratios: p50 per block of passes, large / small"
    )
    result.notes.append(
        "admission and schedule sent no Kubernetes API request (the Runtime's client counted none; the server counted "
        f"exactly the {jobs} Job creates over the measured phase)"
    )
