"""`store.maps.ended_items(..., among=...)`: a running map's hand-off asks about the items it may
end now and reads their rows only, not every item the map has ended (both databases)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from k8s_dispatch.delivery import terminal
from k8s_dispatch.store import maps
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.dispatches import QUERY_BATCH
from k8s_dispatch.store.models import ItemEventType

ITEMS = 1200  # more than two QUERY_BATCHes
OK, FAILED = ItemEventType.ITEM_COMPLETED.value, ItemEventType.ITEM_FAILED.value


@dataclass
class Read:
    """One SELECT on map_item_ends: the item indexes it named, and the rows it returned
    (PostgreSQL's count; SQLite's cursor does not know it before the rows are fetched: None)."""

    asked: int
    rows: int | None


@contextmanager
def reads(sm: sessionmaker[Session]) -> Iterator[list[Read]]:
    """Each SELECT on map_item_ends run while the block runs, in order."""
    engine = sm.kw["bind"]
    seen: list[Read] = []

    def after(conn: Any, cursor: Any, statement: str, parameters: Any, *rest: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT") and "map_item_ends" in statement:
            values = parameters.values() if isinstance(parameters, dict) else parameters
            asked = sum(1 for v in values if isinstance(v, int))  # the dispatch id is the one str
            seen.append(Read(asked, cursor.rowcount if cursor.rowcount >= 0 else None))

    sa.event.listen(engine, "after_cursor_execute", after)
    try:
        yield seen
    finally:
        sa.event.remove(engine, "after_cursor_execute", after)


def _ended_map(sm: sessionmaker[Session], case: Any, router: Any) -> str:
    """A map of ITEMS items, all but the last 10 ended (every seventh failed)."""
    request = maps.MapRequest(
        case_id=case.case_id,
        tenancy_id=case.tenancy_id,
        capability="echo",
        items=[{"n": i} for i in range(ITEMS)],
        idempotency_key=f"map-{uuid.uuid4().hex}",
        parallelism=10,
    )
    with transaction(sm) as session:
        d = maps.schedule_map(session, request, router=router, max_input_bytes=1000).dispatch_id
        ends = [
            maps.ItemEnd(d, i, ItemEventType.ITEM_FAILED, {"reason": "ContainerFailed"})
            if i % 7 == 0
            else maps.ItemEnd(d, i, ItemEventType.ITEM_COMPLETED, {"output": i})
            for i in range(ITEMS - 10)
        ]
        terminal.record_items(session, ends)
    return d


def test_a_hand_off_of_k_indexes_reads_k_rows_not_the_maps(db_sessionmaker, new_case, router) -> None:
    d = _ended_map(db_sessionmaker, new_case(db_sessionmaker), router)
    among = [7, 8, ITEMS - 11, ITEMS - 5, ITEMS - 1, 99_999]  # 3 ended, 2 open, 1 out of range
    with reads(db_sessionmaker) as rows, transaction(db_sessionmaker) as session:
        ended = maps.ended_items(session, d, among=among)
    assert ended == {7: FAILED, 8: OK, ITEMS - 11: OK}
    # one statement naming the six indexes, by the primary key: the three that exist are its rows
    assert rows in ([Read(6, 3)], [Read(6, None)])
    with reads(db_sessionmaker) as rows, transaction(db_sessionmaker) as session:
        whole = maps.ended_items(session, d)
    assert [r.asked for r in rows] == [0] and rows[0].rows in (ITEMS - 10, None)  # the whole map, as before
    assert len(whole) == ITEMS - 10


def test_among_many_is_read_a_batch_at_a_time_and_an_empty_among_reads_nothing(
    db_sessionmaker, new_case, router
) -> None:
    d = _ended_map(db_sessionmaker, new_case(db_sessionmaker), router)
    with reads(db_sessionmaker) as rows, transaction(db_sessionmaker) as session:
        ended = maps.ended_items(session, d, among=range(ITEMS))
        assert maps.ended_items(session, d, among=[]) == {}
    assert ended == maps_whole(db_sessionmaker, d)
    assert [r.asked for r in rows] == [QUERY_BATCH, QUERY_BATCH, ITEMS - 2 * QUERY_BATCH]


def maps_whole(sm: sessionmaker[Session], d: str) -> dict[int, str]:
    with transaction(sm) as session:
        return maps.ended_items(session, d)
