"""`schedule`: one dispatch and one WORKER_SCHEDULED per (tenancy, idempotency key), and every
malformed request refused with its typed error before anything is written (both databases)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import given
from hypothesis import strategies as st

from k8s_dispatch.core.errors import (
    DispatchError,
    IdempotencyConflict,
    InputNotSerialisable,
    InputTooLarge,
    InvalidId,
    InvalidIdempotencyKey,
    InvalidInput,
    TenancyMismatch,
    UnknownCapability,
    UnknownCase,
)
from k8s_dispatch.store import dispatches, scheduling
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import CaseEvent, Dispatch, DispatchState, EventType

LIMIT = 1000  # max_input_bytes in the size tests

Schedule = Callable[..., scheduling.ScheduleResult]


def test_schedule_writes_the_dispatch_and_its_event_together(db_sessionmaker, new_case, schedule_for: Schedule) -> None:
    case = new_case(db_sessionmaker)
    result = schedule_for(db_sessionmaker, case, input={"b": [1, 2.5], "a": "é"}, idempotency_key="order-1")
    assert result.created and result.state is DispatchState.SCHEDULED
    assert str(uuid.UUID(result.dispatch_id)) == result.dispatch_id

    with transaction(db_sessionmaker) as session:
        dispatch = dispatches.get_dispatch(session, result.dispatch_id)
        events = dispatches.events_for(session, result.dispatch_id)
    assert dispatch is not None
    assert (dispatch.case_id, dispatch.tenancy_id, dispatch.capability, dispatch.worker_name) == (
        case.case_id,
        case.tenancy_id,
        "echo",
        "echo-worker",
    )
    assert (dispatch.idempotency_key, dispatch.input, dispatch.attempts) == ("order-1", {"a": "é", "b": [1, 2.5]}, 0)
    assert dispatch.state is DispatchState.SCHEDULED and dispatch.job_name is None and dispatch.finished_at is None
    assert dispatch.created_at.tzinfo is UTC
    assert [(e.type, e.case_id, e.payload) for e in events] == [
        (
            EventType.WORKER_SCHEDULED,
            case.case_id,
            {
                "capability": "echo",
                "worker_name": "echo-worker",
                "idempotency_key": "order-1",
                "input": {"a": "é", "b": [1, 2.5]},
            },
        )
    ]


def test_same_key_twice_gives_one_dispatch_and_one_event(
    db_sessionmaker, new_case, schedule_for: Schedule, count_rows
) -> None:
    case = new_case(db_sessionmaker)
    first = schedule_for(db_sessionmaker, case, idempotency_key="same", input={"x": 1, "y": [1, 2]})
    before = count_rows(db_sessionmaker)
    # The same request: keys in another order, a tuple for the list, another proposed id.
    again = schedule_for(
        db_sessionmaker, case, idempotency_key="same", input={"y": (1, 2), "x": 1}, dispatch_id=str(uuid.uuid4())
    )
    assert again == scheduling.ScheduleResult(
        dispatch_id=first.dispatch_id, created=False, state=DispatchState.SCHEDULED
    )
    assert count_rows(db_sessionmaker) == before
    with transaction(db_sessionmaker) as session:
        ids = session.scalars(
            sa.select(Dispatch.dispatch_id).where(
                Dispatch.tenancy_id == case.tenancy_id, Dispatch.idempotency_key == "same"
            )
        ).all()
        scheduled = session.scalars(
            sa.select(CaseEvent).where(CaseEvent.case_id == case.case_id, CaseEvent.type == EventType.WORKER_SCHEDULED)
        ).all()
    assert ids == [first.dispatch_id]
    assert [e.dispatch_id for e in scheduled] == [first.dispatch_id]


def test_a_repeat_reports_the_dispatch_current_state(db_sessionmaker, new_case, schedule_for: Schedule) -> None:
    case = new_case(db_sessionmaker)
    first = schedule_for(db_sessionmaker, case, idempotency_key="k")
    with transaction(db_sessionmaker) as session:
        assert dispatches.record_terminal(
            session, first.dispatch_id, EventType.WORKER_COMPLETED, {"output": {"ok": True}}
        )
    again = schedule_for(db_sessionmaker, case, idempotency_key="k")
    assert (again.dispatch_id, again.created, again.state) == (first.dispatch_id, False, DispatchState.COMPLETED)


def test_the_key_is_per_tenancy(db_sessionmaker, new_case, schedule_for: Schedule) -> None:
    one, other = new_case(db_sessionmaker), new_case(db_sessionmaker)
    a = schedule_for(db_sessionmaker, one, idempotency_key="shared-key")
    b = schedule_for(db_sessionmaker, other, idempotency_key="shared-key")
    assert a.created and b.created and a.dispatch_id != b.dispatch_id


def test_a_given_dispatch_id_is_used(db_sessionmaker, new_case, schedule_for: Schedule) -> None:
    wanted = str(uuid.uuid4())
    result = schedule_for(db_sessionmaker, new_case(db_sessionmaker), dispatch_id=wanted)
    assert (result.dispatch_id, result.created) == (wanted, True)


def test_timestamps_are_stored_and_read_as_utc(db_sessionmaker, new_case, schedule_for: Schedule) -> None:
    at = datetime(2021, 1, 2, 5, 4, 5, 123456, tzinfo=timezone(timedelta(hours=2)))
    result = schedule_for(db_sessionmaker, new_case(db_sessionmaker), now=at)
    with transaction(db_sessionmaker) as session:
        dispatch = dispatches.get_dispatch(session, result.dispatch_id)
    assert dispatch is not None
    assert dispatch.created_at == datetime(2021, 1, 2, 3, 4, 5, 123456, tzinfo=UTC)
    assert dispatch.created_at.tzinfo is UTC and dispatch.updated_at == dispatch.created_at


AWKWARD_INPUTS = [
    {"big": 2**70, "neg": -(2**63), "float": 1e20, "tiny": 5e-324, "zero": -0.0, "one": 1.0},
    {"unicode": '日本語 🚀 \u2028 \x01 \\u0000 "quoted"', "nul": "a\x00b", "empty": {}, "list": []},
    ["a", None, True, False, 0, [[[]]]],
    "just a string",
    None,
]


@pytest.mark.parametrize("value", AWKWARD_INPUTS, ids=["numbers", "strings", "array", "string", "null"])
def test_awkward_inputs_round_trip_and_still_count_as_the_same_request(
    db_sessionmaker, new_case, schedule_for: Schedule, value: Any
) -> None:
    case = new_case(db_sessionmaker)
    first = schedule_for(db_sessionmaker, case, input=value, idempotency_key="awkward")
    with transaction(db_sessionmaker) as session:
        dispatch = dispatches.get_dispatch(session, first.dispatch_id)
    assert dispatch is not None
    assert json.dumps(dispatch.input, sort_keys=True) == json.dumps(value, sort_keys=True)
    again = schedule_for(db_sessionmaker, case, input=value, idempotency_key="awkward")
    assert (again.dispatch_id, again.created) == (first.dispatch_id, False)


# --- refused requests --------------------------------------------------------------------


def _cyclic() -> list[Any]:
    value: list[Any] = []
    value.append(value)
    return value


def _deep(levels: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(levels):
        value = [value]
    return value


BAD_REQUESTS: list[tuple[str, dict[str, Any], type[DispatchError]]] = [
    ("case-id-empty", {"case_id": ""}, InvalidId),
    ("case-id-format-char", {"case_id": "a\u200bb"}, InvalidId),  # zero-width space: not printable
    ("case-id-tab", {"case_id": "a\tb"}, InvalidId),
    ("case-id-control", {"case_id": "a\x07b"}, InvalidId),
    ("case-id-nbsp", {"case_id": "a\u00a0b"}, InvalidId),
    ("case-id-too-long", {"case_id": "c" * 129}, InvalidId),
    ("case-id-not-str", {"case_id": 42}, InvalidId),
    ("tenancy-empty", {"tenancy_id": ""}, InvalidId),
    ("tenancy-newline", {"tenancy_id": "t\n"}, InvalidId),
    ("tenancy-too-long", {"tenancy_id": "t" * 129}, InvalidId),
    ("tenancy-none", {"tenancy_id": None}, InvalidId),
    ("dispatch-id-not-uuid", {"dispatch_id": "not-a-uuid"}, InvalidId),
    ("dispatch-id-upper", {"dispatch_id": str(uuid.uuid4()).upper()}, InvalidId),
    ("dispatch-id-no-hyphens", {"dispatch_id": uuid.uuid4().hex}, InvalidId),
    ("dispatch-id-braces", {"dispatch_id": "{" + str(uuid.uuid4()) + "}"}, InvalidId),
    ("unknown-case", {"case_id": "no-such-case"}, UnknownCase),
    ("key-empty", {"idempotency_key": ""}, InvalidIdempotencyKey),
    ("key-too-long", {"idempotency_key": "k" * 257}, InvalidIdempotencyKey),
    ("key-newline", {"idempotency_key": "a\nb"}, InvalidIdempotencyKey),
    ("key-not-str", {"idempotency_key": b"bytes"}, InvalidIdempotencyKey),
    ("input-int-key", {"input": {1: "a"}}, InputNotSerialisable),
    ("input-nested-none-key", {"input": {"a": [{None: 1}]}}, InputNotSerialisable),
    ("input-mixed-keys", {"input": {1: "a", "b": 2}}, InputNotSerialisable),
    ("input-nan", {"input": {"x": float("nan")}}, InputNotSerialisable),
    ("input-infinity", {"input": [float("-inf")]}, InputNotSerialisable),
    ("input-set", {"input": {"s": {1, 2}}}, InputNotSerialisable),
    ("input-bytes", {"input": b"raw"}, InputNotSerialisable),
    ("input-object", {"input": object()}, InputNotSerialisable),
    ("input-datetime", {"input": {"at": datetime.now(UTC)}}, InputNotSerialisable),
    ("input-lone-surrogate", {"input": {"s": "\ud800"}}, InputNotSerialisable),
    ("input-cycle", {"input": _cyclic()}, InputNotSerialisable),
    ("input-too-deep", {"input": _deep(100_000)}, InputNotSerialisable),
    ("input-too-large", {"input": "x" * (LIMIT - 1), "max_input_bytes": LIMIT}, InputTooLarge),  # + 2 quotes
    ("input-too-large-utf8", {"input": "é" * (LIMIT // 2), "max_input_bytes": LIMIT}, InputTooLarge),
    ("unknown-capability", {"capability": "teleport"}, UnknownCapability),
    ("capability-empty", {"capability": ""}, UnknownCapability),
]


@pytest.mark.parametrize(
    ("overrides", "error"), [(o, e) for _, o, e in BAD_REQUESTS], ids=[n for n, _, _ in BAD_REQUESTS]
)
def test_a_bad_request_gets_its_typed_error_and_writes_nothing(
    db_sessionmaker, new_case, schedule_for: Schedule, count_rows, overrides: dict[str, Any], error: type[DispatchError]
) -> None:
    case = new_case(db_sessionmaker)
    before = count_rows(db_sessionmaker)
    with pytest.raises(error) as raised:
        schedule_for(db_sessionmaker, case, **overrides)
    assert raised.value.reason == error.reason
    assert count_rows(db_sessionmaker) == before


def test_input_at_the_size_limit_is_accepted(db_sessionmaker, new_case, schedule_for: Schedule) -> None:
    case = new_case(db_sessionmaker)
    assert schedule_for(db_sessionmaker, case, input="x" * (LIMIT - 2), max_input_bytes=LIMIT).created
    # Measured as UTF-8 (2 bytes each), not as ASCII-escaped JSON (6 bytes each).
    assert schedule_for(db_sessionmaker, case, input="é" * ((LIMIT - 2) // 2), max_input_bytes=LIMIT).created


def test_a_case_of_another_tenancy_is_refused(db_sessionmaker, new_case, schedule_for: Schedule, count_rows) -> None:
    case, other = new_case(db_sessionmaker), new_case(db_sessionmaker)
    before = count_rows(db_sessionmaker)
    with pytest.raises(TenancyMismatch):
        schedule_for(db_sessionmaker, case, tenancy_id=other.tenancy_id)
    assert count_rows(db_sessionmaker) == before


@pytest.mark.parametrize(
    "change",
    [{"capability": "sleep"}, {"input": {"message": "other"}}, {"case": "other"}],
    ids=["capability", "input", "case"],
)
def test_the_same_key_for_a_different_request_is_a_conflict(
    db_sessionmaker, new_case, schedule_for: Schedule, count_rows, change: dict[str, Any]
) -> None:
    case = new_case(db_sessionmaker)
    first = schedule_for(db_sessionmaker, case, idempotency_key="reused")
    if change.pop("case", None):  # another case of the same tenancy
        change["case_id"] = f"other-{uuid.uuid4().hex}"
        with transaction(db_sessionmaker) as session:
            scheduling.create_case(session, case_id=change["case_id"], tenancy_id=case.tenancy_id)
    before = count_rows(db_sessionmaker)
    with pytest.raises(IdempotencyConflict) as raised:
        schedule_for(db_sessionmaker, case, idempotency_key="reused", **change)
    assert isinstance(raised.value, InvalidInput) and first.dispatch_id in str(raised.value)
    assert count_rows(db_sessionmaker) == before


def test_a_dispatch_id_already_in_use_is_refused(db_sessionmaker, new_case, schedule_for: Schedule, count_rows) -> None:
    case = new_case(db_sessionmaker)
    first = schedule_for(db_sessionmaker, case)
    before = count_rows(db_sessionmaker)
    with pytest.raises(InvalidId):
        schedule_for(db_sessionmaker, case, dispatch_id=first.dispatch_id)  # a new key
    assert count_rows(db_sessionmaker) == before


def test_a_refused_request_leaves_the_callers_transaction_usable(db_sessionmaker, new_case, router) -> None:
    """Nothing is half-written: the caller can carry on in the same transaction."""
    case = new_case(db_sessionmaker)
    request = dict(
        case_id=case.case_id, tenancy_id=case.tenancy_id, capability="echo", router=router, max_input_bytes=100
    )
    with transaction(db_sessionmaker) as session:
        with pytest.raises(InputTooLarge):
            scheduling.schedule(session, input="x" * 200, idempotency_key="a", **request)
        ok = scheduling.schedule(session, input="small", idempotency_key="b", **request)
    with transaction(db_sessionmaker) as session:
        assert dispatches.get_dispatch(session, ok.dispatch_id) is not None
        assert session.scalar(sa.select(sa.func.count()).where(Dispatch.tenancy_id == case.tenancy_id)) == 1


# --- the encoding, as a property -------------------------------------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


def _reordered(value: Any) -> Any:
    """The same JSON value with every object's keys in reverse insertion order."""
    if isinstance(value, dict):
        return {key: _reordered(value[key]) for key in reversed(list(value))}
    if isinstance(value, list):
        return [_reordered(item) for item in value]
    return value


@given(JSON_VALUES)
def test_canonical_json_round_trips_and_ignores_key_order(value: Any) -> None:
    text = dispatches.canonical_json(value)
    assert json.loads(text) == value
    assert dispatches.canonical_json(_reordered(value)) == text
    assert dispatches.canonical_json(json.loads(text)) == text
    assert len(text.encode("utf-8")) <= len(json.dumps(value).encode("utf-8"))  # compact, not escaped
