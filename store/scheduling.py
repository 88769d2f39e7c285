"""Schedule dispatches: a dispatch row and its WORKER_SCHEDULED event, written together in the
caller's transaction (the engine's, or a Celery task's). Requests are validated before anything
is written, so a typed error leaves the database as it was; a repeat of a (tenancy, idempotency
key) returns the dispatch it made, settled by the database's unique constraint, never by reading
first.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import sqlalchemy as sa
from pydantic import SecretStr
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Session

from k8s_dispatch.core.errors import (
    ConfigError,
    IdempotencyConflict,
    InvalidId,
    InvalidInput,
    TenancyMismatch,
    UnknownCapability,
    UnknownCase,
)
from k8s_dispatch.core.ids import check_dispatch_id, check_id, check_idempotency_key, show_value
from k8s_dispatch.core.limits import Limits
from k8s_dispatch.core.names import is_dns1123_label
from k8s_dispatch.core.payloads import canonical_json, encode_input
from k8s_dispatch.store.db import database_now
from k8s_dispatch.store.dispatches import MAX_INT32, dispatches_by_key, ids_in_use, insert_for
from k8s_dispatch.store.models import (
    CaseEvent,
    CaseInstance,
    Dispatch,
    DispatchState,
    EventType,
)
from k8s_dispatch.store.secret_inputs import seal, unseal


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
    # Kept only encrypted (store/secret_inputs.py), never in the event log; its Job gets it from
    # a Secret of its own.
    secret: bool = False


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
    secret: bool = False,
    input_key: SecretStr | None = None,
    max_stored_input_bytes: int | None = None,
    now: datetime | None = None,
) -> ScheduleResult:
    """Write a dispatch (SCHEDULED, or QUEUED under a limit) and its WORKER_SCHEDULED event in
    the caller's transaction: `schedule_many` for one request (its rules, errors and idempotency)."""
    request = ScheduleRequest(case_id, tenancy_id, capability, input, idempotency_key, dispatch_id, priority, secret)
    return schedule_many(
        session,
        [request],
        router=router,
        max_input_bytes=max_input_bytes,
        input_key=input_key,
        max_stored_input_bytes=max_stored_input_bytes,
        now=now,
    )[0]


def schedule_many(
    session: Session,
    requests: Sequence[ScheduleRequest],
    *,
    router: CapabilityRouter,
    max_input_bytes: int,
    input_key: SecretStr | None = None,
    max_stored_input_bytes: int | None = None,
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

    Inputs: at most `max_input_bytes` of canonical JSON (what a Job's env carries), or up to
    `max_stored_input_bytes` when the caller has an object store for the larger ones (its
    create step stores them there: `artifacts.inputs`). A request with `secret=True` has its
    input sealed with `input_key` (store/secret_inputs.py) into `dispatches.secret_input`:
    its `input` column and its event hold null (the event says `"secret": true`), and a
    repeat is compared with the opened seal.

    Raises (all before anything of the batch is written; the first bad request's error):
        InvalidId: case_id or tenancy_id invalid; dispatch_id not a UUID or already in use.
        InvalidIdempotencyKey, InputNotSerialisable, InputTooLarge
        SecretInputKeyMissing: a secret input, and no `input_key`.
        InvalidInput: priority is not an integer within 32 bits.
        UnknownCapability: from `router`.
        UnknownCase, TenancyMismatch: the case is missing or belongs to another tenancy.
        IdempotencyConflict: the key was used for a different case, capability or input.
        ConfigError: the router names a namespace that is not a DNS-1123 label.
    """
    namespace_for = getattr(router, "namespace_for", None)
    limits: Limits = getattr(router, "limits", None) or Limits()
    prepared = [
        _prepare(
            request,
            router=router,
            namespace_for=namespace_for,
            limits=limits,
            max_input_bytes=max_input_bytes,
            input_key=input_key,
            max_stored_input_bytes=max_stored_input_bytes,
        )
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
    existing = dispatches_by_key(session, {(p.tenancy_id, p.idempotency_key) for p in prepared})
    new = _new_dispatches(session, prepared, existing, input_key)
    if new:
        existing.update(_insert(session, new, now=now or database_now(session), input_key=input_key))
    written = {(p.tenancy_id, p.idempotency_key): p for p in new}
    results = []
    for p in prepared:
        key = (p.tenancy_id, p.idempotency_key)
        if key in existing:
            results.append(_repeat(existing[key], p, input_key))
        elif p.repeat:
            results.append(_repeat(written[key], p, input_key))
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
    input: Any  # plain JSON types, as stored (None for a secret input)
    secret_input: str | None = None  # a secret input's Fernet token
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
    input_key: SecretStr | None,
    max_stored_input_bytes: int | None,
) -> _Prepared:
    """The checks that need no database, in `schedule`'s documented order."""
    check_id("case_id", request.case_id)
    check_id("tenancy_id", request.tenancy_id)
    chosen_by_caller = request.dispatch_id is not None
    dispatch_id = check_dispatch_id(request.dispatch_id) if chosen_by_caller else str(uuid.uuid4())
    check_idempotency_key(request.idempotency_key)
    if not isinstance(request.secret, bool):
        raise InvalidInput(f"secret must be True or False, got {show_value(request.secret)}")
    secret = request.secret
    # A secret input goes to its Job as a Secret's value, never to the object store: the inline limit.
    limit = (
        max_input_bytes if secret or max_stored_input_bytes is None else max(max_input_bytes, max_stored_input_bytes)
    )
    encoded = encode_input(request.input, max_bytes=limit)
    sealed = seal(encoded, input_key) if secret else None
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
        input=None if secret else json.loads(encoded),  # tuples become lists, as on reading
        secret_input=sealed,
        job_namespace=namespace,
        priority=priority,
        state=DispatchState.QUEUED if limits.limits(request.tenancy_id, capability) else DispatchState.SCHEDULED,
    )


def _new_dispatches(
    session: Session, prepared: list[_Prepared], existing: dict[tuple[str, str], Any], input_key: SecretStr | None
) -> list[_Prepared]:
    """The requests to insert (a key's first request, if the key is not in `existing`), once
    every request was found consistent with the database and with the rest of the batch."""
    new: dict[tuple[str, str], _Prepared] = {}
    for p in prepared:
        key = (p.tenancy_id, p.idempotency_key)
        if key in existing:
            _repeat(existing[key], p, input_key)
        elif key in new:
            _repeat(new[key], p, input_key)
            p.repeat = True
        else:
            new[key] = p
    case_ids = sorted({p.case_id for p in new.values()})
    query = sa.select(CaseInstance.id, CaseInstance.tenancy_id).where(CaseInstance.id.in_(case_ids))
    cases = {case_id: tenancy_id for case_id, tenancy_id in session.execute(query)} if new else {}
    chosen = [p.dispatch_id for p in new.values() if p.chosen_by_caller]
    # A fresh uuid4 cannot be in use: only a caller's ids are looked up.
    in_use = set(ids_in_use(session, chosen)) if chosen else set()
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


def _insert(
    session: Session, new: list[_Prepared], *, now: datetime, input_key: SecretStr | None
) -> dict[tuple[str, str], Any]:
    """Insert `new`'s dispatch rows (skipping any whose key or id got taken meanwhile) and the
    events of those inserted, in one SAVEPOINT; the winners of the keys that got taken.

    Raises (the SAVEPOINT rolled back): IdempotencyConflict, InvalidId, as `schedule_many`.
    """
    # Executemany: SQLAlchemy sends the rows as ONE multi-row INSERT ("insertmanyvalues", up to
    # 1,000 rows a statement) from a statement compiled once and cached, where `.values(rows)`
    # would compile a new statement of rows x columns parameters for every batch.
    table = Dispatch.__table__
    insert = insert_for(session)(table).on_conflict_do_nothing().returning(table.c.dispatch_id)
    # Rows in key order: a concurrent batch with some of the same keys waits on them in the
    # same order (an insert waits for the other's uncommitted row), so the two never deadlock.
    rows = [_dispatch_row(p, now) for p in sorted(new, key=lambda p: (p.tenancy_id, p.idempotency_key))]
    with session.begin_nested():
        inserted = set(session.scalars(insert, rows))
        lost = [p for p in new if p.dispatch_id not in inserted]
        # Another transaction committed the same key (or took a caller's id) since we read.
        winners = dispatches_by_key(session, {(p.tenancy_id, p.idempotency_key) for p in lost}) if lost else {}
        for p in lost:
            winner = winners.get((p.tenancy_id, p.idempotency_key))
            if winner is None:
                raise InvalidId(f"dispatch_id {p.dispatch_id} is already used by another request")
            _repeat(winner, p, input_key)
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
    "priority", "created_at", "updated_at", "secret_input",
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
        secret_input=p.secret_input,
    )


def _event_row(p: _Prepared, now: datetime) -> dict[str, Any]:
    payload = {
        "capability": p.capability,
        "worker_name": p.worker_name,
        "idempotency_key": p.idempotency_key,
        "input": p.input,
    }
    if p.secret_input is not None:  # the input is kept sealed in its dispatch row alone
        payload["secret"] = True
    return dict(
        case_id=p.case_id,
        dispatch_id=p.dispatch_id,
        type=EventType.WORKER_SCHEDULED.value,
        payload=payload,
        created_at=now,
    )


def _repeat(existing: Any, request: _Prepared, input_key: SecretStr | None) -> ScheduleResult:
    """The result of a repeated request, if it is the same request as `existing`'s (a
    dispatch row, or the batch's earlier request with the same key). A secret input is
    compared opened (its seal differs each time); a secret one never equals a plain one."""
    existing_secret = getattr(existing, "secret_input", None)
    if (existing_secret is None) != (request.secret_input is None):
        same_input = False
    elif existing_secret is not None:
        same_input = unseal(existing_secret, input_key) == request.encoded_input
    else:
        same_input = canonical_json(existing.input) == request.encoded_input
    differences = [
        name
        for name, same in (
            ("case_id", existing.case_id == request.case_id),
            ("capability", existing.capability == request.capability),
            ("input", same_input),
        )
        if not same
    ]
    if differences:
        raise IdempotencyConflict(
            f"idempotency key {existing.idempotency_key!r} was used for dispatch {existing.dispatch_id} "
            f"with a different {', '.join(differences)}"
        )
    return ScheduleResult(dispatch_id=existing.dispatch_id, created=False, state=DispatchState(existing.state))
