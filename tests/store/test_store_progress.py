"""A dispatch's progress after scheduling: `mark_created`, `record_terminal`,
and the unique indexes that make one terminal event per dispatch a fact of the database."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from k8s_dispatch.core.errors import InputNotSerialisable, InvalidInput, UnknownDispatch
from k8s_dispatch.store import dispatches, scheduling
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import CaseEvent, CaseInstance, DispatchState, EventType

Schedule = Callable[..., scheduling.ScheduleResult]
T0 = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)


def _dispatch(sm, dispatch_id: str):
    with transaction(sm) as session:
        dispatch = dispatches.get_dispatch(session, dispatch_id)
    assert dispatch is not None
    return dispatch


# --- mark_created -----------------------------------------------------------------------


def test_mark_created_records_the_job(db_sessionmaker, new_case, schedule_for: Schedule) -> None:
    result = schedule_for(db_sessionmaker, new_case(db_sessionmaker), now=T0)
    at = T0 + timedelta(seconds=5)
    with transaction(db_sessionmaker) as session:
        assert dispatches.mark_created(
            session, result.dispatch_id, job_name="job-a", namespace="ns-a", attempt=1, now=at
        )
    dispatch = _dispatch(db_sessionmaker, result.dispatch_id)
    assert (dispatch.state, dispatch.job_name, dispatch.job_namespace, dispatch.attempts) == (
        DispatchState.CREATED,
        "job-a",
        "ns-a",
        1,
    )
    assert dispatch.job_created_at == at and dispatch.updated_at == at and dispatch.created_at == T0


def test_mark_created_again_is_harmless_and_attempts_never_go_down(
    db_sessionmaker, new_case, schedule_for: Schedule
) -> None:
    result = schedule_for(db_sessionmaker, new_case(db_sessionmaker))
    with transaction(db_sessionmaker) as session:
        assert dispatches.mark_created(session, result.dispatch_id, job_name="job-2", namespace="ns", attempt=2)
    with transaction(db_sessionmaker) as session:
        assert dispatches.mark_created(session, result.dispatch_id, job_name="job-2", namespace="ns", attempt=1)
    dispatch = _dispatch(db_sessionmaker, result.dispatch_id)
    assert (dispatch.state, dispatch.attempts, dispatch.job_name) == (DispatchState.CREATED, 2, "job-2")


def test_mark_created_after_the_end_changes_nothing(db_sessionmaker, new_case, schedule_for: Schedule) -> None:
    result = schedule_for(db_sessionmaker, new_case(db_sessionmaker))
    with transaction(db_sessionmaker) as session:
        assert dispatches.record_terminal(
            session, result.dispatch_id, EventType.WORKER_CANCELLED, {"reason": "Cancelled"}
        )
    before = _dispatch(db_sessionmaker, result.dispatch_id)
    with transaction(db_sessionmaker) as session:
        assert not dispatches.mark_created(session, result.dispatch_id, job_name="late", namespace="ns", attempt=3)
    after = _dispatch(db_sessionmaker, result.dispatch_id)
    assert (after.state, after.job_name, after.attempts, after.updated_at) == (
        DispatchState.CANCELLED,
        None,
        0,
        before.updated_at,
    )


def test_mark_created_many_marks_a_mixed_batch_and_leaves_terminal_rows_alone(
    db_sessionmaker, new_case, schedule_for: Schedule
) -> None:
    case_id = new_case(db_sessionmaker)
    fresh, again, ended = (schedule_for(db_sessionmaker, case_id).dispatch_id for _ in range(3))
    with transaction(db_sessionmaker) as session:
        assert dispatches.mark_created(session, again, job_name="job-again", namespace="ns", attempt=5)
        assert dispatches.record_terminal(session, ended, EventType.WORKER_CANCELLED, {"reason": "Cancelled"})
    jobs = [
        dispatches.CreatedJob(fresh, "job-fresh", "ns-a", 0),
        dispatches.CreatedJob(again, "job-again", "ns", 1),  # an adopted Job: attempts stay at 5
        dispatches.CreatedJob(ended, "job-ended", "ns", 0),
    ]
    with transaction(db_sessionmaker) as session:
        assert dispatches.mark_created_many(session, jobs) == {fresh, again}
    assert (_dispatch(db_sessionmaker, fresh).state, _dispatch(db_sessionmaker, fresh).job_namespace) == (
        DispatchState.CREATED,
        "ns-a",
    )
    assert _dispatch(db_sessionmaker, again).attempts == 5
    assert (_dispatch(db_sessionmaker, ended).state, _dispatch(db_sessionmaker, ended).job_name) == (
        DispatchState.CANCELLED,
        None,
    )
    with transaction(db_sessionmaker) as session:
        assert dispatches.mark_created_many(session, []) == set()
        with pytest.raises(UnknownDispatch):
            dispatches.mark_created_many(
                session,
                [dispatches.CreatedJob(fresh, "j", "ns", 0), dispatches.CreatedJob(str(uuid.uuid4()), "j", "ns", 0)],
            )


def test_unknown_dispatch_is_refused_by_every_update(db_sessionmaker) -> None:
    missing = str(uuid.uuid4())
    with transaction(db_sessionmaker) as session:
        with pytest.raises(UnknownDispatch):
            dispatches.mark_created(session, missing, job_name="j", namespace="n", attempt=1)
        with pytest.raises(UnknownDispatch):
            dispatches.record_terminal(session, missing, EventType.WORKER_COMPLETED, {})


# --- record_terminal -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("event_type", "state"),
    [
        (EventType.WORKER_COMPLETED, DispatchState.COMPLETED),
        (EventType.WORKER_FAILED, DispatchState.FAILED),
        (EventType.WORKER_CANCELLED, DispatchState.CANCELLED),
    ],
)
def test_the_winner_writes_the_event_and_updates_dispatch_and_case(
    db_sessionmaker, new_case, schedule_for: Schedule, event_type: EventType, state: DispatchState
) -> None:
    case = new_case(db_sessionmaker)
    result = schedule_for(db_sessionmaker, case, now=T0)
    at = T0 + timedelta(minutes=3)
    payload = {"reason": "BackoffLimitExceeded", "output": {"lines": ["a", "b"], "code": 3}, "pod": "p-1"}
    with transaction(db_sessionmaker) as session:
        assert dispatches.record_terminal(session, result.dispatch_id, event_type, payload, now=at)

    with transaction(db_sessionmaker) as session:
        dispatch = dispatches.get_dispatch(session, result.dispatch_id)
        event = dispatches.terminal_event(session, result.dispatch_id)
        case_row = session.get(CaseInstance, case.case_id)
    assert dispatch is not None and event is not None and case_row is not None
    assert (dispatch.state, dispatch.reason, dispatch.output) == (
        state,
        "BackoffLimitExceeded",
        {"lines": ["a", "b"], "code": 3},
    )
    assert dispatch.finished_at == at and dispatch.updated_at == at and dispatch.terminal
    assert (event.type, event.case_id, event.payload, event.created_at) == (event_type, case.case_id, payload, at)
    assert case_row.updated_at == at


def test_a_payload_without_reason_or_output_leaves_them_empty(
    db_sessionmaker, new_case, schedule_for: Schedule
) -> None:
    result = schedule_for(db_sessionmaker, new_case(db_sessionmaker))
    with transaction(db_sessionmaker) as session:
        assert dispatches.record_terminal(session, result.dispatch_id, EventType.WORKER_COMPLETED, {})
    dispatch = _dispatch(db_sessionmaker, result.dispatch_id)
    assert (dispatch.state, dispatch.reason, dispatch.output) == (DispatchState.COMPLETED, None, None)


def test_a_second_terminal_event_loses_and_writes_nothing(
    db_sessionmaker, new_case, schedule_for: Schedule, count_rows
) -> None:
    case = new_case(db_sessionmaker)
    result = schedule_for(db_sessionmaker, case)
    with transaction(db_sessionmaker) as session:
        assert dispatches.record_terminal(session, result.dispatch_id, EventType.WORKER_COMPLETED, {"output": {"n": 1}})
    before_rows, before = count_rows(db_sessionmaker), _dispatch(db_sessionmaker, result.dispatch_id)
    for event_type in (EventType.WORKER_COMPLETED, EventType.WORKER_FAILED, EventType.WORKER_CANCELLED):
        with transaction(db_sessionmaker) as session:
            assert not dispatches.record_terminal(
                session, result.dispatch_id, event_type, {"reason": "Late", "output": {"n": 2}}
            )
    after = _dispatch(db_sessionmaker, result.dispatch_id)
    assert count_rows(db_sessionmaker) == before_rows
    assert (after.state, after.reason, after.output, after.finished_at) == (
        DispatchState.COMPLETED,
        None,
        {"n": 1},
        before.finished_at,
    )


BAD_TERMINALS: list[tuple[str, Any, Any, type[Exception]]] = [
    ("scheduled-is-not-terminal", EventType.WORKER_SCHEDULED, {}, InvalidInput),
    ("not-an-event-type", "WORKER_EXPLODED", {}, InvalidInput),
    ("payload-not-object", EventType.WORKER_FAILED, ["reason"], InputNotSerialisable),
    ("payload-nan", EventType.WORKER_FAILED, {"output": float("nan")}, InputNotSerialisable),
    ("payload-int-key", EventType.WORKER_FAILED, {"output": {1: 2}}, InputNotSerialisable),
    ("reason-not-str", EventType.WORKER_FAILED, {"reason": 42}, InvalidInput),
]


@pytest.mark.parametrize(
    ("event_type", "payload", "error"), [b[1:] for b in BAD_TERMINALS], ids=[b[0] for b in BAD_TERMINALS]
)
def test_a_bad_terminal_request_is_refused_and_writes_nothing(
    db_sessionmaker, new_case, schedule_for: Schedule, count_rows, event_type: Any, payload: Any, error: type[Exception]
) -> None:
    result = schedule_for(db_sessionmaker, new_case(db_sessionmaker))
    before = count_rows(db_sessionmaker)
    with transaction(db_sessionmaker) as session, pytest.raises(error):
        dispatches.record_terminal(session, result.dispatch_id, event_type, payload)
    assert count_rows(db_sessionmaker) == before
    assert _dispatch(db_sessionmaker, result.dispatch_id).state is DispatchState.SCHEDULED


# --- the indexes themselves, without our code ------------------------------------------------


def _raw_event(session, case_id: str, dispatch_id: str, event_type: str) -> None:
    session.execute(sa.insert(CaseEvent).values(case_id=case_id, dispatch_id=dispatch_id, type=event_type, payload={}))


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (EventType.WORKER_COMPLETED, EventType.WORKER_COMPLETED),
        (EventType.WORKER_COMPLETED, EventType.WORKER_FAILED),
        (EventType.WORKER_FAILED, EventType.WORKER_CANCELLED),
        (EventType.WORKER_SCHEDULED, EventType.WORKER_SCHEDULED),
    ],
)
def test_the_database_refuses_a_second_event_of_a_unique_kind(
    db_sessionmaker, new_case, first: EventType, second: EventType
) -> None:
    case, dispatch_id = new_case(db_sessionmaker), str(uuid.uuid4())
    with transaction(db_sessionmaker) as session:
        _raw_event(session, case.case_id, dispatch_id, first)
    with pytest.raises(IntegrityError), transaction(db_sessionmaker) as session:
        _raw_event(session, case.case_id, dispatch_id, second)


def test_the_indexes_allow_the_engines_other_events(db_sessionmaker, new_case) -> None:
    case, dispatch_id = new_case(db_sessionmaker), str(uuid.uuid4())
    with transaction(db_sessionmaker) as session:
        for event_type in ("WORKER_SCHEDULED", "WORKER_COMPLETED", "WORKER_PROGRESS", "WORKER_PROGRESS", "NOTE"):
            _raw_event(session, case.case_id, dispatch_id, event_type)
        _raw_event(session, case.case_id, None, "CASE_OPENED")  # type: ignore[arg-type]
        _raw_event(session, case.case_id, None, "CASE_OPENED")  # type: ignore[arg-type]
    with transaction(db_sessionmaker) as session:
        assert [e.type for e in dispatches.events_for(session, dispatch_id)] == [
            "WORKER_SCHEDULED",
            "WORKER_COMPLETED",
            "WORKER_PROGRESS",
            "WORKER_PROGRESS",
            "NOTE",
        ]


# --- record_terminals / mark_notified_many: a batch in one transaction ----------------------


def test_a_batch_of_ends_writes_each_winner_and_skips_those_recorded_before(
    db_sessionmaker, new_case, schedule_for: Schedule, count_rows
) -> None:
    case = new_case(db_sessionmaker)
    ids = [schedule_for(db_sessionmaker, case).dispatch_id for _ in range(4)]
    with transaction(db_sessionmaker) as session:  # ids[0] ended before
        assert dispatches.record_terminal(session, ids[0], EventType.WORKER_CANCELLED, {"reason": "Cancelled"})
    at = T0 + timedelta(hours=1)
    batch = [
        dispatches.TerminalEvent(ids[0], EventType.WORKER_COMPLETED, {"output": {"late": True}}),
        dispatches.TerminalEvent(ids[1], EventType.WORKER_COMPLETED, {"output": {"n": 1}}),
        dispatches.TerminalEvent(ids[2], EventType.WORKER_FAILED, {"reason": "BackoffLimitExceeded"}),
        dispatches.TerminalEvent(
            ids[1], EventType.WORKER_FAILED, {"reason": "Second"}
        ),  # named twice: the first counts
        dispatches.TerminalEvent(ids[3], EventType.WORKER_COMPLETED, {}),
    ]
    with transaction(db_sessionmaker) as session:
        assert dispatches.record_terminals(session, batch, now=at) == {ids[1], ids[2], ids[3]}
    rows = [_dispatch(db_sessionmaker, d) for d in ids]
    assert [(r.state, r.reason, r.output) for r in rows] == [
        (DispatchState.CANCELLED, "Cancelled", None),
        (DispatchState.COMPLETED, None, {"n": 1}),
        (DispatchState.FAILED, "BackoffLimitExceeded", None),
        (DispatchState.COMPLETED, None, None),
    ]
    assert [r.finished_at == at for r in rows] == [False, True, True, True]
    with transaction(db_sessionmaker) as session:
        assert session.get(CaseInstance, case.case_id).updated_at == at
        assert [dispatches.terminal_event(session, d).type for d in ids] == [
            EventType.WORKER_CANCELLED, EventType.WORKER_COMPLETED, EventType.WORKER_FAILED, EventType.WORKER_COMPLETED,
        ]  # fmt: skip
    before = count_rows(db_sessionmaker)
    with transaction(db_sessionmaker) as session:  # the whole batch again: nothing left to win
        assert dispatches.record_terminals(session, batch) == set()
    assert count_rows(db_sessionmaker) == before


def test_a_batch_with_one_bad_or_unknown_end_writes_nothing(
    db_sessionmaker, new_case, schedule_for: Schedule, count_rows
) -> None:
    case = new_case(db_sessionmaker)
    good = schedule_for(db_sessionmaker, case).dispatch_id
    before = count_rows(db_sessionmaker)
    for bad, error in [
        (dispatches.TerminalEvent(good, EventType.WORKER_FAILED, {"reason": 7}), InvalidInput),
        (dispatches.TerminalEvent(str(uuid.uuid4()), EventType.WORKER_FAILED, {}), UnknownDispatch),
    ]:
        with transaction(db_sessionmaker) as session, pytest.raises(error):
            dispatches.record_terminals(session, [dispatches.TerminalEvent(good, EventType.WORKER_COMPLETED, {}), bad])
    assert count_rows(db_sessionmaker) == before
    assert _dispatch(db_sessionmaker, good).state is DispatchState.SCHEDULED


def test_an_object_the_session_holds_is_fresh_after_the_batch(
    db_sessionmaker, new_case, schedule_for: Schedule
) -> None:
    dispatch_id = schedule_for(db_sessionmaker, new_case(db_sessionmaker)).dispatch_id
    with transaction(db_sessionmaker) as session:
        held = dispatches.get_dispatch(session, dispatch_id)
        assert held is not None and held.state is DispatchState.SCHEDULED
        dispatches.record_terminals(
            session, [dispatches.TerminalEvent(dispatch_id, EventType.WORKER_FAILED, {"reason": "R"})]
        )
        assert (held.state, held.reason) == (DispatchState.FAILED, "R")


def test_mark_notified_many_marks_terminal_unnotified_dispatches_once(
    db_sessionmaker, new_case, schedule_for: Schedule
) -> None:
    case = new_case(db_sessionmaker)
    ended, running = (schedule_for(db_sessionmaker, case).dispatch_id for _ in range(2))
    with transaction(db_sessionmaker) as session:
        dispatches.record_terminal(session, ended, EventType.WORKER_COMPLETED, {})
    with transaction(db_sessionmaker) as session:
        assert dispatches.mark_notified_many(session, [ended, running, ended]) == {ended}
    with transaction(db_sessionmaker) as session:
        assert dispatches.mark_notified_many(session, [ended, running]) == set()
    assert _dispatch(db_sessionmaker, ended).notified_at is not None
    assert _dispatch(db_sessionmaker, running).notified_at is None
