"""The read helpers the tasks and the recovery sweep use: batched lookups, keyset pages,
state counts. The session databases are shared, so each test looks at its own rows."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest

from k8s_dispatch.store import dispatches, scheduling
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import DispatchState, EventType

Schedule = Callable[..., scheduling.ScheduleResult]
T0 = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)


def test_get_dispatches_returns_those_that_exist_across_batches(
    db_sessionmaker, new_case, schedule_for: Schedule
) -> None:
    case = new_case(db_sessionmaker)
    ids = [schedule_for(db_sessionmaker, case).dispatch_id for _ in range(3)]
    missing = [str(uuid.uuid4()) for _ in range(dispatches.QUERY_BATCH * 2)]  # forces three IN queries
    with transaction(db_sessionmaker) as session:
        found = dispatches.get_dispatches(session, missing[:700] + ids + missing[700:] + ids[:1])
        assert dispatches.get_dispatches(session, []) == {}
    assert sorted(found) == sorted(ids)
    assert all(found[i].dispatch_id == i and found[i].case_id == case.case_id for i in ids)


def test_iter_dispatches_pages_by_id_and_filters_by_state_and_age(
    db_sessionmaker, new_case, schedule_for: Schedule
) -> None:
    case = new_case(db_sessionmaker)
    old = [schedule_for(db_sessionmaker, case, now=T0 + timedelta(seconds=i)).dispatch_id for i in range(5)]
    new = [schedule_for(db_sessionmaker, case, now=T0 + timedelta(hours=1)).dispatch_id for _ in range(2)]
    created = schedule_for(db_sessionmaker, case, now=T0).dispatch_id
    finished = schedule_for(db_sessionmaker, case, now=T0).dispatch_id
    with transaction(db_sessionmaker) as session:
        dispatches.mark_created(session, created, job_name="j", namespace="ns", attempt=1, now=T0)
        dispatches.record_terminal(session, finished, EventType.WORKER_FAILED, {}, now=T0)
    mine = set(old + new + [created, finished])

    def listed(**kwargs) -> list[str]:
        with transaction(db_sessionmaker) as session:
            everything = [d.dispatch_id for d in dispatches.iter_dispatches(session, **kwargs)]
        assert everything == sorted(everything) and len(set(everything)) == len(everything)
        return [d for d in everything if d in mine]

    assert listed(states=[DispatchState.SCHEDULED], batch=2) == sorted(old + new)
    assert listed(states=["SCHEDULED"], older_than=T0 + timedelta(minutes=1), batch=2) == sorted(old)
    assert listed(
        states=[DispatchState.SCHEDULED, DispatchState.CREATED], older_than=T0 + timedelta(seconds=3), batch=1
    ) == sorted([*old[:3], created])
    assert listed(states=[DispatchState.FAILED], batch=500) == [finished]
    assert listed(states=[]) == []
    with transaction(db_sessionmaker) as session, pytest.raises(ValueError):
        list(dispatches.iter_dispatches(session, states=["NOT_A_STATE"]))


def test_counts_by_state_counts_every_state(db_sessionmaker, new_case, schedule_for: Schedule) -> None:
    with transaction(db_sessionmaker) as session:
        before = dispatches.counts_by_state(session)
    assert set(before) == {s.value for s in DispatchState}
    case = new_case(db_sessionmaker)
    ids = [schedule_for(db_sessionmaker, case).dispatch_id for _ in range(4)]
    with transaction(db_sessionmaker) as session:
        dispatches.mark_created(session, ids[0], job_name="j", namespace="ns", attempt=1)
        dispatches.record_terminal(session, ids[1], EventType.WORKER_COMPLETED, {})
        dispatches.record_terminal(session, ids[2], EventType.WORKER_CANCELLED, {})
    with transaction(db_sessionmaker) as session:
        after = dispatches.counts_by_state(session)
    delta = {state: after[state] - before[state] for state in after}
    assert delta == {"QUEUED": 0, "SCHEDULED": 1, "CREATED": 1, "COMPLETED": 1, "FAILED": 0, "CANCELLED": 1}


def test_events_for_and_terminal_event(db_sessionmaker, new_case, schedule_for: Schedule) -> None:
    result = schedule_for(db_sessionmaker, new_case(db_sessionmaker))
    with transaction(db_sessionmaker) as session:
        assert dispatches.terminal_event(session, result.dispatch_id) is None
        assert dispatches.record_terminal(session, result.dispatch_id, EventType.WORKER_FAILED, {"reason": "OOMKilled"})
    with transaction(db_sessionmaker) as session:
        events = dispatches.events_for(session, result.dispatch_id)
        terminal = dispatches.terminal_event(session, result.dispatch_id)
        assert dispatches.events_for(session, str(uuid.uuid4())) == []
        assert dispatches.get_dispatch(session, str(uuid.uuid4())) is None
    assert [e.type for e in events] == [EventType.WORKER_SCHEDULED, EventType.WORKER_FAILED]
    assert terminal is not None and terminal.id == events[1].id and terminal.payload == {"reason": "OOMKilled"}
