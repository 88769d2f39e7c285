"""The store's transactions: schedule a dispatch, record its Job, record its one terminal event.

Every function runs in the caller's transaction: the session is passed in and the caller
commits (usually through `engine.db.transaction`). Requests are validated before anything is
written, so a typed error leaves the database as it was. Races are settled by the database's
unique indexes, never by reading first: the (tenancy, idempotency key) constraint for
`schedule`, the partial unique index on terminal events for `record_terminal`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from engine.errors import (
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
from engine.ids import check_dispatch_id, check_id, check_idempotency_key, show_value
from engine.models import (
    STATE_FOR_TERMINAL_EVENT,
    TERMINAL_EVENT_PREDICATE,
    TERMINAL_EVENT_TYPES,
    TERMINAL_STATES,
    CaseEvent,
    CaseInstance,
    Dispatch,
    DispatchState,
    EventType,
    utcnow,
)
from engine.payloads import canonical_json, encode_input

QUERY_BATCH = 500  # ids per IN (...) and rows per page: bounded memory, few round trips


class CapabilityRouter(Protocol):
    """Names the worker that serves a capability (implemented by the workers' resolver)."""

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
        InvalidId, InputNotSerialisable
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


def schedule(
    session: Session,
    *,
    case_id: str,
    tenancy_id: str,
    capability: str,
    input: Any,  # noqa: A002 - the engine's word
    idempotency_key: str,
    router: CapabilityRouter,
    max_input_bytes: int,
    dispatch_id: str | None = None,
    now: datetime | None = None,
) -> ScheduleResult:
    """Write a dispatch (SCHEDULED) and its WORKER_SCHEDULED event in the caller's transaction.

    Idempotent on (tenancy_id, idempotency_key): a repeat of the same request returns the
    existing dispatch with `created=False` and writes nothing, also when the first request
    commits concurrently (its insert is tried in a SAVEPOINT and the winner re-read; this
    relies on READ COMMITTED, PostgreSQL's default). The event's payload holds capability,
    worker_name, idempotency_key and input.

    Raises (all before anything is written):
        InvalidId: case_id or tenancy_id invalid; dispatch_id not a UUID or already in use.
        InvalidIdempotencyKey, InputNotSerialisable, InputTooLarge
        UnknownCapability: from `router`.
        UnknownCase, TenancyMismatch: the case is missing or belongs to another tenancy.
        IdempotencyConflict: the key was used for a different case, capability or input.
    """
    check_id("case_id", case_id)
    check_id("tenancy_id", tenancy_id)
    dispatch_id = str(uuid.uuid4()) if dispatch_id is None else check_dispatch_id(dispatch_id)
    check_idempotency_key(idempotency_key)
    encoded = encode_input(input, max_bytes=max_input_bytes)
    if not isinstance(capability, str) or not capability:
        raise UnknownCapability(f"capability must be a non-empty string, got {show_value(capability)}")
    worker_name = router.worker_for(capability)

    existing = _dispatch_by_key(session, tenancy_id, idempotency_key)
    if existing is not None:
        return _repeat(existing, case_id=case_id, capability=capability, encoded_input=encoded)
    case = session.get(CaseInstance, case_id)
    if case is None:
        raise UnknownCase(f"case {case_id!r} does not exist")
    if case.tenancy_id != tenancy_id:
        raise TenancyMismatch(f"case {case_id!r} does not belong to tenancy {tenancy_id!r}")
    if session.get(Dispatch, dispatch_id) is not None:
        raise InvalidId(f"dispatch_id {dispatch_id} is already used by another request")

    now = now or utcnow()
    stored_input = json.loads(encoded)  # plain JSON types: tuples become lists, as on reading
    try:
        with session.begin_nested():
            session.add(
                Dispatch(
                    dispatch_id=dispatch_id,
                    case_id=case_id,
                    tenancy_id=tenancy_id,
                    capability=capability,
                    worker_name=worker_name,
                    idempotency_key=idempotency_key,
                    input=stored_input,
                    state=DispatchState.SCHEDULED,
                    attempts=0,
                    created_at=now,
                    updated_at=now,
                )
            )
            session.add(
                CaseEvent(
                    case_id=case_id,
                    dispatch_id=dispatch_id,
                    type=EventType.WORKER_SCHEDULED.value,
                    payload={
                        "capability": capability,
                        "worker_name": worker_name,
                        "idempotency_key": idempotency_key,
                        "input": stored_input,
                    },
                    created_at=now,
                )
            )
    except IntegrityError as e:
        # Another transaction committed the same request between our read and our insert.
        existing = _dispatch_by_key(session, tenancy_id, idempotency_key)
        if existing is not None:
            return _repeat(existing, case_id=case_id, capability=capability, encoded_input=encoded)
        if session.get(Dispatch, dispatch_id) is not None:
            raise InvalidId(f"dispatch_id {dispatch_id} is already used by another request") from e
        raise
    return ScheduleResult(dispatch_id=dispatch_id, created=True, state=DispatchState.SCHEDULED)


def _dispatch_by_key(session: Session, tenancy_id: str, idempotency_key: str) -> Dispatch | None:
    return session.scalars(
        sa.select(Dispatch).where(Dispatch.tenancy_id == tenancy_id, Dispatch.idempotency_key == idempotency_key)
    ).one_or_none()


def _repeat(existing: Dispatch, *, case_id: str, capability: str, encoded_input: str) -> ScheduleResult:
    """The result of a repeated request, if it is the same request as `existing`'s."""
    differences = [
        name
        for name, same in (
            ("case_id", existing.case_id == case_id),
            ("capability", existing.capability == capability),
            ("input", canonical_json(existing.input) == encoded_input),
        )
        if not same
    ]
    if differences:
        raise IdempotencyConflict(
            f"idempotency key {existing.idempotency_key!r} was used for dispatch {existing.dispatch_id} "
            f"with a different {', '.join(differences)}"
        )
    return ScheduleResult(dispatch_id=existing.dispatch_id, created=False, state=existing.state)


# --- the Job's progress ----------------------------------------------------------------


def mark_created(
    session: Session,
    dispatch_id: str,
    *,
    job_name: str,
    namespace: str,
    attempt: int,
    now: datetime | None = None,
) -> bool:
    """Record that the dispatch's Job exists: state CREATED, where it is, when it was created.

    `attempts` becomes at least `attempt`. Repeating it (a retried create that adopted its
    Job) is harmless. Returns False, changing nothing, if the dispatch is already terminal.

    Raises:
        UnknownDispatch
    """
    now = now or utcnow()
    updated = session.execute(
        sa.update(Dispatch)
        .where(
            Dispatch.dispatch_id == dispatch_id,
            Dispatch.state.in_([DispatchState.SCHEDULED, DispatchState.CREATED]),
        )
        .values(
            state=DispatchState.CREATED,
            job_name=job_name,
            job_namespace=namespace,
            job_created_at=now,
            attempts=sa.case((Dispatch.attempts < attempt, attempt), else_=Dispatch.attempts),
            updated_at=now,
        )
        .returning(Dispatch.dispatch_id)
        .execution_options(synchronize_session="fetch")
    ).scalar_one_or_none()
    if updated is not None:
        return True
    if session.get(Dispatch, dispatch_id) is None:
        raise UnknownDispatch(f"dispatch {dispatch_id!r} does not exist")
    return False


def record_attempt(session: Session, dispatch_id: str, *, now: datetime | None = None) -> int:
    """Count one more attempt at creating the dispatch's Job; returns the new count.

    Raises:
        UnknownDispatch
    """
    attempts = session.execute(
        sa.update(Dispatch)
        .where(Dispatch.dispatch_id == dispatch_id)
        .values(attempts=Dispatch.attempts + 1, updated_at=now or utcnow())
        .returning(Dispatch.attempts)
        .execution_options(synchronize_session="fetch")
    ).scalar_one_or_none()
    if attempts is None:
        raise UnknownDispatch(f"dispatch {dispatch_id!r} does not exist")
    return attempts


# --- the end ---------------------------------------------------------------------------


def record_terminal(
    session: Session,
    dispatch_id: str,
    type: EventType,  # noqa: A002 - the event's word
    payload: Mapping[str, Any],
    *,
    now: datetime | None = None,
) -> bool:
    """Write the dispatch's terminal event, if it has none yet; True if this call wrote it.

    The insert is `INSERT ... ON CONFLICT DO NOTHING` on the partial unique index of terminal
    events, so of any number of concurrent callers exactly one wins, whatever the isolation.
    The winner also sets the dispatch's state, reason (`payload["reason"]`), output
    (`payload["output"]`) and finished_at, and touches the case; a loser writes nothing.

    Raises:
        UnknownDispatch
        InvalidInput: `type` is not a terminal event type, or the reason is not a string.
        InputNotSerialisable: the payload is not a JSON object.
    """
    try:
        event_type = EventType(type)
    except ValueError as e:
        raise InvalidInput(f"{type!r} is not an event type") from e
    if event_type not in TERMINAL_EVENT_TYPES:
        raise InvalidInput(f"{event_type} is not a terminal event type")
    if not isinstance(payload, Mapping):
        raise InputNotSerialisable(f"payload must be a JSON object, got {show_value(payload)}")
    stored_payload = json.loads(canonical_json(dict(payload), what="payload"))
    reason = stored_payload.get("reason")
    if reason is not None and not isinstance(reason, str):
        raise InvalidInput(f"payload reason must be a string, got {show_value(reason)}")
    dispatch = session.get(Dispatch, dispatch_id)
    if dispatch is None:
        raise UnknownDispatch(f"dispatch {dispatch_id!r} does not exist")

    now = now or utcnow()
    insert = _insert_for(session)(CaseEvent.__table__).values(
        case_id=dispatch.case_id,
        dispatch_id=dispatch_id,
        type=event_type.value,
        payload=stored_payload,
        created_at=now,
    )
    event_id = session.execute(
        insert.on_conflict_do_nothing(
            index_elements=[CaseEvent.__table__.c.dispatch_id],
            index_where=sa.text(TERMINAL_EVENT_PREDICATE),
        ).returning(CaseEvent.__table__.c.id)
    ).scalar_one_or_none()
    if event_id is None:  # the conflict: another call recorded this dispatch's end first
        return False
    session.execute(
        sa.update(Dispatch)
        .where(Dispatch.dispatch_id == dispatch_id)
        .values(
            state=STATE_FOR_TERMINAL_EVENT[event_type],
            reason=reason,
            output=stored_payload.get("output"),
            finished_at=now,
            updated_at=now,
        )
        .execution_options(synchronize_session="fetch")
    )
    session.execute(
        sa.update(CaseInstance)
        .where(CaseInstance.id == dispatch.case_id)
        .values(updated_at=now)
        .execution_options(synchronize_session="fetch")
    )
    return True


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


def get_dispatches(session: Session, ids: Iterable[str]) -> dict[str, Dispatch]:
    """The dispatches among `ids` that exist, by id, read with a few IN (...) queries."""
    wanted = sorted(set(ids))
    found: dict[str, Dispatch] = {}
    for start in range(0, len(wanted), QUERY_BATCH):
        chunk = wanted[start : start + QUERY_BATCH]
        for dispatch in session.scalars(sa.select(Dispatch).where(Dispatch.dispatch_id.in_(chunk))):
            found[dispatch.dispatch_id] = dispatch
    return found


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
    return list(session.scalars(sa.select(CaseEvent).where(CaseEvent.dispatch_id == dispatch_id).order_by(CaseEvent.id)))


def counts_by_state(session: Session) -> dict[str, int]:
    """How many dispatches are in each state; every state is present, zero if none."""
    counts = {state.value: 0 for state in DispatchState}
    for state, count in session.execute(sa.select(Dispatch.state, sa.func.count()).group_by(Dispatch.state)):
        counts[DispatchState(state).value] = count
    return counts


# --- telling the engine (at least once) ------------------------------------------------


def mark_notified(session: Session, dispatch_id: str, *, now: datetime | None = None) -> bool:
    """Record that the engine was told of the dispatch's end; True if this call recorded it.

    False (changing nothing) if it was recorded before, or the dispatch is not terminal.
    """
    now = now or utcnow()
    updated = session.execute(
        sa.update(Dispatch)
        .where(
            Dispatch.dispatch_id == dispatch_id,
            Dispatch.notified_at.is_(None),
            Dispatch.state.in_(sorted(TERMINAL_STATES)),
        )
        .values(notified_at=now)
        .returning(Dispatch.dispatch_id)
        .execution_options(synchronize_session="fetch")
    ).scalar_one_or_none()
    return updated is not None


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


def _keyset_pages(session: Session, query: sa.Select, *, batch: int) -> Iterator[Dispatch]:
    """The rows of `query` by dispatch_id, `batch` at a time (see `dispatch_page`)."""
    after: str | None = None
    while True:
        rows = dispatch_page(session, query, after=after, batch=batch)
        yield from rows
        if len(rows) < batch:
            return
        after = rows[-1].dispatch_id


def dispatch_page(session: Session, query: sa.Select, *, after: str | None, batch: int) -> list[Dispatch]:
    """One keyset page of `query`: up to `batch` rows with dispatch_id > `after`, in order.

    Keyset, not OFFSET: memory is bounded by the page, and rows written meanwhile cannot
    shift the pages; a caller may read each page in its own transaction.
    """
    query = query.order_by(Dispatch.dispatch_id).limit(batch)
    if after is not None:
        query = query.where(Dispatch.dispatch_id > after)
    return list(session.scalars(query).all())
