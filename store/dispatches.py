"""The store's transactions over dispatches once scheduled (`store.schedule`): record their Jobs,
their one terminal event, what the engine was told, and read them back.

Every function runs in the caller's transaction: the session is passed in and the caller
commits (usually through `store.db.transaction`). Requests are validated before anything is
written, so a typed error leaves the database as it was. Races are settled by the database's
unique indexes, never by reading first: the partial unique index on terminal events for
`record_terminals`.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVarTuple, cast

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session
from sqlalchemy.orm.util import identity_key

from k8s_dispatch.core.errors import (
    ConfigError,
    InputNotSerialisable,
    InvalidInput,
    UnknownDispatch,
)
from k8s_dispatch.core.ids import show_value
from k8s_dispatch.core.payloads import canonical_json
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
    marked = set(by_ids(session, by_id, session.scalars, _CREATED_AMONG))
    unmarked = by_id.keys() - marked
    if unmarked:
        missing = unmarked - set(ids_in_use(session, sorted(unmarked)))
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
    return {row.dispatch_id: row.job_namespace for row in by_ids(session, wanted, session.execute, _NAMESPACE_OF)}


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
    case_of = {row.dispatch_id: row.case_id for row in by_ids(session, checked, session.execute, _CASE_OF)}
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
        insert_for(session)(table)
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


def insert_for(session: Session) -> Any:
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
    row = dispatches_by_key(session, {(tenancy_id, idempotency_key)}).get((tenancy_id, idempotency_key))
    return None if row is None else str(row.dispatch_id)


def get_dispatches(session: Session, ids: Iterable[str]) -> dict[str, Dispatch]:
    """The dispatches among `ids` that exist, by id, read with a few IN (...) queries."""
    return {row.dispatch_id: row for row in by_ids(session, ids, session.scalars, _DISPATCHES)}


def dispatch_rows(session: Session, ids: Iterable[str]) -> dict[str, sa.Row[Any]]:
    """As `get_dispatches`, but plain read-only rows (the columns by name), not ORM objects:
    several times cheaper to build for a sweep's pages of hundreds."""
    return {row.dispatch_id: row for row in by_ids(session, ids, session.execute, _DISPATCH_ROWS)}


def lock_dispatch_rows(session: Session, ids: Iterable[str]) -> dict[str, sa.Row[Any]]:
    """As `dispatch_rows`, each row locked until the transaction ends (PostgreSQL's `FOR NO KEY
    UPDATE`, in id order as every writer takes rows; SQLite's transactions hold its one write
    lock from `BEGIN IMMEDIATE`): nothing can end these dispatches, or count their attempts,
    until the caller commits. What makes a Job's create exactly once (`delivery.create`)."""
    return {row.dispatch_id: row for row in by_ids(session, ids, session.execute, _LOCKED_DISPATCH_ROWS)}


def by_ids(session: Session, ids: Iterable[str], run: Any, query: sa.Select[*tuple[Any, ...]]) -> Iterator[Any]:
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


def dispatches_by_key(session: Session, keys: Collection[tuple[str, str]]) -> dict[tuple[str, str], Any]:
    """The dispatches holding `keys` ((tenancy_id, idempotency_key)), as plain rows, by key."""
    found: dict[tuple[str, str], Any] = {}
    wanted = sorted(keys)
    table = Dispatch.__table__
    for start in range(0, len(wanted), QUERY_BATCH):
        chunk = wanted[start : start + QUERY_BATCH]
        query = sa.select(table).where(sa.tuple_(table.c.tenancy_id, table.c.idempotency_key).in_(chunk))
        found.update({(row.tenancy_id, row.idempotency_key): row for row in session.execute(query)})
    return found


def ids_in_use(session: Session, ids: list[str]) -> Iterator[str]:
    return by_ids(session, ids, session.scalars, _IDS_IN_USE)
