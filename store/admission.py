"""Admission: queued dispatches take the slots their limits free, decided by the database alone.

A pass runs in the caller's transaction: it takes the admission turn (the one row of
`dispatch_admission`, locked until commit: replicas' passes run one after the other), counts
what holds slots of the limited tenancies and capabilities, reads the first few dispatches of
each queue with work, lets `core.limits.choose` decide, and moves the chosen QUEUED ->
SCHEDULED. After the commit the pass's worker makes their Jobs (`tasks/admission.py`); a crash
in between leaves them SCHEDULED, holding their slot, for the sweep to create (never a second
slot, never a leaked one). A slot frees when the terminal event is recorded: the count reads
states, not Jobs.

Maps (fan-out, `store/maps.py`): a map's Indexed Job runs up to its `parallelism` Pods at
once, so it holds that many slots, not one. It is admitted as soon as its tenancy and capability
have one free slot, and takes as many more as they have room for, up to min(parallelism, items),
sharing them with the other tenancies by weight (`core.limits.choose`). What it got is written
over its `dispatch_maps.parallelism` in the admission's transaction, so the Job made from that
row (the create, and any re-create after a loss) never runs more Pods than the slots held: the
limit holds in Pods, not only in Jobs. Why not wait for room for the whole parallelism: a map
wider than the free room (or than the limit) would wait behind every single dispatch that takes
a slot as it frees, possibly forever; admitted narrower, it runs now, and the room is never
exceeded. The parallelism asked stays in the map's dispatch input (its `map` summary). A map
holds (`slots_held`) min(parallelism, open items) slots, and at least one until its end: as
its last items end, their slots free for others. A map that ended holds its whole parallelism
until its Job is seen stopped, as any ended dispatch holds its slot.

Cost: no API request, and reads bounded by the slots it can fill and the queues with work,
not by how many wait: the queue index gives the queues by a skip scan (one probe per queue)
and each queue's head by a LIMIT. Counting what holds reads, for each map holding slots, its
ended items (the primary key's index, not the items).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.orm import Session

from k8s_dispatch.core.errors import ConfigError
from k8s_dispatch.core.limits import DEFAULT_TENANCY, Candidate, Limits, Pair, choose, free_slots
from k8s_dispatch.store.models import (
    HOLDING_STATES,
    STOPPING_STATES,
    Dispatch,
    DispatchAdmission,
    DispatchMap,
    DispatchState,
    MapItemEnd,
)

# Queued dispatches admitted per pass at most where no limit bounds them (rows an engine wrote
# itself as QUEUED, or a limit since removed): the next pass takes the next page.
UNLIMITED_PAGE = 500


@dataclass(frozen=True)
class Admitted:
    dispatch_id: str
    case_id: str
    tenancy_id: str
    capability: str
    waited_s: float  # queued for this long (the database's clock)
    parallelism: int | None = None  # a map's: the Pods its Job may run at once (the slots it got)


def admit(session: Session, limits: Limits, *, now: datetime, page: int = UNLIMITED_PAGE) -> list[Admitted]:
    """One admission pass in the caller's transaction; the dispatches it admitted (commit to
    make it so). See the module's docstring."""
    table = Dispatch.__table__
    queues = queues_with_work(session)
    if not queues or not _room(limits, holding(session, limits), queues):
        return []  # nothing waits, or every queue's limit is full: no turn taken (no write)
    _take_turn(session)
    queues = queues_with_work(session)  # read again under the turn: exact from here
    running = holding(session, limits)
    heads: dict[Pair, list[Candidate]] = {}
    case_of: dict[str, str] = {}
    map_ids: set[str] = set()
    for pair in queues:
        free = free_slots(limits, running, pair)
        n = page if free is None else min(free, page)
        if n > 0:
            heads[pair] = _head(session, pair, n, case_of, map_ids)
    chosen = choose(limits, running, heads)
    if not chosen:
        return []
    ids = sorted(c.dispatch_id for c in chosen)
    moved = set(
        session.scalars(
            sa.update(table)
            .where(table.c.dispatch_id.in_(ids), table.c.state == DispatchState.QUEUED)
            .values(state=DispatchState.SCHEDULED, admitted_at=now, updated_at=now)
            .returning(table.c.dispatch_id)
        )
    )
    _narrow(session, {c.dispatch_id: c.slots for c in chosen if c.dispatch_id in moved and c.dispatch_id in map_ids})
    waited = {c.dispatch_id: max(0.0, (now - c.created_at).total_seconds()) for c in chosen}
    return [
        Admitted(
            c.dispatch_id,
            case_of[c.dispatch_id],
            c.tenancy_id,
            c.capability,
            waited[c.dispatch_id],
            c.slots if c.dispatch_id in map_ids else None,
        )
        for c in chosen
        if c.dispatch_id in moved
    ]


def _narrow(session: Session, granted: Mapping[str, int]) -> None:
    """Write the maps' granted parallelism where they got less than they asked (one statement)."""
    table = DispatchMap.__table__
    ids = sorted(granted)
    if ids:
        grant = sa.case(granted, value=table.c.dispatch_id)
        asked = _least(table.c.parallelism, table.c["items"])
        session.execute(sa.update(table).where(table.c.dispatch_id.in_(ids), asked > grant).values(parallelism=grant))


def _room(limits: Limits, running: Mapping[Pair, int], queues: list[Pair]) -> bool:
    """Whether any queue may have a free slot, read before the turn (pure). A slot freed after
    this read is its ender's to fill: it runs a pass once its end commits (`Runtime.on_ended`)."""
    return any(free_slots(limits, running, pair) != 0 for pair in queues)


def _take_turn(session: Session) -> None:
    """Lock the admission row until commit (PostgreSQL: its row lock; SQLite: the write lock)."""
    turn = DispatchAdmission.__table__
    taken = session.execute(sa.update(turn).where(turn.c.id == 1).values(passes=turn.c.passes + 1))
    if not taken.rowcount:  # type: ignore[attr-defined]  # an UPDATE's CursorResult has one
        raise ConfigError("the database has no admission row: run the migrations (k8s-dispatch migrate)")


def holding(session: Session, limits: Limits) -> dict[Pair, int]:
    """(tenancy, capability) -> slots held, for the pairs a limit covers: by the dispatches
    admitted and not ended, and those ended whose Job may still run (`stopping`); a map's as
    `slots_held` says."""
    table = Dispatch.__table__
    holds = sa.or_(table.c.state.in_(sorted(HOLDING_STATES)), stopping(table))  # one statement, two index scans
    query = sa.select(table.c.tenancy_id, table.c.capability, sa.func.sum(slots_held(table))).where(holds)
    if DEFAULT_TENANCY not in limits.tenancies:  # else every tenancy is limited
        named = sorted(limits.tenancies)
        query = query.where(sa.or_(table.c.tenancy_id.in_(named), table.c.capability.in_(sorted(limits.capabilities))))
    query = query.group_by(table.c.tenancy_id, table.c.capability)
    return {(t, c): int(n) for t, c, n in session.execute(query)}


def slots_held(table: sa.Table) -> sa.ColumnElement[int]:
    """The slots a dispatch that holds any holds: 1; a map's, the Pods its Job may run at once.

    Admitted and not ended: min(parallelism, open items), at least 1 (an item ends only once its
    Pod has finished, so the Job runs no more Pods than that; the last one holds until the map's
    end, as any dispatch with a Job does). Ended, its Job maybe still running: min(parallelism,
    items), at least 1 (its open items were ended with the map, their Pods maybe not yet). A
    correlated subquery: one probe of the map's primary key per holding row, and its ends
    counted on their index; nothing for a dispatch that is not a map."""
    maps, ends = DispatchMap.__table__, MapItemEnd.__table__
    ended = sa.func.count(ends.c.item_index)
    running = sa.case(
        (table.c.state.in_(sorted(HOLDING_STATES)), _at_least_one(_least(maps.c.parallelism, maps.c["items"] - ended))),
        else_=_at_least_one(_least(maps.c.parallelism, maps.c["items"])),
    )
    own = (
        sa.select(running)
        .select_from(maps.outerjoin(ends, ends.c.dispatch_id == maps.c.dispatch_id))
        .where(maps.c.dispatch_id == table.c.dispatch_id)
        .group_by(maps.c.dispatch_id, maps.c.parallelism, maps.c["items"])
        .scalar_subquery()
    )
    return sa.func.coalesce(own, 1)


def _least(a: sa.ColumnElement[int], b: sa.ColumnElement[int]) -> sa.ColumnElement[int]:
    return sa.case((a < b, a), else_=b)  # LEAST is PostgreSQL's, not SQLite's


def _at_least_one(a: sa.ColumnElement[int]) -> sa.ColumnElement[int]:
    return sa.case((a < 1, 1), else_=a)


def stopping(table: sa.Table) -> sa.ColumnElement[bool]:
    """Ended, its Job not yet seen stopped, and it had (or may have had) a Job: admitted, or its
    Job recorded. A dispatch cancelled while queued never held a slot. `ix_dispatches_stopping`
    holds the rows of the first two terms."""
    return sa.and_(
        table.c.job_stopped_at.is_(None),
        table.c.state.in_(sorted(STOPPING_STATES)),
        sa.or_(table.c.admitted_at.is_not(None), table.c.job_created_at.is_not(None)),
    )


def queues_with_work(session: Session) -> list[Pair]:
    """The (tenancy, capability) queues with a QUEUED dispatch, by a skip scan of the queue
    index: one probe per queue, whatever their length."""
    table = Dispatch.__table__
    pairs: list[Pair] = []
    after: Pair | None = None
    while True:
        query = sa.select(table.c.tenancy_id, table.c.capability).where(table.c.state == DispatchState.QUEUED)
        if after is not None:
            query = query.where(sa.tuple_(table.c.tenancy_id, table.c.capability) > sa.tuple_(*after))
        row = session.execute(query.order_by(table.c.tenancy_id, table.c.capability).limit(1)).first()
        if row is None:
            return pairs
        after = (row[0], row[1])
        pairs.append(after)


def _queue_order(table: sa.Table) -> tuple[sa.ColumnElement[object], ...]:
    return (table.c.priority.desc(), table.c.created_at, table.c.dispatch_id)


def _head(session: Session, pair: Pair, n: int, case_of: dict[str, str], map_ids: set[str]) -> list[Candidate]:
    """The queue's first `n`, best first, each asking its slots (a map: min(parallelism,
    items), by a probe of its primary key); their cases noted in `case_of`, the maps in `map_ids`."""
    table, maps = Dispatch.__table__, DispatchMap.__table__
    asks = (
        sa.select(_least(maps.c.parallelism, maps.c["items"]))
        .where(maps.c.dispatch_id == table.c.dispatch_id)
        .scalar_subquery()
    )
    query = (
        sa.select(table.c.dispatch_id, table.c.priority, table.c.created_at, table.c.case_id, asks)
        .where(table.c.state == DispatchState.QUEUED, table.c.tenancy_id == pair[0], table.c.capability == pair[1])
        .order_by(*_queue_order(table))
        .limit(n)
    )
    heads = []
    for d, p, created, case_id, slots in session.execute(query):
        heads.append(Candidate(d, pair[0], pair[1], p, created, 1 if slots is None else max(1, int(slots))))
        case_of[d] = case_id
        if slots is not None:
            map_ids.add(d)
    return heads


# --- what operators see ----------------------------------------------------------------------


@dataclass(frozen=True)
class QueueSummary:
    """One (tenancy, capability): the slots held (a map holds as many as its Job may run Pods
    at once), the dispatches waiting, since when."""

    tenancy_id: str
    capability: str
    running: int
    queued: int
    oldest_queued_at: datetime | None


def summary(session: Session) -> list[QueueSummary]:
    """Every (tenancy, capability) that holds or waits for a slot: one grouped read of the
    open dispatches and of the ended ones whose Job may still run (an operator's view,
    O(open dispatches)). `running` counts slots as admission does (`slots_held`)."""
    table = Dispatch.__table__
    holds = sa.or_(table.c.state.in_(sorted(HOLDING_STATES)), stopping(table))
    query = (
        sa.select(
            table.c.tenancy_id,
            table.c.capability,
            sa.func.coalesce(sa.func.sum(slots_held(table)).filter(holds), 0),
            sa.func.count().filter(table.c.state == DispatchState.QUEUED),
            sa.func.min(table.c.created_at).filter(table.c.state == DispatchState.QUEUED),
        )
        .where(sa.or_(table.c.state.in_(sorted({*HOLDING_STATES, DispatchState.QUEUED})), stopping(table)))
        .group_by(table.c.tenancy_id, table.c.capability)
        .order_by(table.c.tenancy_id, table.c.capability)
    )
    return [
        QueueSummary(t, c, int(running), queued, oldest) for t, c, running, queued, oldest in session.execute(query)
    ]


def place(session: Session, dispatch_id: str) -> int | None:
    """A queued dispatch's place in its (tenancy, capability) queue (1: next), None if it is
    not queued. Counts the dispatches ahead of it: O(its place)."""
    table = Dispatch.__table__
    row = session.execute(
        sa.select(table.c.tenancy_id, table.c.capability, table.c.priority, table.c.created_at).where(
            table.c.dispatch_id == dispatch_id, table.c.state == DispatchState.QUEUED
        )
    ).first()
    if row is None:
        return None
    tenancy, capability, priority, created_at = row
    ahead = session.scalar(
        sa.select(sa.func.count()).where(
            table.c.state == DispatchState.QUEUED,
            table.c.tenancy_id == tenancy,
            table.c.capability == capability,
            sa.or_(
                table.c.priority > priority,
                sa.and_(
                    table.c.priority == priority,
                    sa.or_(
                        table.c.created_at < created_at,
                        sa.and_(table.c.created_at == created_at, table.c.dispatch_id < dispatch_id),
                    ),
                ),
            ),
        )
    )
    return int(ahead or 0) + 1


def by_tenancy(rows: list[QueueSummary]) -> Mapping[str, tuple[int, int]]:
    """tenancy -> (slots held, dispatches queued), summed over its capabilities (pure)."""
    out: dict[str, tuple[int, int]] = {}
    for row in rows:
        running, queued = out.get(row.tenancy_id, (0, 0))
        out[row.tenancy_id] = (running + row.running, queued + row.queued)
    return out
