"""Map dispatches in the store (issue 29): one map dispatch and its items in one transaction,
every bad request refused with its typed error before anything is written, and each item's one
end settled by the (dispatch, item) key however many writers race (both databases)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from k8s_dispatch.core.errors import (
    DispatchError,
    IdempotencyConflict,
    InputNotSerialisable,
    InputTooLarge,
    InvalidInput,
    UnknownCapability,
    UnknownCase,
)
from k8s_dispatch.delivery import terminal
from k8s_dispatch.store import dispatches, maps
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import (
    CaseEvent,
    Dispatch,
    DispatchMap,
    DispatchState,
    EventType,
    ItemEventType,
    MapItem,
    MapItemEnd,
)

LIMIT = 1000  # max_input_bytes: per item


def _request(case: Any, **overrides: Any) -> maps.MapRequest:
    fields: dict[str, Any] = {
        "case_id": case.case_id,
        "tenancy_id": case.tenancy_id,
        "capability": "echo",
        "items": [{"n": i} for i in range(5)],
        "idempotency_key": f"map-{uuid.uuid4().hex}",
        "parallelism": 2,
    }
    fields.update(overrides)
    return maps.MapRequest(**fields)


def _schedule(sm: sessionmaker[Session], request: maps.MapRequest, router: Any) -> Any:
    with transaction(sm) as session:
        return maps.schedule_map(session, request, router=router, max_input_bytes=LIMIT)


def _counts(sm: sessionmaker[Session]) -> dict[str, int]:
    with transaction(sm) as session:
        return {
            model.__tablename__: session.scalar(sa.select(sa.func.count()).select_from(model)) or 0
            for model in (CaseEvent, Dispatch, DispatchMap, MapItem, MapItemEnd)
        }


def test_schedule_map_writes_the_map_and_its_items_together(db_sessionmaker, new_case, router) -> None:
    case = new_case(db_sessionmaker)
    request = _request(case, max_failed_items=1, min_succeeded=3)
    result = _schedule(db_sessionmaker, request, router)
    assert result.created and result.state is DispatchState.SCHEDULED
    with transaction(db_sessionmaker) as session:
        row = dispatches.get_dispatch(session, result.dispatch_id)
        events = dispatches.events_for(session, result.dispatch_id)
        shape = maps.map_shapes(session, [result.dispatch_id], inputs=True)[result.dispatch_id]
    assert row is not None and row.capability == "echo" and row.input["map"]["items"] == 5
    assert [e.type for e in events] == [EventType.WORKER_SCHEDULED]
    assert shape == maps.MapShape(
        items=5, parallelism=2, max_failed_items=1, min_succeeded=3, inputs=[{"n": i} for i in range(5)],
        open_items=[0, 1, 2, 3, 4], failed=0,
    )  # fmt: skip
    assert shape.passed(3) and not shape.passed(2) and shape.failures_left == 1


def test_a_creates_read_of_a_map_has_its_open_items_only(db_sessionmaker, new_case, router) -> None:
    """What a lost Job made again runs: the items with no end, their inputs, and the failures
    left under `max_failed_items`."""
    case = new_case(db_sessionmaker)
    result = _schedule(db_sessionmaker, _request(case, max_failed_items=2), router)
    ends = [
        maps.ItemEnd(result.dispatch_id, 1, ItemEventType.ITEM_COMPLETED, {"output": 1}),
        maps.ItemEnd(result.dispatch_id, 3, ItemEventType.ITEM_FAILED, {"reason": "ContainerFailed"}),
    ]
    with transaction(db_sessionmaker) as session:
        maps.record_item_ends(session, ends)
    with transaction(db_sessionmaker) as session:
        shape = maps.map_shapes(session, [result.dispatch_id], inputs=True)[result.dispatch_id]
        plain = maps.map_shapes(session, [result.dispatch_id])[result.dispatch_id]
    assert (shape.open_items, shape.inputs) == ([0, 2, 4], [{"n": 0}, {"n": 2}, {"n": 4}])
    assert (shape.failed, shape.failures_left, shape.items) == (1, 1, 5)
    assert (plain.open_items, plain.inputs) == ([], [])  # not a create's read: nothing loaded


def test_a_repeat_is_the_same_map_and_other_items_under_its_key_conflict(db_sessionmaker, new_case, router) -> None:
    case = new_case(db_sessionmaker)
    request = _request(case)
    first = _schedule(db_sessionmaker, request, router)
    before = _counts(db_sessionmaker)
    again = _schedule(db_sessionmaker, request, router)
    assert (again.dispatch_id, again.created) == (first.dispatch_id, False)
    assert _counts(db_sessionmaker) == before
    for changed in ({"items": [{"n": 9}] * 5}, {"parallelism": 3}, {"min_succeeded": 1}):
        with pytest.raises(IdempotencyConflict):
            _schedule(db_sessionmaker, _request(case, idempotency_key=request.idempotency_key, **changed), router)
    assert _counts(db_sessionmaker) == before


@pytest.mark.parametrize(
    ("overrides", "error", "says"),
    [
        ({"items": []}, InvalidInput, "1 to"),
        ({"items": "abc"}, InvalidInput, "list of item inputs"),
        ({"items": {"a": 1}}, InvalidInput, "list of item inputs"),
        ({"items": [1, {2, 3}]}, InputNotSerialisable, "item 1"),
        ({"items": [1, "x" * LIMIT]}, InputTooLarge, "item 1"),
        ({"items": ["x" * 900] * (maps.MAX_MAP_INPUT_BYTES // 900 + 1)}, InputTooLarge, "a map's limit"),
        ({"items": [0] * (maps.MAX_MAP_ITEMS + 1)}, InvalidInput, "1 to"),
        ({"parallelism": 0}, InvalidInput, "parallelism"),
        ({"parallelism": True}, InvalidInput, "parallelism"),
        ({"parallelism": "2"}, InvalidInput, "parallelism"),
        ({"max_failed_items": -1}, InvalidInput, "max_failed_items"),
        ({"max_failed_items": 6}, InvalidInput, "max_failed_items"),
        ({"min_succeeded": 0}, InvalidInput, "min_succeeded"),
        ({"min_succeeded": 6}, InvalidInput, "min_succeeded"),
        ({"capability": "nope"}, UnknownCapability, "nope"),
        ({"case_id": "case-that-does-not-exist"}, UnknownCase, "does not exist"),
    ],
)
def test_a_bad_map_is_refused_with_its_typed_error_and_writes_nothing(
    db_sessionmaker, new_case, router, overrides: dict[str, Any], error: type[DispatchError], says: str
) -> None:
    case = new_case(db_sessionmaker)
    before = _counts(db_sessionmaker)
    with pytest.raises(error, match=says):
        _schedule(db_sessionmaker, _request(case, **overrides), router)
    assert _counts(db_sessionmaker) == before


class _StoringRouter:
    """A router whose capability stores its results in the object store."""

    def worker_for(self, capability: str) -> str:
        return "echo-worker"

    def spec(self, capability: str) -> Any:
        return type("Spec", (), {"results_in_object_store": True})()


def test_a_capability_that_stores_its_results_is_refused_for_maps(db_sessionmaker, new_case) -> None:
    case = new_case(db_sessionmaker)
    with pytest.raises(InvalidInput, match="stores its results"):
        _schedule(db_sessionmaker, _request(case), _StoringRouter())


def _end(dispatch_id: str, index: int, kind: ItemEventType = ItemEventType.ITEM_COMPLETED) -> maps.ItemEnd:
    payload = {"output": {"i": index}} if kind is ItemEventType.ITEM_COMPLETED else {"reason": "ContainerFailed"}
    return maps.ItemEnd(dispatch_id, index, kind, payload)


def test_each_item_ends_once_whoever_writes_it(db_sessionmaker, new_case, router) -> None:
    case = new_case(db_sessionmaker)
    result = _schedule(db_sessionmaker, _request(case), router)
    d = result.dispatch_id
    with transaction(db_sessionmaker) as session:
        won = terminal.record_items(session, [_end(d, 0), _end(d, 1), _end(d, 1, ItemEventType.ITEM_FAILED)])
    assert won == {(d, 0), (d, 1)}
    with transaction(db_sessionmaker) as session:
        # a second writer of item 1 (a redelivered hand-off, another replica) loses; item 2 is new
        won = terminal.record_items(session, [_end(d, 1, ItemEventType.ITEM_FAILED), _end(d, 2)])
    assert won == {(d, 2)}
    with transaction(db_sessionmaker) as session:
        events = maps.item_events(session, d)
        ended = maps.ended_items(session, d)
    assert [(e.type, e.payload) for e in events] == [
        ("WORKER_ITEM_COMPLETED", {"item": 0, "output": {"i": 0}}),
        ("WORKER_ITEM_COMPLETED", {"item": 1, "output": {"i": 1}}),
        ("WORKER_ITEM_COMPLETED", {"item": 2, "output": {"i": 2}}),
    ]
    assert ended == {0: "WORKER_ITEM_COMPLETED", 1: "WORKER_ITEM_COMPLETED", 2: "WORKER_ITEM_COMPLETED"}


def test_progress_counts_each_end_once_and_is_none_for_a_dispatch_that_is_no_map(
    db_sessionmaker, new_case, router, schedule_for
) -> None:
    case = new_case(db_sessionmaker)
    d = _schedule(db_sessionmaker, _request(case), router).dispatch_id
    single = schedule_for(db_sessionmaker, case).dispatch_id
    with transaction(db_sessionmaker) as session:
        assert maps.progress(session, d) == maps.Progress(items=5, succeeded=0, failed=0, cancelled=0)
        terminal.record_items(session, [_end(d, 0), _end(d, 1), _end(d, 2, ItemEventType.ITEM_FAILED), _end(d, 0)])
        ended = maps.progress(session, d)
        assert ended == maps.Progress(items=5, succeeded=2, failed=1, cancelled=0) and ended.open == 2
        assert maps.progress(session, single) is None


def test_racing_writers_end_each_item_once(db_sessionmaker, new_case, router, race) -> None:
    case = new_case(db_sessionmaker)
    d = _schedule(db_sessionmaker, _request(case, items=list(range(20))), router).dispatch_id

    def work(round_: int, thread: int) -> set[tuple[str, int]]:
        with transaction(db_sessionmaker) as session:
            return terminal.record_items(session, [_end(d, i) for i in range(20)])

    results = race(4, 1, work)[0]
    assert sorted(pair for won in results for pair in won) == [(d, i) for i in range(20)]
    with transaction(db_sessionmaker) as session:
        assert len(maps.item_events(session, d)) == 20


@pytest.mark.parametrize(
    ("event", "item_type"),
    [
        (EventType.WORKER_CANCELLED, "WORKER_ITEM_CANCELLED"),
        (EventType.WORKER_FAILED, "WORKER_ITEM_FAILED"),
    ],
)
def test_a_maps_end_ends_its_open_items_once(
    db_sessionmaker, new_case, router, event: EventType, item_type: str
) -> None:
    case = new_case(db_sessionmaker)
    d = _schedule(db_sessionmaker, _request(case), router).dispatch_id
    with transaction(db_sessionmaker) as session:
        terminal.record_items(session, [_end(d, 0), _end(d, 3, ItemEventType.ITEM_FAILED)])
    with transaction(db_sessionmaker) as session:
        assert terminal.record(session, [dispatches.TerminalEvent(d, event, {"reason": "Why"})]) == {d}
    with transaction(db_sessionmaker) as session:  # a second end of the map changes nothing
        assert terminal.record(session, [dispatches.TerminalEvent(d, event, {"reason": "Again"})]) == set()
        events = maps.item_events(session, d)
    assert sorted((e.payload["item"], e.type, e.payload.get("reason")) for e in events) == [
        (0, "WORKER_ITEM_COMPLETED", None),
        (1, item_type, "Why"),
        (2, item_type, "Why"),
        (3, "WORKER_ITEM_FAILED", "ContainerFailed"),
        (4, item_type, "Why"),
    ]


def test_a_dispatch_that_is_no_map_ends_as_before(db_sessionmaker, new_case, schedule_for) -> None:
    case = new_case(db_sessionmaker)
    d = schedule_for(db_sessionmaker, case).dispatch_id
    with transaction(db_sessionmaker) as session:
        event = dispatches.TerminalEvent(d, EventType.WORKER_CANCELLED, {"reason": "Cancelled"})
        assert terminal.record(session, [event]) == {d}
        assert maps.item_events(session, d) == []
