"""A terminal payload the store cannot keep: `storable_terminal` turns it into its own dispatch's
failure, so a batch of `record_terminals` keeps every other event (both databases)."""

from __future__ import annotations

import pytest

from k8s_dispatch.core.errors import InputNotSerialisable, InvalidInput
from k8s_dispatch.core.payloads import MAX_DEPTH, canonical_json
from k8s_dispatch.store import dispatches
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import DispatchState, EventType

COMPLETED, FAILED = EventType.WORKER_COMPLETED, EventType.WORKER_FAILED


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        ({"output": float("inf")}, "Out of range float"),
        ({"output": {"x": float("nan")}}, "Out of range float"),
        ({"output": "\ud800"}, "surrogates not allowed"),
        ({"output": {"\udfff": 1}}, "surrogates not allowed"),
        ({"\ud800": 1}, "surrogates not allowed"),
        ({"output": nested(MAX_DEPTH + 1)}, f"nested more than {MAX_DEPTH} deep"),
        ({"output": {1: "a"}}, "non-string object key"),
        ({"reason": 7}, "reason must be a string"),
        ("not an object", "must be a JSON object"),
    ],
)
def test_an_unstorable_payload_becomes_its_dispatchs_failure(payload, why) -> None:
    event = dispatches.TerminalEvent("d-1", COMPLETED, payload)
    failure = dispatches.storable_terminal(event, reason="ResultNotJson")
    assert (failure.dispatch_id, failure.type, failure.payload["reason"]) == ("d-1", FAILED, "ResultNotJson")
    assert why in failure.payload["message"]
    canonical_json(failure.payload)  # the failure itself is always storable


@pytest.mark.parametrize(
    "payload",
    [
        {"output": nested(MAX_DEPTH)},
        {"output": 1e308, "reason": None},
        {"output": "\x00 😀"},
        {"reason": "R", "message": "m"},
    ],
)
def test_a_storable_payload_is_left_as_it_is(payload) -> None:
    event = dispatches.TerminalEvent("d-1", COMPLETED, payload)
    assert dispatches.storable_terminal(event, reason="ResultNotJson") is event


def test_a_type_that_is_not_terminal_is_a_callers_error_not_the_datas() -> None:
    with pytest.raises(InvalidInput):
        dispatches.storable_terminal(dispatches.TerminalEvent("d-1", EventType.WORKER_SCHEDULED, {}), reason="R")


def test_a_batch_with_an_unstorable_result_records_every_dispatch(db_sessionmaker, new_case, schedule_for) -> None:
    case = new_case(db_sessionmaker)
    good, poison, deep = (schedule_for(db_sessionmaker, case).dispatch_id for _ in range(3))
    batch = [
        dispatches.TerminalEvent(good, COMPLETED, {"output": {"n": 1}}),
        dispatches.TerminalEvent(poison, COMPLETED, {"output": [1, float("inf")]}),
        dispatches.TerminalEvent(deep, COMPLETED, {"output": nested(MAX_DEPTH)}),  # the payload is one deeper: kept
    ]
    with transaction(db_sessionmaker) as session, pytest.raises(InputNotSerialisable):
        dispatches.record_terminals(session, batch)  # as it is: refused whole, nothing written

    with transaction(db_sessionmaker) as session:
        won = dispatches.record_terminals(
            session, [dispatches.storable_terminal(e, reason="ResultNotJson") for e in batch]
        )
    assert won == {good, poison, deep}
    with transaction(db_sessionmaker) as session:
        rows = {d: dispatches.get_dispatch(session, d) for d in (good, poison, deep)}
        assert [(rows[d].state, rows[d].reason) for d in (good, poison, deep)] == [
            (DispatchState.COMPLETED, None), (DispatchState.FAILED, "ResultNotJson"), (DispatchState.COMPLETED, None),
        ]  # fmt: skip
        assert rows[good].output == {"n": 1} and rows[deep].output == nested(MAX_DEPTH)
        assert "Out of range float" in dispatches.terminal_event(session, poison).payload["message"]
