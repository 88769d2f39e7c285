"""`schedule_many`: a batch is written all or nothing, with one INSERT per table and one read of
its idempotency keys, and a repeated request (in an earlier batch, or earlier in the same
one) is the dispatch already there."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import event

from k8s_dispatch.core.errors import IdempotencyConflict, InputTooLarge, InvalidId, UnknownCapability, UnknownCase
from k8s_dispatch.store import scheduling
from k8s_dispatch.store.db import make_sessionmaker, transaction
from k8s_dispatch.store.models import CaseEvent, Dispatch, DispatchState, EventType

MAX_INPUT_BYTES = 1000


def req(case, key: str | None = None, **overrides: Any) -> scheduling.ScheduleRequest:
    fields = dict(
        case_id=case.case_id,
        tenancy_id=case.tenancy_id,
        capability="echo",
        input={"n": 1},
        idempotency_key=key or f"key-{uuid.uuid4()}",
    )
    return scheduling.ScheduleRequest(**{**fields, **overrides})


def schedule_many(sm, requests, router) -> list[scheduling.ScheduleResult]:
    with transaction(sm) as session:
        return scheduling.schedule_many(session, requests, router=router, max_input_bytes=MAX_INPUT_BYTES)


@pytest.mark.parametrize(
    "bad, error",
    [
        (dict(capability="no.such"), UnknownCapability),
        (dict(input={"big": "x" * MAX_INPUT_BYTES}), InputTooLarge),
        (dict(case_id="no-such-case"), UnknownCase),
        (dict(dispatch_id="not-a-uuid"), InvalidId),
    ],
    ids=["capability", "input", "case", "dispatch_id"],
)
def test_one_bad_request_writes_nothing_of_its_batch(db_sessionmaker, new_case, router, count_rows, bad, error) -> None:
    case = new_case(db_sessionmaker)
    before = count_rows(db_sessionmaker)
    requests = [req(case) for _ in range(5)]
    requests[3] = req(case, **bad)
    with pytest.raises(error):
        schedule_many(db_sessionmaker, requests, router)
    assert count_rows(db_sessionmaker) == before


def test_a_key_used_for_another_request_refuses_the_batch(db_sessionmaker, new_case, router, count_rows) -> None:
    case = new_case(db_sessionmaker)
    (_first,) = schedule_many(db_sessionmaker, [req(case, "taken", input={"n": 1})], router)
    before = count_rows(db_sessionmaker)
    with pytest.raises(IdempotencyConflict):
        schedule_many(db_sessionmaker, [req(case), req(case, "taken", input={"n": 2})], router)
    with pytest.raises(IdempotencyConflict):  # the same key twice in one batch, two inputs
        schedule_many(db_sessionmaker, [req(case, "twice", input={"n": 1}), req(case, "twice", input={"n": 2})], router)
    with pytest.raises(InvalidId):  # one proposed id for two keys
        same_id = str(uuid.uuid4())
        schedule_many(db_sessionmaker, [req(case, dispatch_id=same_id), req(case, dispatch_id=same_id)], router)
    assert count_rows(db_sessionmaker) == before


def test_repeats_within_and_across_batches_are_one_dispatch_each(db_sessionmaker, new_case, router) -> None:
    case = new_case(db_sessionmaker)
    (old,) = schedule_many(db_sessionmaker, [req(case, "old", input={"a": [1, 2]})], router)
    results = schedule_many(
        db_sessionmaker,
        [req(case, "new"), req(case, "old", input={"a": (1, 2)}), req(case, "new"), req(case, "other")],
        router,
    )
    new, old_again, new_again, other = results
    assert [r.created for r in results] == [True, False, False, True]
    assert old_again == scheduling.ScheduleResult(old.dispatch_id, created=False, state=DispatchState.SCHEDULED)
    assert new_again.dispatch_id == new.dispatch_id and other.dispatch_id != new.dispatch_id
    with transaction(db_sessionmaker) as session:
        rows = session.scalars(sa.select(Dispatch).where(Dispatch.case_id == case.case_id)).all()
        events = session.scalars(sa.select(CaseEvent).where(CaseEvent.case_id == case.case_id)).all()
    assert sorted(r.idempotency_key for r in rows) == ["new", "old", "other"]
    assert sorted(e.dispatch_id for e in events if e.type == EventType.WORKER_SCHEDULED) == sorted(
        r.dispatch_id for r in rows
    )


@pytest.fixture
def statements(pg_url, engine_factory) -> Iterator[tuple[Any, list[str]]]:
    """Sessions on the real PostgreSQL database and the statements they send (observed only)."""
    engine = engine_factory(pg_url)
    seen: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda conn, cursor, statement, *rest: seen.append(statement))
    yield make_sessionmaker(engine), seen


def test_a_batch_is_one_insert_per_table_and_one_read_of_its_keys(statements, new_case, router) -> None:
    sm, seen = statements
    case = new_case(sm)
    (earlier,) = schedule_many(sm, [req(case, "earlier")], router)
    seen.clear()
    results = schedule_many(sm, [req(case, "earlier")] + [req(case) for _ in range(60)], router)
    assert sum(r.created for r in results) == 60 and results[0].dispatch_id == earlier.dispatch_id

    def count(prefix: str) -> int:
        return sum(s.lstrip().upper().startswith(prefix) for s in seen)

    assert count("INSERT INTO DISPATCHES") == 1
    assert count("INSERT INTO CASE_EVENTS") == 1
    # One statement carries the 60 rows (the parameters of the 60th row are in it), not an
    # executemany sending one INSERT per row.
    inserts = [s for s in seen if s.startswith("INSERT")]
    assert all("__59)s" in s and "__60)s" not in s for s in inserts), inserts
    assert count("SELECT DISPATCHES.") == 1  # the keys; a fresh uuid4 is never looked up
    assert count("SELECT") == 2  # and the cases
