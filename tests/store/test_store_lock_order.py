"""Row locks in one order everywhere: batches that overlap, written concurrently in opposite
orders, wait for each other and never deadlock (real PostgreSQL, where a deadlock is detected
and one transaction killed; SQLite takes one writer at a time and cannot deadlock).

Before rows were sorted, `mark_created_many` updated them in the caller's order and
`schedule_many` inserted them in the requests' order: two such batches deadlocked.
"""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa

from k8s_dispatch.store import dispatches, scheduling
from k8s_dispatch.store.db import make_sessionmaker, transaction
from k8s_dispatch.store.models import CaseEvent, Dispatch, DispatchState

MAX_INPUT_BYTES = 1000
THREADS = 4
ROUNDS = 15
BATCH = 40


@pytest.fixture
def pg_sessions(pg_url, engine_factory):
    return make_sessionmaker(engine_factory(pg_url, pool_size=THREADS + 1, max_overflow=0))


def orders(ids: list, thread: int) -> list:
    """Every id in each thread's batch, each thread's in an order of its own: even threads
    rotations of ascending order, odd ones rotations of descending order."""
    shift = thread * len(ids) // THREADS
    rotated = ids[shift:] + ids[:shift]
    return list(reversed(rotated)) if thread % 2 else rotated


def test_mark_created_many_on_overlapping_batches_in_opposite_orders_never_deadlocks(
    pg_sessions, new_case, schedule_for, race
) -> None:
    case = new_case(pg_sessions)
    rounds = [[schedule_for(pg_sessions, case).dispatch_id for _ in range(BATCH)] for _ in range(ROUNDS)]

    def mark(round_: int, thread: int) -> set[str]:
        jobs = [dispatches.CreatedJob(d, f"kd-{d}", "ns", thread) for d in orders(rounds[round_], thread)]
        with transaction(pg_sessions) as session:  # a deadlock would raise DatabaseUnavailable here
            return dispatches.mark_created_many(session, jobs)

    results = race(THREADS, ROUNDS, mark)
    assert all(marked == set(rounds[r]) for r, row in enumerate(results) for marked in row)
    with transaction(pg_sessions) as session:
        rows = dispatches.get_dispatches(session, [d for ids in rounds for d in ids])
    assert {(row.state, row.attempts) for row in rows.values()} == {(DispatchState.CREATED, THREADS - 1)}


def test_schedule_many_with_the_same_keys_in_opposite_orders_never_deadlocks(
    pg_sessions, new_case, router, race
) -> None:
    case = new_case(pg_sessions)
    keys = [[f"key-{uuid.uuid4().hex}" for _ in range(BATCH)] for _ in range(ROUNDS)]

    def schedule(round_: int, thread: int) -> dict[str, str]:
        requests = [
            scheduling.ScheduleRequest(case.case_id, case.tenancy_id, "echo", {"key": key}, key)
            for key in orders(keys[round_], thread)
        ]
        with transaction(pg_sessions) as session:  # a deadlock would raise DatabaseUnavailable here
            results = scheduling.schedule_many(session, requests, router=router, max_input_bytes=MAX_INPUT_BYTES)
        return {request.idempotency_key: result.dispatch_id for request, result in zip(requests, results, strict=True)}

    results = race(THREADS, ROUNDS, schedule)
    for round_, row in enumerate(results):
        assert all(by_key == row[0] for by_key in row), "every thread got the same dispatch for a key"
        assert set(row[0]) == set(keys[round_])
    with transaction(pg_sessions) as session:
        ids = [d for row in results for d in row[0].values()]
        assert session.scalar(
            sa.select(sa.func.count()).select_from(Dispatch).where(Dispatch.dispatch_id.in_(ids))
        ) == len(ids)
        events = session.scalar(sa.select(sa.func.count()).select_from(CaseEvent).where(CaseEvent.dispatch_id.in_(ids)))
        assert events == len(ids)  # one WORKER_SCHEDULED each: every key written once


def test_the_orders_overlap_and_differ() -> None:
    ids = list(range(8))
    seen = [orders(ids, t) for t in range(THREADS)]
    assert all(sorted(o) == ids for o in seen) and len({tuple(o) for o in seen}) == THREADS
