"""The store's transactions: schedule a dispatch, record its Job, record its one terminal event.

Every function runs in the caller's transaction: the session is passed in and the caller
commits (usually through `store.db.transaction`). Requests are validated before anything is
written, so a typed error leaves the database as it was. Races are settled by the database's
unique indexes, never by reading first: the (tenancy, idempotency key) constraint for
`schedule`, the partial unique index on terminal events for `record_terminal`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, TypeVarTuple, cast

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session
from sqlalchemy.orm.util import identity_key

from k8s_dispatch.core.errors import (
    ConfigError,
    IdempotencyConflict,
    InputNotSerialisable,
    InvalidId,
    InvalidInput,
    TenancyMismatch,
    UnknownCapability,
    UnknownCase,
    UnknownDispatch,
)
from k8s_dispatch.core.ids import check_dispatch_id, check_id, check_idempotency_key, show_value
from k8s_dispatch.core.limits import Limits
from k8s_dispatch.core.names import is_dns1123_label
from k8s_dispatch.core.payloads import canonical_json, encode_input
from k8s_dispatch.store.db import database_now
from k8s_dispatch.store.models import (
    STATE_FOR_TERMINAL_EVENT,
    TERMINAL_EVENT_PREDICATE,
    TERMINAL_EVENT_TYPES,
    TERMINAL_STATES,
    CaseEvent,
    CaseInstance,
    Dispatch,
    DispatchState,
    EventType,
)

MAX_INT32 = 2**31 - 1
QUERY_BATCH = 500  # ids per IN (...) and rows per page: bounded memory, few round trips


class CapabilityRouter(Protocol):
    """Names the worker that serves a capability (implemented by the workers' resolver).

    A router that also has `namespace_for(capability) -> str | None` (the resolver has) names
    where the capability's Jobs go: `schedule_many` records it in the dispatch, fixed from then
    on. Without it (or with None) the first worker to create the Job fixes it
    (`fix_job_namespaces`).
    """

    def worker_for(self, capability: str) -> str:
        """Raises UnknownCapability if no worker serves `capability`."""
        ...


@dataclass(frozen=True)
class ScheduleResult:
    dispatch_id: str
    created: bool  # False: the (tenancy, idempotency key) was scheduled before; nothing written
    state: DispatchState


# --- cases -----------------------------------------------------------------------------


def create_case(
    session: Session,
    *,
    case_id: str,
    tenancy_id: str,
    data: Any = None,
    state: str = "OPEN",
) -> CaseInstance:
    """The case `case_id`, created if it does not exist (the engine owns cases; tests and the
    demo use this).

    Raises:
        InvalidId: a case or tenancy id is invalid.
        InputNotSerialisable: `data` is not JSON the store can keep.
        TenancyMismatch: the case exists under another tenancy.
    """
    check_id("case_id", case_id)
    check_id("tenancy_id", tenancy_id)
    canonical_json(data, what="case data")
    case = session.get(CaseInstance, case_id)
    if case is None:
        case = CaseInstance(id=case_id, tenancy_id=tenancy_id, state=state, data=data)
        session.add(case)
        session.flush()
    elif case.tenancy_id != tenancy_id:
        raise TenancyMismatch(f"case {case_id!r} belongs to another tenancy")
    return case


# --- schedule --------------------------------------------------------------------------


@dataclass(frozen=True)
class ScheduleRequest:
    """One dispatch to schedule: `schedule`'s keyword arguments, less the router and the limit."""

    case_id: str
    tenancy_id: str
    capability: str
    input: Any
    idempotency_key: str
    dispatch_id: str | None = None  # else a fresh uuid4
    priority: int = 0  # within its tenancy's queue, when a limit queues it: higher first


def schedule(
    session: Session,
    *,
    case_id: str,
    tenancy_id: str,
    capability: str,
    input: Any,
    idempotency_key: str,
    router: CapabilityRouter,
    max_input_bytes: int,
    dispatch_id: str | None = None,
    priority: int = 0,
    now: datetime | None = None,
) -> ScheduleResult:
    """Write a dispatch (SCHEDULED, or QUEUED under a limit) and its WORKER_SCHEDULED event in
    the caller's transaction: `schedule_many` for one request (its rules, errors and idempotency)."""
    request = ScheduleRequest(case_id, tenancy_id, capability, input, idempotency_key, dispatch_id, priority)
    return schedule_many(session, [request], router=router, max_input_bytes=max_input_bytes, now=now)[0]


def schedule_many(
    session: Session,
    requests: Sequence[ScheduleRequest],
    *,
    router: CapabilityRouter,
    max_input_bytes: int,
    now: datetime | None = None,
) -> list[ScheduleResult]:
    """Write dispatches (SCHEDULED) and their WORKER_SCHEDULED events in the caller's
    transaction, with a few statements whatever their number: one read of the idempotency
    keys, one of the cases, one multi-row INSERT per table. A result per request, in order.

    Each dispatch's Job namespace is recorded from `router.namespace_for`, when the router
    has it: a later change of the capability's config moves only new dispatches. A router with
    `limits` (an `core.limits.Limits`) queues the dispatches a limit covers: written QUEUED,
    they wait for admission (`store.admission`) instead of having their Jobs created.

    Idempotent on (tenancy_id, idempotency_key): a repeat of a request (an earlier one, or one
    earlier in `requests`) returns the existing dispatch with `created=False` and writes
    nothing for it, also when the first request commits concurrently (the insert skips rows
    whose key exists, in a SAVEPOINT, and the winners are re-read; this relies on READ
    COMMITTED, PostgreSQL's default). The event's payload holds capability, worker_name,
    idempotency_key and input.

    Raises (all before anything of the batch is written; the first bad request's error):
        InvalidId: case_id or tenancy_id invalid; dispatch_id not a UUID or already in use.
        InvalidIdempotencyKey, InputNotSerialisable, InputTooLarge
        InvalidInput: priority is not an integer within 32 bits.
        UnknownCapability: from `router`.
        UnknownCase, TenancyMismatch: the case is missing or belongs to another tenancy.
        IdempotencyConflict: the key was used for a different case, capability or input.
        ConfigError: the router names a namespace that is not a DNS-1123 label.
    """
    namespace_for = getattr(router, "namespace_for", None)
    limits: Limits = getattr(router, "limits", None) or Limits()
    prepared = [
        _prepare(request, router=router, namespace_for=namespace_for, limits=limits, max_input_bytes=max_input_bytes)
        for request in requests
    ]
    if not prepared:
        return []
    if len(prepared) == 1 and session.get_bind().dialect.name == "postgresql":
        # One new dispatch (an engine scheduling step by step): two statements, the usual case.
        # Nothing inserted (a repeat, a bad case, an id in use, a racing commit of the key)
        # wrote nothing either, and the general path below reads and decides as it always did.
        (p,) = prepared
        if _insert_one(session, p, now=now or database_now(session)):
            return [ScheduleResult(dispatch_id=p.dispatch_id, created=True, state=p.state)]
    existing = _dispatches_by_key(session, {(p.tenancy_id, p.idempotency_key) for p in prepared})
    new = _new_dispatches(session, prepared, existing)
    if new:
        existing.update(_insert(session, new, now=now or database_now(session)))
    written = {(p.tenancy_id, p.idempotency_key): p for p in new}
    results = []
    for p in prepared:
        key = (p.tenancy_id, p.idempotency_key)
        if key in existing:
            results.append(_repeat(existing[key], p))
        elif p.repeat:
            results.append(_repeat(written[key], p))
        else:
            results.append(ScheduleResult(dispatch_id=p.dispatch_id, created=True, state=p.state))
    return results


@dataclass
class _Prepared:
    """A checked request: what its rows hold."""

    dispatch_id: str
    chosen_by_caller: bool
    case_id: str
    tenancy_id: str
    capability: str
    worker_name: str
    idempotency_key: str
    encoded_input: str
    input: Any  # plain JSON types, as stored
    job_namespace: str | None = None  # where its Job goes, fixed now (None: by the first worker)
    priority: int = 0
    state: DispatchState = DispatchState.SCHEDULED  # QUEUED: a limit covers it
    repeat: bool = False  # its key is an earlier request's of the same batch


def _prepare(
    request: ScheduleRequest,
    *,
    router: CapabilityRouter,
    namespace_for: Callable[[str], str | None] | None,
    limits: Limits,
    max_input_bytes: int,
) -> _Prepared:
    """The checks that need no database, in `schedule`'s documented order."""
    check_id("case_id", request.case_id)
    check_id("tenancy_id", request.tenancy_id)
    chosen_by_caller = request.dispatch_id is not None
    dispatch_id = check_dispatch_id(request.dispatch_id) if chosen_by_caller else str(uuid.uuid4())
    check_idempotency_key(request.idempotency_key)
    encoded = encode_input(request.input, max_bytes=max_input_bytes)
    priority = request.priority
    if isinstance(priority, bool) or not isinstance(priority, int) or not -MAX_INT32 - 1 <= priority <= MAX_INT32:
        raise InvalidInput(f"priority must be an integer within 32 bits, got {show_value(priority)}")
    capability = request.capability
    if not isinstance(capability, str) or not capability:
        raise UnknownCapability(f"capability must be a non-empty string, got {show_value(capability)}")
    worker_name = router.worker_for(capability)
    namespace = namespace_for(capability) if namespace_for is not None else None
    if namespace is not None and not (isinstance(namespace, str) and is_dns1123_label(namespace)):
        raise ConfigError(f"capability {capability!r}: namespace {show_value(namespace)} is not a DNS-1123 label")
    return _Prepared(
        dispatch_id=dispatch_id,
        chosen_by_caller=chosen_by_caller,
        case_id=request.case_id,
        tenancy_id=request.tenancy_id,
        capability=capability,
        worker_name=worker_name,
        idempotency_key=request.idempotency_key,
        encoded_input=encoded,
        input=json.loads(encoded),  # tuples become lists, as on reading
        job_namespace=namespace,
        priority=priority,
        state=DispatchState.QUEUED if limits.limits(request.tenancy_id, capability) else DispatchState.SCHEDULED,
    )


def _new_dispatches(
    session: Session, prepared: list[_Prepared], existing: dict[tuple[str, str], Any]
) -> list[_Prepared]:
    """The requests to insert (a key's first request, if the key is not in `existing`), once
    every request was found consistent with the database and with the rest of the batch."""
    new: dict[tuple[str, str], _Prepared] = {}
    for p in prepared:
        key = (p.tenancy_id, p.idempotency_key)
        if key in existing:
            _repeat(existing[key], p)
        elif key in new:
            _repeat(new[key], p)
            p.repeat = True
        else:
            new[key] = p
    case_ids = sorted({p.case_id for p in new.values()})
    query = sa.select(CaseInstance.id, CaseInstance.tenancy_id).where(CaseInstance.id.in_(case_ids))
    cases = {case_id: tenancy_id for case_id, tenancy_id in session.execute(query)} if new else {}
    chosen = [p.dispatch_id for p in new.values() if p.chosen_by_caller]
    # A fresh uuid4 cannot be in use: only a caller's ids are looked up.
    in_use = set(_ids_in_use(session, chosen)) if chosen else set()
    seen_ids: set[str] = set()
    for p in new.values():
        if p.case_id not in cases:
            raise UnknownCase(f"case {p.case_id!r} does not exist")
        if cases[p.case_id] != p.tenancy_id:
            raise TenancyMismatch(f"case {p.case_id!r} does not belong to tenancy {p.tenancy_id!r}")
        if p.dispatch_id in in_use or p.dispatch_id in seen_ids:
            raise InvalidId(f"dispatch_id {p.dispatch_id} is already used by another request")
        seen_ids.add(p.dispatch_id)
    return list(new.values())


def _insert(session: Session, new: list[_Prepared], *, now: datetime) -> dict[tuple[str, str], Any]:
    """Insert `new`'s dispatch rows (skipping any whose key or id got taken meanwhile) and the
    events of those inserted, in one SAVEPOINT; the winners of the keys that got taken.

    Raises (the SAVEPOINT rolled back): IdempotencyConflict, InvalidId, as `schedule_many`.
    """
    # Executemany: SQLAlchemy sends the rows as ONE multi-row INSERT ("insertmanyvalues", up to
    # 1,000 rows a statement) from a statement compiled once and cached, where `.values(rows)`
    # would compile a new statement of rows x columns parameters for every batch.
    table = Dispatch.__table__
    insert = _insert_for(session)(table).on_conflict_do_nothing().returning(table.c.dispatch_id)
    # Rows in key order: a concurrent batch with some of the same keys waits on them in the
    # same order (an insert waits for the other's uncommitted row), so the two never deadlock.
    rows = [_dispatch_row(p, now) for p in sorted(new, key=lambda p: (p.tenancy_id, p.idempotency_key))]
    with session.begin_nested():
        inserted = set(session.scalars(insert, rows))
        lost = [p for p in new if p.dispatch_id not in inserted]
        # Another transaction committed the same key (or took a caller's id) since we read.
        winners = _dispatches_by_key(session, {(p.tenancy_id, p.idempotency_key) for p in lost}) if lost else {}
        for p in lost:
            winner = winners.get((p.tenancy_id, p.idempotency_key))
            if winner is None:
                raise InvalidId(f"dispatch_id {p.dispatch_id} is already used by another request")
            _repeat(winner, p)
        events = [_event_row(p, now) for p in new if p.dispatch_id in inserted]
        if events:  # RETURNING makes this one multi-row INSERT too, not an executemany
            session.execute(sa.insert(CaseEvent.__table__).returning(CaseEvent.__table__.c.id), events)
    return winners


def _insert_one(session: Session, p: _Prepared, *, now: datetime) -> bool:
    """Insert one dispatch and its event in two statements, if its case exists with its tenancy
    and neither its key nor its id is taken; True if it did. A False wrote nothing.

    The general path costs six (two reads, a SAVEPOINT, two INSERTs, its release): most of an
    engine's CPU per dispatch when it writes one per transaction. Here the case's check is the
    INSERT's own SELECT, and ON CONFLICT DO NOTHING waits for a racing uncommitted row with the
    same key, as the general path's INSERT does; the event follows only a row inserted.
    """
    insert_row, insert_event = _insert_one_statements()
    connection = session.connection()
    if connection.execute(insert_row, _dispatch_row(p, now)).first() is None:
        return False
    connection.execute(insert_event, _event_row(p, now))
    return True


# Built once (and so compiled once, through SQLAlchemy's cache).
_INSERT_ONE: list[tuple[sa.Insert, sa.Insert]] = []
# `_dispatch_row`'s keys less the two the case's row gives.
_ONE_ROW_COLUMNS = (
    "dispatch_id", "capability", "worker_name", "idempotency_key", "input", "state", "job_namespace", "attempts",
    "priority", "created_at", "updated_at",
)  # fmt: skip


def _insert_one_statements() -> tuple[sa.Insert, sa.Insert]:
    """`INSERT INTO dispatches ... SELECT ... FROM case_instances WHERE id AND tenancy match ON
    CONFLICT DO NOTHING RETURNING dispatch_id`, and the plain INSERT of its event."""
    if not _INSERT_ONE:
        table, cases = Dispatch.__table__, CaseInstance.__table__
        select = sa.select(
            cases.c.id, cases.c.tenancy_id, *(sa.bindparam(c, type_=table.c[c].type) for c in _ONE_ROW_COLUMNS)
        ).where(cases.c.id == sa.bindparam("case_id"), cases.c.tenancy_id == sa.bindparam("tenancy_id"))
        insert_row = (
            postgresql.insert(table)
            .from_select(["case_id", "tenancy_id", *_ONE_ROW_COLUMNS], select)
            .on_conflict_do_nothing()
            .returning(table.c.dispatch_id)
        )
        _INSERT_ONE.append((insert_row, sa.insert(CaseEvent.__table__)))
    return _INSERT_ONE[0]


def _dispatch_row(p: _Prepared, now: datetime) -> dict[str, Any]:
    # The columns of a new row, spelled out: the same names recur wherever a dispatch crosses a
    # layer (delivery/reconstruct.DispatchRecord.from_row reads them back, the tests build rows),
    # and each says which value it takes here; a generic copy would hide that `state`, `attempts`
    # and the times are set by this insert, not taken from the request.
    return dict(
        dispatch_id=p.dispatch_id,
        case_id=p.case_id,
        tenancy_id=p.tenancy_id,
        capability=p.capability,
        worker_name=p.worker_name,
        idempotency_key=p.idempotency_key,
        input=p.input,
        state=p.state,
        job_namespace=p.job_namespace,
        attempts=0,
        priority=p.priority,
        created_at=now,
        updated_at=now,
    )


def _event_row(p: _Prepared, now: datetime) -> dict[str, Any]:
    payload = {
        "capability": p.capability,
        "worker_name": p.worker_name,
        "idempotency_key": p.idempotency_key,
        "input": p.input,
    }
    return dict(
        case_id=p.case_id,
        dispatch_id=p.dispatch_id,
        type=EventType.WORKER_SCHEDULED.value,
        payload=payload,
        created_at=now,
    )


def _dispatches_by_key(session: Session, keys: Collection[tuple[str, str]]) -> dict[tuple[str, str], Any]:
    """The dispatches holding `keys` ((tenancy_id, idempotency_key)), as plain rows, by key."""
    found: dict[tuple[str, str], Any] = {}
    wanted = sorted(keys)
    table = Dispatch.__table__
    for start in range(0, len(wanted), QUERY_BATCH):
        chunk = wanted[start : start + QUERY_BATCH]
        query = sa.select(table).where(sa.tuple_(table.c.tenancy_id, table.c.idempotency_key).in_(chunk))
        found.update({(row.tenancy_id, row.idempotency_key): row for row in session.execute(query)})
    return found


def _ids_in_use(session: Session, ids: list[str]) -> Iterator[str]:
    return _by_ids(session, ids, session.scalars, _IDS_IN_USE)


def _repeat(existing: Any, request: _Prepared) -> ScheduleResult:
    """The result of a repeated request, if it is the same request as `existing`'s (a
    dispatch row, or the batch's earlier request with the same key)."""
    differences = [
        name
        for name, same in (
            ("case_id", existing.case_id == request.case_id),
            ("capability", existing.capability == request.capability),
            ("input", canonical_json(existing.input) == request.encoded_input),
        )
        if not same
    ]
    if differences:
        raise IdempotencyConflict(
            f"idempotency key {existing.idempotency_key!r} was used for dispatch {existing.dispatch_id} "
            f"with a different {', '.join(differences)}"
        )
    return ScheduleResult(dispatch_id=existing.dispatch_id, created=False, state=DispatchState(existing.state))


# --- the Job's progress ----------------------------------------------------------------


@dataclass(frozen=True)
class CreatedJob:
    """Where a dispatch's Job was created, for `mark_created_many`."""

    dispatch_id: str
    job_name: str
    namespace: str
    attempt: int


def mark_created(
    session: Session,
    dispatch_id: str,
    *,
    job_name: str,
    namespace: str,
    attempt: int,
    now: datetime | None = None,
) -> bool:
    """Record that the dispatch's Job exists: `mark_created_many` for one; False, changing
    nothing, if the dispatch is already terminal.

    Raises:
        UnknownDispatch
    """
    return bool(mark_created_many(session, [CreatedJob(dispatch_id, job_name, namespace, attempt)], now=now))


def mark_created_many(session: Session, jobs: Sequence[CreatedJob], *, now: datetime | None = None) -> set[str]:
    """Record that the dispatches' Jobs exist: state CREATED, where each Job is, when it was
    created; `attempts` becomes at least the Job's `attempt`. A Job namespace the dispatch
    recorded already is kept (never overwritten): the caller created the Job there.

    Repeating it (a retried create that adopted its Job) is harmless. Returns the ids marked;
    a dispatch that is terminal already is left unchanged (and not returned).

    Raises:
        UnknownDispatch: one of the dispatches does not exist.
    """
    now = now or database_now(session)
    by_id = {job.dispatch_id: job for job in jobs}
    if not by_id:
        return set()
    # One cached per-row UPDATE, executed many: the statement is compiled once per process,
    # where a per-batch `case` of every row was compiled on every call.
    updated = _rowcount(
        session.execute(
            _MARK_CREATED,
            [  # rows in id order, as every writer takes them: two batches never deadlock
                {
                    "m_id": d,
                    "m_job_name": job.job_name,
                    "m_namespace": job.namespace,
                    "m_attempt": job.attempt,
                    "m_now": now,
                }
                for d, job in sorted(by_id.items())
            ],
        )
    )
    if updated == len(by_id):  # one row per id at most (the primary key): all were marked
        return set(by_id)
    # Every CREATED row among the ids is one just updated: the UPDATE matched them all and
    # holds their locks, and a terminal dispatch never goes back to CREATED.
    marked = set(_by_ids(session, by_id, session.scalars, _CREATED_AMONG))
    unmarked = by_id.keys() - marked
    if unmarked:
        missing = unmarked - set(_ids_in_use(session, sorted(unmarked)))
        if missing:
            raise UnknownDispatch(f"dispatch {sorted(missing)[0]!r} does not exist")
    return marked


def _mark_created_statement() -> sa.Update:
    table = Dispatch.__table__
    attempt = sa.bindparam("m_attempt", type_=table.c.attempts.type)
    now = sa.bindparam("m_now", type_=table.c.updated_at.type)
    return (
        sa.update(table)
        .where(
            table.c.dispatch_id == sa.bindparam("m_id", type_=table.c.dispatch_id.type),
            # not IN (...): its expanding parameter cannot be executed many
            sa.or_(table.c.state == DispatchState.SCHEDULED, table.c.state == DispatchState.CREATED),
        )
        .values(
            state=DispatchState.CREATED,
            job_name=sa.bindparam("m_job_name", type_=table.c.job_name.type),
            job_namespace=sa.func.coalesce(
                table.c.job_namespace, sa.bindparam("m_namespace", type_=table.c.job_namespace.type)
            ),
            job_created_at=now,
            attempts=sa.case((table.c.attempts < attempt, attempt), else_=table.c.attempts),
            updated_at=now,
        )
    )


_MARK_CREATED = _mark_created_statement()


def fix_job_namespaces(session: Session, wanted: Mapping[str, str]) -> dict[str, str]:
    """Fix the Job namespace of the dispatches among `wanted` (dispatch id -> namespace) that
    recorded none (a row an engine wrote itself), by compare-and-set: a namespace recorded
    first, by a racing worker, is kept. The namespace each of them now records, by id (a
    dispatch that does not exist is left out). Two statements, whatever their number.
    """
    if not wanted:
        return {}
    session.execute(_FIX_NAMESPACE, [{"f_id": d, "f_namespace": ns} for d, ns in sorted(wanted.items())])
    return {row.dispatch_id: row.job_namespace for row in _by_ids(session, wanted, session.execute, _NAMESPACE_OF)}


def _fix_namespace_statement() -> sa.Update:
    table = Dispatch.__table__
    return (
        sa.update(table)
        .where(
            table.c.dispatch_id == sa.bindparam("f_id", type_=table.c.dispatch_id.type),
            table.c.job_namespace.is_(None),
        )
        .values(job_namespace=sa.bindparam("f_namespace", type_=table.c.job_namespace.type))
    )


_FIX_NAMESPACE = _fix_namespace_statement()


def record_attempt(session: Session, dispatch_id: str, *, now: datetime | None = None) -> int:
    """Count one more attempt at creating the dispatch's Job; returns the new count.

    Raises:
        UnknownDispatch
    """
    attempts = session.execute(
        sa.update(Dispatch)
        .where(Dispatch.dispatch_id == dispatch_id)
        .values(attempts=Dispatch.attempts + 1, updated_at=now or database_now(session))
        .returning(Dispatch.attempts)
        .execution_options(synchronize_session="fetch")
    ).scalar_one_or_none()
    if attempts is None:
        raise UnknownDispatch(f"dispatch {dispatch_id!r} does not exist")
    return attempts


def record_create_error(session: Session, dispatch_id: str, *, message: str, now: datetime | None = None) -> bool:
    """Record why the dispatch's Job could not be created for now (a create to be retried: 403
    exceeded quota, the API unavailable), for `status` to show; False, changing nothing, if the
    dispatch is terminal or does not exist. `updated_at` is left alone: it is not progress.
    """
    table = Dispatch.__table__
    text = message.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")[:MAX_CREATE_ERROR_CHARS]
    return bool(
        _rowcount(
            session.execute(
                sa.update(table)
                .where(
                    table.c.dispatch_id == dispatch_id,
                    table.c.state.in_([DispatchState.SCHEDULED, DispatchState.CREATED]),
                )
                .values(create_error=text, create_error_at=now or database_now(session))
            )
        )
    )


MAX_CREATE_ERROR_CHARS = 1000


# --- the end ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TerminalEvent:
    """A dispatch's end, for `record_terminals`."""

    dispatch_id: str
    type: EventType
    payload: Mapping[str, Any]


def record_terminal(
    session: Session,
    dispatch_id: str,
    type: EventType,
    payload: Mapping[str, Any],
    *,
    now: datetime | None = None,
) -> bool:
    """Write the dispatch's terminal event, if it has none yet; True if this call wrote it
    (`record_terminals` for one).

    Raises:
        UnknownDispatch
        InvalidInput: `type` is not a terminal event type, or the reason is not a string.
        InputNotSerialisable: the payload is not a JSON object.
    """
    return bool(record_terminals(session, [TerminalEvent(dispatch_id, type, payload)], now=now))


def record_terminals(session: Session, events: Sequence[TerminalEvent], *, now: datetime | None = None) -> set[str]:
    """Write each dispatch's terminal event, where it has none yet; the ids this call wrote.

    The insert is `INSERT ... ON CONFLICT DO NOTHING` on the partial unique index of terminal
    events, so of any number of concurrent callers exactly one wins each dispatch, whatever the
    isolation. A winner also sets the dispatch's state, reason (`payload["reason"]`), output
    (`payload["output"]`) and finished_at, and touches its case; a loser writes nothing. Every
    event is checked before anything is written; rows are written in id order, so two batches
    racing on the same dispatches wait for each other and never deadlock. A dispatch named
    twice keeps its first event. A batch costs a handful of statements, whatever its size.

    A caller writing what came from outside (a Job's result) passes each event through
    `storable_terminal` first, so that one payload the store cannot keep fails its own dispatch
    instead of the batch.

    Raises:
        UnknownDispatch: one of the dispatches does not exist (nothing written).
        InvalidInput: a type is not a terminal event type, or a reason is not a string.
        InputNotSerialisable: a payload is not a JSON object, or a member of it is not
            `canonical_json` (nothing written).
    """
    checked: dict[str, tuple[EventType, dict[str, Any]]] = {}
    for event in events:
        checked.setdefault(event.dispatch_id, _checked_terminal(event))
    if not checked:
        return set()
    case_of = {row.dispatch_id: row.case_id for row in _by_ids(session, checked, session.execute, _CASE_OF)}
    missing = sorted(checked.keys() - case_of.keys())
    if missing:
        raise UnknownDispatch(f"dispatch {missing[0]!r} does not exist")

    now = now or database_now(session)
    ids = sorted(checked)
    # Executemany of one cached statement: SQLAlchemy sends it as one multi-row INSERT.
    won = set(
        session.scalars(
            _insert_terminal(session),
            [
                {
                    "case_id": case_of[d],
                    "dispatch_id": d,
                    "type": checked[d][0].value,
                    "payload": checked[d][1],
                    "created_at": now,
                }
                for d in ids
            ],
        )
    )
    if not won:  # every one recorded before, by another call
        return won
    session.execute(
        _END_DISPATCH,
        [
            {
                "t_id": d,
                "t_state": STATE_FOR_TERMINAL_EVENT[checked[d][0]],
                "t_reason": checked[d][1].get("reason"),
                "t_output": checked[d][1].get("output"),
                "t_now": now,
            }
            for d in ids
            if d in won
        ],
    )
    cases = sorted({case_of[d] for d in won})
    session.execute(
        sa.update(CaseInstance.__table__).where(CaseInstance.__table__.c.id.in_(cases)).values(updated_at=now)
    )
    # The updates above bypass the ORM: objects this session holds for these rows are stale.
    for key in [identity_key(Dispatch, d) for d in won] + [identity_key(CaseInstance, c) for c in cases]:
        stale = session.identity_map.get(key)
        if stale is not None:
            session.expire(stale)
    return won


def storable_terminal(event: TerminalEvent, *, reason: str) -> TerminalEvent:
    """`event` if `record_terminals` can keep its payload, else the dispatch's failure instead
    (pure): WORKER_FAILED with `reason` and a message saying why the payload was refused.

    Raises:
        InvalidInput: `event.type` is not a terminal event type (a caller's bug, not the data's).
    """
    _checked_type(event)
    try:
        _stored_payload(event.payload)
    except InvalidInput as e:
        why = str(e).encode("utf-8", "backslashreplace").decode("utf-8")  # never itself unstorable
        return TerminalEvent(
            event.dispatch_id,
            EventType.WORKER_FAILED,
            {"reason": reason, "message": f"the result cannot be stored: {why}"},
        )
    return event


def _checked_terminal(event: TerminalEvent) -> tuple[EventType, dict[str, Any]]:
    """The event's type and payload as stored (pure), or the typed error `record_terminals` raises."""
    return _checked_type(event), _stored_payload(event.payload)


def _checked_type(event: TerminalEvent) -> EventType:
    try:
        event_type = EventType(event.type)
    except ValueError as e:
        raise InvalidInput(f"{event.type!r} is not an event type") from e
    if event_type not in TERMINAL_EVENT_TYPES:
        raise InvalidInput(f"{event_type} is not a terminal event type")
    return event_type


def _stored_payload(payload: Any) -> dict[str, Any]:
    """A terminal payload as stored: a JSON object whose every member is held to `canonical_json`
    by itself, so an output passes here exactly when it passes `workers.job_status.parse_result`."""
    if not isinstance(payload, Mapping):
        raise InputNotSerialisable(f"payload must be a JSON object, got {show_value(payload)}")
    stored: dict[str, Any] = {}
    for key, value in payload.items():
        if not isinstance(key, str):
            raise InputNotSerialisable(f"payload has a non-string key {key!r}")
        canonical_json(key, what=f"payload key {key!r}")
        stored[key] = json.loads(canonical_json(value, what=f"payload {key!r}"))
    reason = stored.get("reason")
    if reason is not None and not isinstance(reason, str):
        raise InvalidInput(f"payload reason must be a string, got {show_value(reason)}")
    return stored


def _insert_terminal(session: Session) -> Any:
    table = CaseEvent.__table__
    return (
        _insert_for(session)(table)
        .on_conflict_do_nothing(index_elements=[table.c.dispatch_id], index_where=sa.text(TERMINAL_EVENT_PREDICATE))
        .returning(table.c.dispatch_id)
    )


def _end_dispatch_statement() -> sa.Update:
    table = Dispatch.__table__
    now = sa.bindparam("t_now", type_=table.c.finished_at.type)
    return (
        sa.update(table)
        .where(table.c.dispatch_id == sa.bindparam("t_id", type_=table.c.dispatch_id.type))
        .values(
            state=sa.bindparam("t_state", type_=table.c.state.type),
            reason=sa.bindparam("t_reason", type_=table.c.reason.type),
            output=sa.bindparam("t_output", type_=table.c.output.type),
            finished_at=now,
            updated_at=now,
        )
    )


_END_DISPATCH = _end_dispatch_statement()


def _insert_for(session: Session) -> Any:
    """The dialect's INSERT construct, which knows ON CONFLICT."""
    name = session.get_bind().dialect.name
    if name == "postgresql":
        return postgresql.insert
    if name == "sqlite":
        return sqlite.insert
    raise ConfigError(f"unsupported database {name!r}: use PostgreSQL or SQLite")


# --- reads -----------------------------------------------------------------------------


def get_dispatch(session: Session, dispatch_id: str) -> Dispatch | None:
    return session.get(Dispatch, dispatch_id)


def dispatch_id_for_key(session: Session, *, tenancy_id: str, idempotency_key: str) -> str | None:
    """The id of the dispatch scheduled with (tenancy, idempotency key), or None."""
    row = _dispatches_by_key(session, {(tenancy_id, idempotency_key)}).get((tenancy_id, idempotency_key))
    return None if row is None else str(row.dispatch_id)


def get_dispatches(session: Session, ids: Iterable[str]) -> dict[str, Dispatch]:
    """The dispatches among `ids` that exist, by id, read with a few IN (...) queries."""
    return {row.dispatch_id: row for row in _by_ids(session, ids, session.scalars, _DISPATCHES)}


def dispatch_rows(session: Session, ids: Iterable[str]) -> dict[str, sa.Row[Any]]:
    """As `get_dispatches`, but plain read-only rows (the columns by name), not ORM objects:
    several times cheaper to build for a sweep's pages of hundreds."""
    return {row.dispatch_id: row for row in _by_ids(session, ids, session.execute, _DISPATCH_ROWS)}


def lock_dispatch_rows(session: Session, ids: Iterable[str]) -> dict[str, sa.Row[Any]]:
    """As `dispatch_rows`, each row locked until the transaction ends (PostgreSQL's `FOR NO KEY
    UPDATE`, in id order as every writer takes rows; SQLite's transactions hold its one write
    lock from `BEGIN IMMEDIATE`): nothing can end these dispatches, or count their attempts,
    until the caller commits. What makes a Job's create exactly once (`delivery.delivery`)."""
    return {row.dispatch_id: row for row in _by_ids(session, ids, session.execute, _LOCKED_DISPATCH_ROWS)}


def _by_ids(session: Session, ids: Iterable[str], run: Any, query: sa.Select[*tuple[Any, ...]]) -> Iterator[Any]:
    """`query`'s rows among `ids`, QUERY_BATCH ids per IN (...); `query` is one of `_among_ids`'s,
    built once per process, so SQLAlchemy reuses its cache key and compiled form."""
    wanted = sorted(set(ids))
    for start in range(0, len(wanted), QUERY_BATCH):
        yield from run(query, {"ids": wanted[start : start + QUERY_BATCH]})


def _rowcount(result: sa.Result[*tuple[Any, ...]]) -> int:
    """The rows a DML statement matched: its Result is a CursorResult, but `Session.execute` is
    typed to return only the Result that derives from."""
    return cast("sa.CursorResult[*tuple[Any, ...]]", result).rowcount


_Columns = TypeVarTuple("_Columns")


def _among_ids(query: sa.Select[*_Columns]) -> sa.Select[*_Columns]:
    return query.where(Dispatch.dispatch_id.in_(sa.bindparam("ids", expanding=True)))


_IDS_IN_USE = _among_ids(sa.select(Dispatch.dispatch_id))
_CREATED_AMONG = _among_ids(sa.select(Dispatch.dispatch_id).where(Dispatch.state == DispatchState.CREATED))
_DISPATCHES = _among_ids(sa.select(Dispatch))
_DISPATCH_ROWS = _among_ids(sa.select(Dispatch.__table__))
_LOCKED_DISPATCH_ROWS = (
    _among_ids(sa.select(Dispatch.__table__)).order_by(Dispatch.dispatch_id).with_for_update(key_share=True)
)
_CASE_OF = _among_ids(sa.select(Dispatch.dispatch_id, Dispatch.case_id))
_NAMESPACE_OF = _among_ids(sa.select(Dispatch.dispatch_id, Dispatch.job_namespace))


def iter_dispatches(
    session: Session,
    *,
    states: Collection[DispatchState | str],
    older_than: datetime | None = None,
    batch: int = QUERY_BATCH,
) -> Iterator[Dispatch]:
    """Dispatches in `states` (last updated before `older_than`, if given), by dispatch_id.

    Read a page of `batch` rows at a time, keyset-paginated on dispatch_id, so memory stays
    bounded however many rows match (the session holds rows weakly once the caller drops them).
    """
    if batch < 1:
        raise ValueError(f"batch must be positive, got {batch}")
    wanted = sorted({DispatchState(s) for s in states})
    if not wanted:
        return
    query = sa.select(Dispatch).where(Dispatch.state.in_(wanted))
    if older_than is not None:
        query = query.where(Dispatch.updated_at < older_than)
    yield from _keyset_pages(session, query, batch=batch)


def terminal_event(session: Session, dispatch_id: str) -> CaseEvent | None:
    return session.scalars(
        sa.select(CaseEvent).where(
            CaseEvent.dispatch_id == dispatch_id,
            CaseEvent.type.in_([t.value for t in TERMINAL_EVENT_TYPES]),
        )
    ).one_or_none()


def events_for(session: Session, dispatch_id: str) -> list[CaseEvent]:
    """The dispatch's events in the order they were written."""
    return list(
        session.scalars(sa.select(CaseEvent).where(CaseEvent.dispatch_id == dispatch_id).order_by(CaseEvent.id))
    )


def counts_by_state(session: Session) -> dict[str, int]:
    """How many dispatches are in each state; every state is present, zero if none."""
    counts = {state.value: 0 for state in DispatchState}
    for state, count in session.execute(sa.select(Dispatch.state, sa.func.count()).group_by(Dispatch.state)):
        counts[DispatchState(state).value] = count
    return counts


# --- telling the engine (at least once) ------------------------------------------------


def mark_notified(session: Session, dispatch_id: str, *, now: datetime | None = None) -> bool:
    """Record that the engine was told of the dispatch's end; True if this call recorded it
    (`mark_notified_many` for one)."""
    return bool(mark_notified_many(session, [dispatch_id], now=now))


def mark_notified_many(session: Session, dispatch_ids: Iterable[str], *, now: datetime | None = None) -> set[str]:
    """Record that the engine was told of these dispatches' ends; the ids this call recorded.

    A dispatch notified before, or not terminal, is left unchanged (and not returned).
    """
    now = now or database_now(session)
    marked: set[str] = set()
    wanted = sorted(set(dispatch_ids))
    for start in range(0, len(wanted), QUERY_BATCH):
        marked.update(
            session.scalars(
                sa.update(Dispatch)
                .where(
                    Dispatch.dispatch_id.in_(wanted[start : start + QUERY_BATCH]),
                    Dispatch.notified_at.is_(None),
                    Dispatch.state.in_(sorted(TERMINAL_STATES)),
                )
                .values(notified_at=now)
                .returning(Dispatch.dispatch_id)
                .execution_options(synchronize_session="fetch")
            )
        )
    return marked


def iter_unnotified_terminal(
    session: Session,
    *,
    finished_before: datetime | None = None,
    batch: int = QUERY_BATCH,
) -> Iterator[Dispatch]:
    """Terminal dispatches the engine was not told about (ended before `finished_before`, if
    given), by dispatch_id, a keyset page of `batch` rows at a time.
    """
    if batch < 1:
        raise ValueError(f"batch must be positive, got {batch}")
    query = sa.select(Dispatch).where(Dispatch.notified_at.is_(None), Dispatch.state.in_(sorted(TERMINAL_STATES)))
    if finished_before is not None:
        query = query.where(Dispatch.finished_at < finished_before)
    yield from _keyset_pages(session, query, batch=batch)


def _keyset_pages(session: Session, query: sa.Select[Dispatch], *, batch: int) -> Iterator[Dispatch]:
    """The rows of `query` by dispatch_id, `batch` at a time (see `dispatch_page`)."""
    after: str | None = None
    while True:
        rows = dispatch_page(session, query, after=after, batch=batch)
        yield from rows
        if len(rows) < batch:
            return
        after = rows[-1].dispatch_id


def dispatch_page(session: Session, query: sa.Select[Dispatch], *, after: str | None, batch: int) -> list[Dispatch]:
    """One keyset page of `query`: up to `batch` rows with dispatch_id > `after`, in order.

    Keyset, not OFFSET: memory is bounded by the page, and rows written meanwhile cannot
    shift the pages; a caller may read each page in its own transaction.
    """
    query = query.order_by(Dispatch.dispatch_id).limit(batch)
    if after is not None:
        query = query.where(Dispatch.dispatch_id > after)
    return list(session.scalars(query).all())


# --- the Jobs of ended dispatches, and hand-edited Jobs -----------------------------------

# As store.models.STOPPING_STATES: an end recorded before its Job stopped (a cancel, a failure).
_STOPPING = sorted({DispatchState.FAILED, DispatchState.CANCELLED})
_OPEN = sorted({DispatchState.SCHEDULED, DispatchState.CREATED})  # a Job of its own may exist


def mark_jobs_stopped(session: Session, dispatch_ids: Iterable[str], *, now: datetime | None = None) -> set[str]:
    """Record that these ended dispatches' Jobs run no more (seen finished or gone): their
    fair-share slots are free from the commit on; the ids this call marked. A dispatch marked
    before, or not ended FAILED or CANCELLED, is left unchanged (and not returned)."""
    now = now or database_now(session)
    marked: set[str] = set()
    wanted = sorted(set(dispatch_ids))
    for start in range(0, len(wanted), QUERY_BATCH):
        marked.update(
            session.scalars(
                sa.update(Dispatch)
                .where(
                    Dispatch.dispatch_id.in_(wanted[start : start + QUERY_BATCH]),
                    Dispatch.job_stopped_at.is_(None),
                    Dispatch.state.in_(_STOPPING),
                )
                .values(job_stopped_at=now)
                .returning(Dispatch.dispatch_id)
                .execution_options(synchronize_session="fetch")
            )
        )
    return marked


def note_job_tampered(session: Session, dispatch_id: str, *, now: datetime | None = None) -> datetime | None:
    """Record, once, when the dispatch's Job was first found hand-edited (the row still open,
    SCHEDULED or CREATED); the time recorded (this call's or an earlier one's), None if the
    dispatch is not open."""
    now = now or database_now(session)
    table = Dispatch.__table__
    session.execute(
        sa.update(table)
        .where(
            table.c.dispatch_id == dispatch_id,
            table.c.state.in_(_OPEN),
            table.c.job_tampered_at.is_(None),
        )
        .values(job_tampered_at=now)
    )
    return session.scalar(
        sa.select(table.c.job_tampered_at).where(table.c.dispatch_id == dispatch_id, table.c.state.in_(_OPEN))
    )


def clear_job_tampered(session: Session, dispatch_id: str) -> bool:
    """Forget that the dispatch's Job was found hand-edited (it agrees with the row again);
    True if there was something to forget."""
    table = Dispatch.__table__
    result = session.execute(
        sa.update(table)
        .where(table.c.dispatch_id == dispatch_id, table.c.job_tampered_at.is_not(None))
        .values(job_tampered_at=None)
    )
    return bool(_rowcount(result))
