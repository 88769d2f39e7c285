"""Races between connections: many `record_terminal` calls for one dispatch, and many
`schedule` calls with one idempotency key. Each thread has its own connection and session,
and all are released together by a barrier."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.exc import IntegrityError

from k8s_dispatch.store import dispatches, scheduling
from k8s_dispatch.store.db import make_sessionmaker, transaction
from k8s_dispatch.store.models import (
    STATE_FOR_TERMINAL_EVENT,
    TERMINAL_EVENT_TYPES,
    CaseEvent,
    Dispatch,
    DispatchState,
    EventType,
)

TYPES = [EventType.WORKER_COMPLETED, EventType.WORKER_FAILED, EventType.WORKER_CANCELLED]


def _terminal_race(url: str, *, threads: int, rounds: int, engine_factory, new_case, schedule_for, race) -> None:
    sm = make_sessionmaker(engine_factory(url, pool_size=threads + 1, max_overflow=0))
    case = new_case(sm)
    dispatch_ids = [schedule_for(sm, case).dispatch_id for _ in range(rounds)]

    def finish(round_: int, thread: int) -> bool:
        payload = {"reason": f"Thread{thread}", "output": {"thread": thread}}
        with transaction(sm) as session:
            return dispatches.record_terminal(session, dispatch_ids[round_], TYPES[thread % 3], payload)

    results = race(threads, rounds, finish)

    winners = [[thread for thread, won in enumerate(row) if won] for row in results]
    assert [len(w) for w in winners] == [1] * rounds, "exactly one winner per dispatch"
    with transaction(sm) as session:
        terminal_counts = dict(
            session.execute(
                sa.select(CaseEvent.dispatch_id, sa.func.count())
                .where(CaseEvent.dispatch_id.in_(dispatch_ids), CaseEvent.type.in_(sorted(TERMINAL_EVENT_TYPES)))
                .group_by(CaseEvent.dispatch_id)
            ).all()
        )
        rows = dispatches.get_dispatches(session, dispatch_ids)
        events = {d: dispatches.terminal_event(session, d) for d in dispatch_ids}
    assert terminal_counts == {d: 1 for d in dispatch_ids}, "exactly one terminal event per dispatch"
    for dispatch_id, (winner,) in zip(dispatch_ids, winners, strict=True):
        dispatch, event = rows[dispatch_id], events[dispatch_id]
        assert event is not None and event.payload["output"] == {"thread": winner}
        assert event.type == TYPES[winner % 3]
        assert (dispatch.state, dispatch.reason, dispatch.output) == (
            STATE_FOR_TERMINAL_EVENT[TYPES[winner % 3]],
            f"Thread{winner}",
            {"thread": winner},
        )


def test_sixteen_connections_finish_the_same_dispatch_one_wins_postgresql(
    pg_url, engine_factory, new_case, schedule_for, race
) -> None:
    _terminal_race(
        pg_url,
        threads=16,
        rounds=50,
        engine_factory=engine_factory,
        new_case=new_case,
        schedule_for=schedule_for,
        race=race,
    )


def test_eight_connections_finish_the_same_dispatch_one_wins_sqlite(
    sqlite_url, engine_factory, new_case, schedule_for, race
) -> None:
    _terminal_race(
        sqlite_url,
        threads=8,
        rounds=10,
        engine_factory=engine_factory,
        new_case=new_case,
        schedule_for=schedule_for,
        race=race,
    )


@pytest.mark.parametrize("rounds", [10])
def test_eight_connections_schedule_one_key_one_dispatch(
    db_url, rounds: int, engine_factory, new_case, router, race
) -> None:
    threads = 8
    engine = engine_factory(db_url, pool_size=threads + 1, max_overflow=0)
    sm = make_sessionmaker(engine)
    case = new_case(sm)
    collisions = []  # observed, not altered: proof that inserts really collided

    @event.listens_for(engine, "after_cursor_execute")
    def _seen(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        # The insert skips a row whose key another transaction holds (ON CONFLICT DO NOTHING):
        # it inserted nothing. An IntegrityError would be a collision too.
        if statement.startswith("INSERT INTO dispatches") and cursor.rowcount == 0:
            collisions.append(statement)

    @event.listens_for(engine, "handle_error")
    def _failed(context: Any) -> None:
        if isinstance(context.sqlalchemy_exception, IntegrityError):
            collisions.append(context.original_exception)

    keys = [f"race-{uuid.uuid4().hex}" for _ in range(rounds)]

    def schedule(round_: int, thread: int) -> tuple[str, scheduling.ScheduleResult]:
        proposed = str(uuid.uuid4())  # every thread proposes its own id: only one can stick
        with transaction(sm) as session:
            result = scheduling.schedule(
                session,
                case_id=case.case_id,
                tenancy_id=case.tenancy_id,
                capability="echo",
                input={"round": round_},
                idempotency_key=keys[round_],
                router=router,
                max_input_bytes=1000,
                dispatch_id=proposed,
            )
        return proposed, result

    results: list[list[Any]] = race(threads, rounds, schedule)

    with transaction(sm) as session:
        rows = session.execute(
            sa.select(Dispatch.idempotency_key, Dispatch.dispatch_id).where(Dispatch.tenancy_id == case.tenancy_id)
        ).all()
        scheduled = (
            session.execute(
                sa.select(CaseEvent.dispatch_id).where(
                    CaseEvent.case_id == case.case_id, CaseEvent.type == EventType.WORKER_SCHEDULED
                )
            )
            .scalars()
            .all()
        )
    if engine.dialect.name == "postgresql":  # SQLite's BEGIN IMMEDIATE serialises instead
        assert collisions, "no insert collided: the race did not happen"
    stored = dict(rows)
    assert len(rows) == rounds and set(stored) == set(keys), "one dispatch per key"
    assert sorted(scheduled) == sorted(stored.values()), "one WORKER_SCHEDULED per dispatch"
    for round_, row in enumerate(results):
        created = [proposed for proposed, result in row if result.created]
        assert created == [stored[keys[round_]]], "exactly one call created it, with its own id"
        assert {result.dispatch_id for _, result in row} == {stored[keys[round_]]}
        assert {result.state for _, result in row} == {DispatchState.SCHEDULED}
