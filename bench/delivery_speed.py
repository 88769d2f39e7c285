"""4. Delivery: dispatches/s end to end, and what the cross-replica guard costs per completion.

End to end: schedule -> create_job -> the Job runs (simulated, 0-50 ms) -> poll -> complete,
through the real Redis broker, one `celery -A tasks worker` process and `celery -A tasks beat`
(poll every 0.2 s), against PostgreSQL and localcluster. The two ways an engine schedules are
interleaved: `schedule_in_session` in its own transaction (create_job sent after commit) and the
Celery `schedule` task. The clock runs from the first schedule to the last terminal event.

The guard: writing a terminal event with `record_terminal` alone, against claim + write +
release (Redis SET NX PX, then a compare-and-delete script), per completion, in one thread,
the two alternating completion by completion; and claim + release alone.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from pathlib import Path
from statistics import median

import redis
import sqlalchemy as sa
from celery import Celery
from sqlalchemy.orm import Session, sessionmaker

import celeryconfig
from bench import services, workload
from bench.results import BenchResult, Figure, Ratio
from bench.sizes import Size
from bench.timing import Stopwatch, alternating, interleaved, paired_ratios, per_op_ms, rates
from engine import store
from engine.db import make_engine, make_sessionmaker, transaction
from engine.models import TERMINAL_STATES, Dispatch, DispatchState, EventType
from engine.settings import Settings, load_settings
from recovery.guard import Guard
from tasks.scheduling import schedule_in_session
from tasks.processes import wait_until
from workers.resolver import CapabilityResolver

NAMESPACE = "bench-delivery"
POLL_INTERVAL_S = 0.2
CONCURRENCY = 8


def run(ctx: services.BenchContext, size: Size) -> BenchResult:
    n = size.dispatches
    result = BenchResult(
        name="delivery",
        title="delivery: end to end through Celery, and the guard's cost",
        rounds=size.delivery_rounds,
        params={
            "dispatches_per_round": n,
            "job_durations_ms": list(workload.DURATIONS_MS),
            "poll_interval_s": POLL_INTERVAL_S,
            "worker_concurrency": CONCURRENCY,
            "guard_completions_per_round": size.guard_completions,
            "guard_rounds": size.rounds,
        },
    )
    caps = workload.resolver()
    caps_file = workload.write_capabilities(ctx.work_dir / "delivery-capabilities.yaml")
    with services.database(ctx.pg_admin_url) as database_url:
        seconds, latencies, guard_s = _measure(
            ctx, size, database_url=database_url, caps=caps, caps_file=caps_file
        )
    n, m = size.dispatches, size.guard_completions
    in_session, task = seconds["in_session"], seconds["task"]
    latency = "median dispatch latency (row written -> terminal event)"
    result.figures += [
        Figure("dispatches_per_s_in_session", "end to end, schedule_in_session", "dispatches/s", rates(n, in_session)),
        Figure("dispatches_per_s_task", "end to end, the Celery schedule task", "dispatches/s", rates(n, task)),
        Figure("latency_ms_in_session", f"{latency}, schedule_in_session", "ms", latencies["in_session"]),
        Figure("latency_ms_task", f"{latency}, schedule task", "ms", latencies["task"]),
        Figure("completion_ms_plain", "record_terminal alone, per completion", "ms", per_op_ms(m, guard_s["plain"])),
        Figure(
            "completion_ms_guarded",
            "guard claim + record_terminal + release, per completion",
            "ms",
            per_op_ms(m, guard_s["guarded"]),
        ),
        Figure("guard_ms", "guard claim + release alone (Redis)", "ms", per_op_ms(m, guard_s["guard"])),
    ]
    result.ratios += [
        Ratio(
            "task_vs_in_session_time",
            "end-to-end time, schedule task / schedule_in_session",
            paired_ratios(task, in_session),
        ),
        Ratio(
            "guarded_vs_plain_completion_time",
            "completion time, guarded / record_terminal alone",
            paired_ratios(guard_s["guarded"], guard_s["plain"]),
        ),
    ]
    result.notes.append(
        f"one worker process ({CONCURRENCY} threads) and beat; localcluster simulate mode; Jobs of 0-50 ms"
    )
    return result


def _measure(
    ctx: services.BenchContext, size: Size, *, database_url: str, caps: CapabilityResolver, caps_file: Path
) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, list[float]]]:
    """End-to-end seconds and latencies (worker and beat running), then the guard's seconds."""
    engine = make_engine(database_url)
    sessions = make_sessionmaker(engine)
    try:
        with services.cluster(ctx.work_dir, name="lc-delivery") as cluster:
            env = services.deployment_env(
                {
                    "database_url": database_url,
                    "redis_url": ctx.redis_url,
                    "key_prefix": f"{ctx.key_prefix}-delivery",
                    "namespace": NAMESPACE,
                    "kubeconfig": str(cluster.kubeconfig),
                    "capabilities": str(caps_file),
                    "poll_interval_s": str(POLL_INTERVAL_S),
                    "worker_concurrency": str(CONCURRENCY),
                    "sweep_interval_s": "3600",  # the start-up sweep only: this measures the normal path
                }
            )
            settings = load_settings(env)
            producer = Celery("bench-producer", set_as_current=False)
            producer.conf.update(celeryconfig.config(settings))
            try:
                with services.worker_and_beat(ctx.work_dir, env, concurrency=CONCURRENCY):
                    seconds, latencies = _end_to_end(
                        sessions, caps, producer, settings, n=size.dispatches, rounds=size.delivery_rounds
                    )
            finally:
                producer.close()
        # The worker and beat are stopped: the guard is timed on a quiet database.
        guard_s = _guard_cost(sessions, caps, ctx, size)
    finally:
        engine.dispose()
    return seconds, latencies, guard_s


def _end_to_end(
    sessions: sessionmaker[Session],
    caps: CapabilityResolver,
    producer: Celery,
    settings: Settings,
    *,
    n: int,
    rounds: int,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Seconds per batch of `n` dispatches, and each batch's median latency (ms), per variant."""
    latencies: dict[str, list[float]] = {"in_session": [], "task": []}

    def batch(variant: str) -> float:
        case_id = workload.new_case(sessions)
        ids = []
        with Stopwatch() as sw:
            for i in range(n):
                capability, data, key = workload.capability_for(i), workload.input_for(i), f"key-{uuid.uuid4()}"
                if variant == "task":
                    dispatch_id = str(uuid.uuid4())
                    producer.send_task(
                        celeryconfig.SCHEDULE_TASK,
                        args=[case_id, workload.TENANCY, capability, data, key],
                        kwargs={"dispatch_id": dispatch_id},
                    )
                else:
                    with transaction(sessions) as session:
                        dispatch_id = schedule_in_session(
                            session,
                            via=producer,
                            case_id=case_id,
                            tenancy_id=workload.TENANCY,
                            capability=capability,
                            input=data,
                            idempotency_key=key,
                            router=caps,
                            max_input_bytes=settings.max_input_bytes,
                        ).dispatch_id
                ids.append(dispatch_id)
            wait_until(
                lambda: _terminal_count(sessions, ids) == n, timeout=60 + n, interval=0.05, what=f"{n} terminal"
            )
        latencies[variant].append(_median_latency_ms(sessions, ids))
        return sw.seconds

    seconds = interleaved({"in_session": lambda: batch("in_session"), "task": lambda: batch("task")}, rounds=rounds)
    return seconds, latencies


def _terminal_count(sessions: sessionmaker[Session], ids: Sequence[str]) -> int:
    with transaction(sessions) as session:
        return session.scalar(
            sa.select(sa.func.count()).where(Dispatch.dispatch_id.in_(ids), Dispatch.state.in_(sorted(TERMINAL_STATES)))
        ) or 0


def _median_latency_ms(sessions: sessionmaker[Session], ids: Sequence[str]) -> float:
    """Median of finished_at - created_at; raises unless every dispatch completed successfully."""
    with transaction(sessions) as session:
        rows = session.execute(
            sa.select(Dispatch.state, Dispatch.created_at, Dispatch.finished_at).where(Dispatch.dispatch_id.in_(ids))
        ).all()
    failed = [row.state for row in rows if row.state != DispatchState.COMPLETED]
    if len(rows) != len(ids) or failed:
        raise RuntimeError(f"{len(rows)} of {len(ids)} dispatches found; not completed: {failed[:5]}")
    return median(1000 * (row.finished_at - row.created_at).total_seconds() for row in rows)


def _guard_cost(
    sessions: sessionmaker[Session], caps: CapabilityResolver, ctx: services.BenchContext, size: Size
) -> dict[str, list[float]]:
    """Seconds for `guard_completions` completions of each kind, per round.

    The plain and the guarded completion alternate dispatch by dispatch, so the database's
    commit time, which dwarfs the guard's and swings with the machine, weighs on both alike.
    """
    m = size.guard_completions
    client = redis.Redis.from_url(ctx.redis_url)
    guard = Guard(client, prefix=f"{ctx.key_prefix}-guard", lease_ms=15_000)

    def complete(dispatch_id: str) -> None:
        with transaction(sessions) as session:
            won = store.record_terminal(session, dispatch_id, EventType.WORKER_COMPLETED, {"output": {"ok": True}})
            if not won:
                raise RuntimeError(f"dispatch {dispatch_id} was terminal already")

    def complete_guarded(dispatch_id: str) -> None:
        claim = guard.claim(dispatch_id)
        if claim is None:
            raise RuntimeError(f"the claim on {dispatch_id} is held")
        try:
            complete(dispatch_id)
        finally:
            guard.release(claim)

    def claim_and_release(dispatch_id: str) -> None:
        claim = guard.claim(dispatch_id)
        if claim is None or not guard.release(claim):
            raise RuntimeError(f"the claim on {dispatch_id} did not behave")

    seconds: dict[str, list[float]] = {"plain": [], "guarded": [], "guard": []}
    try:
        for _ in range(size.rounds):
            made = workload.created_dispatches(sessions, caps, count=2 * m, namespace=NAMESPACE)
            ids = [ref.dispatch_id for ref, _ in made]
            both = alternating({"plain": complete, "guarded": complete_guarded}, ids)
            seconds["plain"].append(both["plain"])
            seconds["guarded"].append(both["guarded"])
            alone = alternating({"guard": claim_and_release}, [str(uuid.uuid4()) for _ in range(m)])
            seconds["guard"].append(alone["guard"])
    finally:
        client.close()
    return seconds
