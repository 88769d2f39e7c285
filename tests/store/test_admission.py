"""Admission (`store.admission`) on a database of its own per test, PostgreSQL and SQLite: a
limit queues, a pass admits up to it in order, an end frees the slot, concurrent passes never
fill a slot twice, and a pass's statements do not grow with what waits."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from k8s_dispatch.core.limits import Limits, TenancyLimit
from k8s_dispatch.store import admission, dispatches, migrate, scheduling
from k8s_dispatch.store.db import database_now, make_engine, make_sessionmaker, transaction
from k8s_dispatch.store.models import Dispatch, DispatchState, EventType
from tests.store.conftest import MAX_INPUT_BYTES, StaticRouter, run_concurrently


class LimitedRouter(StaticRouter):
    def __init__(self, limits: Limits) -> None:
        super().__init__({"echo": "w", "sleep": "w"})
        self.limits = limits


@pytest.fixture(params=["postgresql", "sqlite"])
def sm(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sessionmaker[Session]]:
    """Sessions on an empty database of this test alone (admission reads every queue)."""
    if request.param == "postgresql":
        url = request.getfixturevalue("new_pg_database")()
    else:
        url = f"sqlite:///{tmp_path / 'admission.db'}"
    yield from _sessions(url)


@pytest.fixture
def pg_sm(new_pg_database: Callable[[], str]) -> Iterator[sessionmaker[Session]]:
    """The same on PostgreSQL alone: SQLite has one writer at a time, no passes to race."""
    yield from _sessions(new_pg_database())


def _sessions(url: str) -> Iterator[sessionmaker[Session]]:
    migrate.upgrade(url)
    engine = make_engine(url)
    yield make_sessionmaker(engine)
    engine.dispose()


def schedule(sm: sessionmaker[Session], router: LimitedRouter, tenancy: str, n: int, **kw: Any) -> list[str]:
    case_id = f"case-{uuid.uuid4().hex[:8]}"
    with transaction(sm) as session:
        scheduling.create_case(session, case_id=case_id, tenancy_id=tenancy)
    with transaction(sm) as session:
        results = scheduling.schedule_many(
            session,
            [scheduling.ScheduleRequest(case_id, tenancy, kw.get("capability", "echo"), {"i": i}, f"k-{uuid.uuid4()}",
                                   priority=kw.get("priority", 0)) for i in range(n)],
            router=router, max_input_bytes=MAX_INPUT_BYTES,
        )  # fmt: skip
    return [r.dispatch_id for r in results]


def admit(sm: sessionmaker[Session], limits: Limits) -> list[str]:
    with transaction(sm) as session:
        return [a.dispatch_id for a in admission.admit(session, limits, now=database_now(session))]


def states(sm: sessionmaker[Session], ids: list[str]) -> list[DispatchState]:
    with transaction(sm) as session:
        rows = dispatches.get_dispatches(session, ids)
        return [DispatchState(rows[d].state) for d in ids]


def end(sm: sessionmaker[Session], ids: list[str], type: EventType = EventType.WORKER_COMPLETED) -> None:
    with transaction(sm) as session:
        dispatches.record_terminals(session, [dispatches.TerminalEvent(d, type, {"output": 1}) for d in ids])


LIMITS = Limits(tenancies={"acme": TenancyLimit(2)})


def test_a_limit_queues_a_pass_admits_up_to_it_in_order_and_an_end_frees_a_slot(sm) -> None:
    router = LimitedRouter(LIMITS)
    ids = schedule(sm, router, "acme", 5)
    free = schedule(sm, router, "other", 1)
    assert states(sm, ids) == [DispatchState.QUEUED] * 5
    assert states(sm, free) == [DispatchState.SCHEDULED]  # no limit covers it: created as before
    first = admit(sm, LIMITS)
    assert sorted(first) == sorted(ids)[:2]  # one transaction, one time: then by id
    assert admit(sm, LIMITS) == []  # full
    with transaction(sm) as session:
        rows = dispatches.get_dispatches(session, first)
        assert all(r.admitted_at is not None for r in rows.values())
    end(sm, first[:1])
    assert len(admit(sm, LIMITS)) == 1
    end(sm, first[1:], EventType.WORKER_FAILED)
    assert admit(sm, LIMITS) == []  # a failure's slot is held while its Job may still run
    with transaction(sm) as session:
        assert dispatches.mark_jobs_stopped(session, first[1:]) == set(first[1:])  # the sweep saw it gone
    assert len(admit(sm, LIMITS)) == 1
    assert states(sm, ids).count(DispatchState.QUEUED) == 1


def test_a_cancel_holds_its_slot_until_its_job_is_seen_stopped_and_only_once(sm) -> None:
    limits = Limits(tenancies={"acme": TenancyLimit(1)})
    ids = schedule(sm, LimitedRouter(limits), "acme", 3)
    (first,) = admit(sm, limits)
    end(sm, [first], EventType.WORKER_CANCELLED)  # the cancel's message lost: its Job may run on
    assert admit(sm, limits) == []
    with transaction(sm) as session:
        (summary,) = admission.summary(session)
        assert (summary.running, summary.queued) == (1, 2)
        assert dispatches.mark_jobs_stopped(session, [first]) == {first}
    with transaction(sm) as session:
        assert dispatches.mark_jobs_stopped(session, [first]) == set()  # once
    (second,) = admit(sm, limits)
    end(sm, [second])  # a completion is read from a finished Job: its slot frees at once
    assert len(admit(sm, limits)) == 1
    assert states(sm, ids).count(DispatchState.QUEUED) == 0


def test_a_queued_dispatch_can_be_cancelled_and_holds_no_slot(sm) -> None:
    router = LimitedRouter(LIMITS)
    ids = schedule(sm, router, "acme", 3)
    end(sm, ids[:1], EventType.WORKER_CANCELLED)
    assert states(sm, ids[:1]) == [DispatchState.CANCELLED]
    assert sorted(admit(sm, LIMITS)) == sorted(ids[1:])


def test_paused_at_zero_then_resumed(sm) -> None:
    paused = Limits(tenancies={"acme": TenancyLimit(0)})
    ids = schedule(sm, LimitedRouter(paused), "acme", 3)
    assert admit(sm, paused) == []
    assert sorted(admit(sm, Limits(tenancies={"acme": TenancyLimit(3)}))) == sorted(ids)


def test_priority_first_then_first_in_and_the_place_in_the_queue(sm) -> None:
    router = LimitedRouter(LIMITS)
    low = schedule(sm, router, "acme", 1)
    high = schedule(sm, router, "acme", 1, priority=5)
    later = schedule(sm, router, "acme", 1)
    with transaction(sm) as session:
        assert [admission.place(session, d) for d in (*high, *low, *later)] == [1, 2, 3]
    assert admit(sm, LIMITS) == [*high, *low]
    with transaction(sm) as session:
        assert admission.place(session, later[0]) == 1
        assert admission.place(session, low[0]) is None  # admitted: in no queue
        (summary,) = admission.summary(session)
    assert (summary.tenancy_id, summary.running, summary.queued) == ("acme", 2, 1)
    assert summary.oldest_queued_at is not None


def test_rows_an_engine_wrote_as_queued_with_no_limit_are_admitted(sm) -> None:
    ids = schedule(sm, LimitedRouter(LIMITS), "acme", 3)
    assert sorted(admit(sm, Limits())) == sorted(ids)  # limits removed since: nothing holds them back


def test_concurrent_passes_never_fill_a_slot_twice(pg_sm) -> None:
    sm = pg_sm
    limits = Limits(tenancies={"acme": TenancyLimit(5)}, capabilities={"sleep": 3})
    router = LimitedRouter(limits)
    ids = schedule(sm, router, "acme", 30) + schedule(sm, router, "beta", 10, capability="sleep")

    def race() -> int:
        (admitted,) = run_concurrently(8, 1, lambda _round, _thread: admit(sm, limits))
        got = [d for ids in admitted for d in ids]
        assert len(got) == len(set(got))
        return len(got)

    assert race() == 5 + 3  # acme's 5 of echo; beta's 3 of sleep
    with transaction(sm) as session:
        holding = session.scalars(sa.select(Dispatch.dispatch_id).where(Dispatch.state == DispatchState.SCHEDULED))
        admitted = list(holding)
    end(sm, admitted[:4])
    assert race() == 4
    assert states(sm, ids).count(DispatchState.SCHEDULED) == 8


def statements(sm: sessionmaker[Session], run: Callable[[], object]) -> int:
    count = 0

    def counted(*_: object) -> None:
        nonlocal count
        count += 1

    engine = sm.kw["bind"]
    sa.event.listen(engine, "before_cursor_execute", counted)
    try:
        run()
    finally:
        sa.event.remove(engine, "before_cursor_execute", counted)
    return count


def test_a_pass_costs_the_same_statements_with_ten_or_two_thousand_waiting(sm) -> None:
    router = LimitedRouter(LIMITS)
    schedule(sm, router, "acme", 10)
    small = statements(sm, lambda: admit(sm, LIMITS))
    end(sm, admitted_ids(sm))
    schedule(sm, router, "acme", 2000)
    large = statements(sm, lambda: admit(sm, LIMITS))
    assert small == large


def admitted_ids(sm: sessionmaker[Session]) -> list[str]:
    with transaction(sm) as session:
        return list(session.scalars(sa.select(Dispatch.dispatch_id).where(Dispatch.state == DispatchState.SCHEDULED)))


def test_the_queue_clock_counts_from_admission_not_from_the_turns_wait(sm) -> None:
    from k8s_dispatch.delivery import queue_clock

    router = LimitedRouter(LIMITS)
    (waited,) = schedule(sm, router, "acme", 1)
    (direct,) = schedule(sm, router, "other", 1)  # no limit: its clock runs from scheduling
    with transaction(sm) as session:  # both scheduled an hour ago; the limited one admitted now
        session.execute(
            sa.update(Dispatch)
            .where(Dispatch.dispatch_id.in_([waited, direct]))
            .values(created_at=database_now(session) - timedelta(hours=1))
        )
    assert admit(sm, LIMITS) == [waited]
    assert not queue_clock.queue_expired(sm, waited, timeout_s=600)  # admitted a moment ago
    assert queue_clock.queue_expired(sm, direct, timeout_s=600)
