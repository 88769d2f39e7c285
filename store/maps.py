"""Map dispatches (fan-out, issue 29): one dispatch over many items, run as one Indexed Job.

A map is an ordinary `dispatches` row (scheduled by `store.scheduling`, so its idempotency,
limits and WORKER_SCHEDULED event are every dispatch's) plus a `dispatch_maps` row and its items'
inputs, all written in the caller's transaction: everything is checked before anything is
written, so a bad item leaves the database as it was. Each item ends once: `record_item_ends`
inserts into `map_item_ends`, whose primary key (dispatch, item) decides between racing writers,
and writes the item's event to the engine's log only for the ends it inserted.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from k8s_dispatch.core.errors import InputTooLarge, InvalidInput
from k8s_dispatch.core.ids import show_value
from k8s_dispatch.core.payloads import canonical_json, encode_input
from k8s_dispatch.store.db import database_now
from k8s_dispatch.store.dispatches import QUERY_BATCH, by_ids, insert_for
from k8s_dispatch.store.models import (
    ITEM_END_FOR_MAP_END,
    CaseEvent,
    Dispatch,
    DispatchMap,
    EventType,
    ItemEventType,
    MapItem,
    MapItemEnd,
)
from k8s_dispatch.store.scheduling import CapabilityRouter, ScheduleRequest, ScheduleResult, schedule_many

# The Job API's limit on `completions` of an Indexed Job with `backoffLimitPerIndex`.
MAX_MAP_ITEMS = 100_000
# The items' inputs all together, as canonical JSON, without an object store. They travel in the
# Job's Pod template (`workers.indexed`), which the API server stores in the Job and in each of its
# Pods: kept far under etcd's 1.5 MiB object limit, and small enough that a Pod of the map costs
# what a Pod of a dispatch with a large input does. A larger map is refused here (InputTooLarge),
# before anything is written: split it, or configure an object store.
MAX_MAP_INPUT_BYTES = 256 * 1024
# With an object store (`artifacts.inputs`) no Pod carries them, and the bound is the create step:
# it reads the open items from their rows and packs them in memory under the map's row lock, once
# per Job. 64 MiB (one stored input's default limit, `object_store_max_input_bytes`, which lowers
# it) keeps that to a second or so; larger work belongs in objects the engine writes itself.
MAX_STORED_MAP_INPUT_BYTES = 64 * 1024 * 1024
# `parallelism` of one Job: the API's own bound is far higher; under a limit, admission narrows
# it to the slots the map was granted (store/admission.py).
MAX_PARALLELISM = 10_000


@dataclass(frozen=True)
class MapRequest:
    """One map dispatch to schedule: a capability over `items`, each item one Pod's input."""

    case_id: str
    tenancy_id: str
    capability: str
    items: Sequence[Any]
    idempotency_key: str
    parallelism: int
    max_failed_items: int | None = None  # the Job stops once more items than this have failed
    min_succeeded: int | None = None  # the map passes with at least this many; None: every item
    dispatch_id: str | None = None
    priority: int = 0


@dataclass(frozen=True)
class PreparedMap:
    """A checked map request: its own dispatch's request and its items' inputs (plain JSON)."""

    request: ScheduleRequest
    inputs: list[Any]
    parallelism: int
    max_failed_items: int | None
    min_succeeded: int | None


@dataclass(frozen=True)
class MapShape:
    """What a map's Indexed Job is made from (`workers.indexed`): its items and how they run."""

    items: int
    parallelism: int
    max_failed_items: int | None
    min_succeeded: int | None
    # Loaded only for a create: the items still open (no end recorded), their inputs in the
    # same order, and how many items failed already (they count against `max_failed_items`).
    inputs: list[Any] = field(default_factory=list)
    open_items: list[int] = field(default_factory=list)
    failed: int = 0

    @property
    def failures_left(self) -> int | None:
        """How many more items may fail before the map stops (None: no limit)."""
        return None if self.max_failed_items is None else max(0, self.max_failed_items - self.failed)

    def passed(self, succeeded: int) -> bool:
        """Whether `succeeded` items make the map pass (all, or at least `min_succeeded`)."""
        return succeeded >= (self.items if self.min_succeeded is None else self.min_succeeded)


@dataclass(frozen=True)
class ItemEnd:
    """One item's end: ITEM_COMPLETED with {"output": ...}, or ITEM_FAILED/CANCELLED with a reason."""

    dispatch_id: str
    item_index: int
    type: ItemEventType
    payload: dict[str, Any]


def map_input_limit(*, max_input_bytes: int, max_stored_input_bytes: int | None) -> int:
    """The most bytes a map's inputs may be as one JSON array (each item too): MAX_MAP_INPUT_BYTES
    without an object store (`max_stored_input_bytes` None), else `max_stored_input_bytes`
    (`Settings.max_stored_input_bytes`) up to MAX_STORED_MAP_INPUT_BYTES, never under either
    the env's limits."""
    if max_stored_input_bytes is None:
        return MAX_MAP_INPUT_BYTES
    return max(MAX_MAP_INPUT_BYTES, max_input_bytes, min(max_stored_input_bytes, MAX_STORED_MAP_INPUT_BYTES))


def prepare_map(
    request: MapRequest, *, router: CapabilityRouter, max_input_bytes: int, max_stored_input_bytes: int | None = None
) -> PreparedMap:
    """Check a map request without the database; the map's own dispatch request and its inputs.
    `max_stored_input_bytes`: the caller has an object store (`map_input_limit`).

    The map's dispatch records a summary as its input (the number of items, their digest and how
    they run), so a repeat of its idempotency key with other items is an IdempotencyConflict.

    Raises:
        InvalidInput: items is not a non-empty list of at most MAX_MAP_ITEMS; parallelism,
            max_failed_items or min_succeeded out of range; a capability whose results go to
            the object store (not supported for maps yet).
        InputNotSerialisable, InputTooLarge: an item (named by its index), or all of them
            together over `map_input_limit` (each item too, and over `max_input_bytes`
            without an object store).
        UnknownCapability: from `router`.
    """
    items = request.items
    if isinstance(items, (str, bytes, Mapping)) or not isinstance(items, Sequence):
        raise InvalidInput(f"items must be a list of item inputs, got {show_value(items)}")
    count = len(items)
    if not 1 <= count <= MAX_MAP_ITEMS:
        raise InvalidInput(f"a map needs 1 to {MAX_MAP_ITEMS} items, got {count}")
    _check_int("parallelism", request.parallelism, 1, MAX_PARALLELISM)
    if request.max_failed_items is not None:
        _check_int("max_failed_items", request.max_failed_items, 0, count)
    if request.min_succeeded is not None:
        _check_int("min_succeeded", request.min_succeeded, 1, count)
    limit = map_input_limit(max_input_bytes=max_input_bytes, max_stored_input_bytes=max_stored_input_bytes)
    item_limit = max_input_bytes if max_stored_input_bytes is None else limit
    texts: list[str] = []
    for index, item in enumerate(items):
        try:
            texts.append(encode_input(item, max_bytes=item_limit))
        except InvalidInput as e:
            raise type(e)(f"item {index}: {e}") from e
    total = sum(len(text.encode("utf-8")) for text in texts) + count + 1  # as one JSON array
    if total > limit:
        raise InputTooLarge(f"the items are {total} bytes as JSON, over a map's limit of {limit}")
    spec_of = getattr(router, "spec", None)
    router.worker_for(request.capability)  # UnknownCapability before anything else about it
    if spec_of is not None and spec_of(request.capability).results_in_object_store:
        raise InvalidInput(f"capability {request.capability!r} stores its results: maps do not support that yet")
    digest = hashlib.sha256(("[" + ",".join(texts) + "]").encode("utf-8")).hexdigest()
    summary = {
        "map": {
            "items": count,
            "items_sha256": digest,
            "parallelism": request.parallelism,
            "max_failed_items": request.max_failed_items,
            "min_succeeded": request.min_succeeded,
        }
    }
    own = ScheduleRequest(
        case_id=request.case_id,
        tenancy_id=request.tenancy_id,
        capability=request.capability,
        input=summary,
        idempotency_key=request.idempotency_key,
        dispatch_id=request.dispatch_id,
        priority=request.priority,
    )
    return PreparedMap(
        request=own,
        inputs=[json.loads(text) for text in texts],
        parallelism=request.parallelism,
        max_failed_items=request.max_failed_items,
        min_succeeded=request.min_succeeded,
    )


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidInput(f"{name} must be an integer from {low} to {high}, got {show_value(value)}")


def schedule_map(
    session: Session,
    request: MapRequest,
    *,
    router: CapabilityRouter,
    max_input_bytes: int,
    max_stored_input_bytes: int | None = None,
    now: datetime | None = None,
) -> ScheduleResult:
    """Write a map dispatch, its WORKER_SCHEDULED event and its items in the caller's transaction.
    `max_stored_input_bytes`: the caller has an object store (`map_input_limit`).

    Idempotent on (tenancy_id, idempotency_key) as `scheduling.schedule_many` is: a repeat
    returns the map it made (`created=False`) and writes nothing.

    Raises:
        As `prepare_map`, then as `scheduling.schedule_many` (InvalidId, UnknownCase,
        TenancyMismatch, IdempotencyConflict...): nothing is written.
    """
    prepared = prepare_map(
        request, router=router, max_input_bytes=max_input_bytes, max_stored_input_bytes=max_stored_input_bytes
    )
    (result,) = schedule_many(session, [prepared.request], router=router, max_input_bytes=max_input_bytes, now=now)
    write_items(session, result, prepared)
    return result


def write_items(session: Session, result: ScheduleResult, prepared: PreparedMap) -> None:
    """The map's own rows, once its dispatch was written by this transaction (nothing on a repeat)."""
    if not result.created:
        return
    session.execute(
        sa.insert(DispatchMap.__table__),
        [
            {
                "dispatch_id": result.dispatch_id,
                "items": len(prepared.inputs),
                "parallelism": prepared.parallelism,
                "max_failed_items": prepared.max_failed_items,
                "min_succeeded": prepared.min_succeeded,
            }
        ],
    )
    session.execute(
        sa.insert(MapItem.__table__),
        [{"dispatch_id": result.dispatch_id, "item_index": i, "input": item} for i, item in enumerate(prepared.inputs)],
    )


# --- reads ---------------------------------------------------------------------------------


_MAPS_AMONG = sa.select(DispatchMap).where(DispatchMap.dispatch_id.in_(sa.bindparam("ids", expanding=True)))


def map_shapes(session: Session, ids: Iterable[str], *, inputs: bool = False) -> dict[str, MapShape]:
    """The maps among `ids`, by id (one query per QUERY_BATCH ids; none for a dispatch that is
    not a map); with `inputs` (a create's read), each with its open items and their inputs in
    index order, and its count of failed items: a Job made again runs only what is open."""
    found = {row.dispatch_id: row for row in by_ids(session, ids, session.scalars, _MAPS_AMONG)}
    loaded: dict[str, list[Any]] = {d: [] for d in found}
    open_items: dict[str, list[int]] = {d: [] for d in found}
    failed: dict[str, int] = dict.fromkeys(found, 0)
    if inputs and found:
        query = (
            sa.select(MapItem.dispatch_id, MapItem.item_index, MapItem.input, MapItemEnd.type)
            .outerjoin(
                MapItemEnd,
                sa.and_(MapItemEnd.dispatch_id == MapItem.dispatch_id, MapItemEnd.item_index == MapItem.item_index),
            )
            .where(MapItem.dispatch_id.in_(sorted(found)))
            .order_by(MapItem.dispatch_id, MapItem.item_index)
        )
        for dispatch_id, index, item, end in session.execute(query):
            if end is None:
                open_items[dispatch_id].append(int(index))
                loaded[dispatch_id].append(item)
            elif end != ItemEventType.ITEM_COMPLETED.value:
                failed[dispatch_id] += 1
    return {
        d: MapShape(
            items=row.items,
            parallelism=row.parallelism,
            max_failed_items=row.max_failed_items,
            min_succeeded=row.min_succeeded,
            inputs=loaded[d],
            open_items=open_items[d],
            failed=failed[d],
        )
        for d, row in found.items()
    }


_ENDS = sa.select(MapItemEnd.item_index, MapItemEnd.type).where(MapItemEnd.dispatch_id == sa.bindparam("dispatch_id"))
_ENDS_AMONG = _ENDS.where(MapItemEnd.item_index.in_(sa.bindparam("among", expanding=True)))


def ended_items(session: Session, dispatch_id: str, *, among: Iterable[int] | None = None) -> dict[int, str]:
    """The map's ended items: index -> its end's ItemEventType value. With `among`, only those
    of these indexes (one query per QUERY_BATCH of them): a running map's hand-off asks about
    the items it may end now, and reads their rows, not the whole map's."""
    if among is None:
        return {int(index): str(kind) for index, kind in session.execute(_ENDS, {"dispatch_id": dispatch_id})}
    wanted = sorted(set(among))
    found: dict[int, str] = {}
    for start in range(0, len(wanted), QUERY_BATCH):
        chunk = {"dispatch_id": dispatch_id, "among": wanted[start : start + QUERY_BATCH]}
        found.update((int(index), str(kind)) for index, kind in session.execute(_ENDS_AMONG, chunk))
    return found


def item_events(session: Session, dispatch_id: str) -> list[CaseEvent]:
    """The map's item events in the engine's log, in the order written."""
    types = [t.value for t in ItemEventType]
    query = (
        sa.select(CaseEvent)
        .where(CaseEvent.dispatch_id == dispatch_id, CaseEvent.type.in_(types))
        .order_by(CaseEvent.id)
    )
    return list(session.scalars(query))


# --- item ends -----------------------------------------------------------------------------


def record_item_ends(session: Session, ends: Sequence[ItemEnd], *, now: datetime | None = None) -> set[tuple[str, int]]:
    """Write these item ends in the caller's transaction; the (dispatch, item) pairs this call won.

    An item that has its end already is left as it is: the insert skips it (ON CONFLICT DO
    NOTHING on the primary key), also against a racing writer's uncommitted end, which it waits
    for. Each end won gets its event in the engine's log, {"item": index, ...payload}.

    Raises:
        InputNotSerialisable: a payload the store cannot keep (nothing is written).
    """
    if not ends:
        return set()
    unique = {(e.dispatch_id, e.item_index): e for e in reversed(ends)}  # the first end of a pair wins
    for end in unique.values():
        canonical_json(end.payload, what=f"the end of item {end.item_index}")
    now = now or database_now(session)
    table = MapItemEnd.__table__
    insert = insert_for(session)(table).on_conflict_do_nothing().returning(table.c.dispatch_id, table.c.item_index)
    rows = [
        {
            "dispatch_id": d,
            "item_index": i,
            "type": end.type.value,
            "output": end.payload.get("output"),
            "reason": end.payload.get("reason"),
            "created_at": now,
        }
        for (d, i), end in sorted(unique.items())  # in key order, as every writer: no deadlock
    ]
    won = {(str(d), int(i)) for d, i in session.execute(insert, rows)}
    if won:
        query = sa.select(Dispatch.dispatch_id, Dispatch.case_id).where(
            Dispatch.dispatch_id.in_(sorted({d for d, _ in won}))
        )
        cases = {str(d): str(case_id) for d, case_id in session.execute(query)}
        session.execute(
            sa.insert(CaseEvent.__table__),
            [
                {
                    "case_id": cases[d],
                    "dispatch_id": d,
                    "type": unique[(d, i)].type.value,
                    "payload": {"item": i, **unique[(d, i)].payload},
                    "created_at": now,
                }
                for d, i in sorted(won)
            ],
        )
    return won


def end_open_items(
    session: Session, ended: Mapping[str, tuple[EventType, str | None]], *, now: datetime | None = None
) -> set[tuple[str, int]]:
    """Once maps' own terminal events are recorded (`ended`: dispatch id -> its event type and
    reason): every item of theirs still open ends now, cancelled with a cancelled map, else
    failed with the map's reason. A dispatch that is not a map costs nothing but the one
    query that finds the maps among `ended`. The pairs this call ended."""
    maps = {row for row in by_ids(session, ended, session.scalars, _MAP_IDS_AMONG)}
    if not maps:
        return set()
    ends = session.execute(
        sa.select(MapItem.dispatch_id, MapItem.item_index)
        .outerjoin(
            MapItemEnd,
            sa.and_(MapItemEnd.dispatch_id == MapItem.dispatch_id, MapItemEnd.item_index == MapItem.item_index),
        )
        .where(MapItem.dispatch_id.in_(sorted(maps)), MapItemEnd.item_index.is_(None))
    )
    open_items = [
        ItemEnd(
            d,
            int(i),
            ITEM_END_FOR_MAP_END[EventType(ended[d][0])],
            {"reason": ended[d][1] or "MapEnded", "message": "the map ended before this item did"},
        )
        for d, i in ends
    ]
    return record_item_ends(session, open_items, now=now)


_MAP_IDS_AMONG = sa.select(DispatchMap.dispatch_id).where(
    DispatchMap.dispatch_id.in_(sa.bindparam("ids", expanding=True))
)


def item_counts(session: Session, dispatch_id: str) -> dict[str, int]:
    """The map's ended items by ItemEventType value."""
    query = (
        sa.select(MapItemEnd.type, sa.func.count())
        .where(MapItemEnd.dispatch_id == dispatch_id)
        .group_by(MapItemEnd.type)
    )
    return {str(kind): int(n) for kind, n in session.execute(query)}


@dataclass(frozen=True)
class Progress:
    """How far a map is, from the store alone: its items, and how many ended which way."""

    items: int
    succeeded: int
    failed: int
    cancelled: int

    @property
    def open(self) -> int:
        """Items not ended yet: running, retrying or waiting for a Pod (the cluster says which)."""
        return self.items - self.succeeded - self.failed - self.cancelled


def progress(session: Session, dispatch_id: str) -> Progress | None:
    """The map's progress (two indexed reads); None if the dispatch is not a map."""
    shape = map_shapes(session, [dispatch_id]).get(dispatch_id)
    if shape is None:
        return None
    counts = item_counts(session, dispatch_id)
    return Progress(
        items=shape.items,
        succeeded=counts.get(ItemEventType.ITEM_COMPLETED.value, 0),
        failed=counts.get(ItemEventType.ITEM_FAILED.value, 0),
        cancelled=counts.get(ItemEventType.ITEM_CANCELLED.value, 0),
    )
