"""What an engine imports: schedule and cancel in its own transaction, the request and result
types, the errors, and what a notification means.

The notification: after a dispatch's terminal event is committed, a worker sends the Celery task
`K8S_DISPATCH_NOTIFY_TASK` (default `engine.dispatch_finished`) on `K8S_DISPATCH_NOTIFY_QUEUE`
(default `engine`) with one argument, the dispatch id. It is sent at least once (a redelivery or
the sweep may send it again); the terminal event it points at is written exactly once, so read
it with `outcome(session, dispatch_id)` and treat a second notification as a repeat.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from k8s_dispatch import artifacts, celeryconfig
from k8s_dispatch.artifacts.errors import (
    NoStoredResult,
    ObjectStoreUnavailable,
    ResultObjectMismatch,
    ResultObjectMissing,
    ResultTooLarge,
)
from k8s_dispatch.artifacts.reference import ResultReference, is_reference, parse_reference
from k8s_dispatch.core.errors import (
    ConfigError,
    DispatchError,
    IdempotencyConflict,
    InputNotSerialisable,
    InputTooLarge,
    InvalidId,
    InvalidIdempotencyKey,
    InvalidInput,
    Permanent,
    ScheduleNotRecorded,
    SecretInputKeyMissing,
    SecretInputUnreadable,
    TenancyMismatch,
    Transient,
    UnknownCapability,
    UnknownCase,
    UnknownDispatch,
)
from k8s_dispatch.core.ids import check_dispatch_id
from k8s_dispatch.core.settings import Settings, get_settings
from k8s_dispatch.store import dispatches, maps
from k8s_dispatch.store.db import make_engine, make_sessionmaker, transaction
from k8s_dispatch.store.migrate import upgrade as migrate_database
from k8s_dispatch.store.models import DispatchState, EventType, ItemEventType
from k8s_dispatch.store.scheduling import ScheduleRequest, ScheduleResult, create_case
from k8s_dispatch.tasks.maps import schedule_map_in_session
from k8s_dispatch.tasks.scheduling import (
    cancel_in_session,
    schedule_in_session,
    schedule_many_in_session,
    send_schedule_until_recorded,
)
from k8s_dispatch.workers.resolver import CapabilityResolver

__all__ = [
    "CapabilityResolver",
    "ConfigError",
    "DispatchError",
    "DispatchState",
    "EventType",
    "IdempotencyConflict",
    "InputNotSerialisable",
    "InputTooLarge",
    "InvalidId",
    "InvalidIdempotencyKey",
    "InvalidInput",
    "ItemEventType",
    "ItemOutcome",
    "MapProgress",
    "NoStoredResult",
    "ObjectStoreUnavailable",
    "Outcome",
    "Permanent",
    "ResultObjectMismatch",
    "ResultObjectMissing",
    "ResultReference",
    "ResultTooLarge",
    "ScheduleNotRecorded",
    "ScheduleRequest",
    "ScheduleResult",
    "SecretInputKeyMissing",
    "SecretInputUnreadable",
    "Settings",
    "TenancyMismatch",
    "Transient",
    "UnknownCapability",
    "UnknownCase",
    "UnknownDispatch",
    "cancel_in_session",
    "create_case",
    "delete_result",
    "get_settings",
    "item_outcomes",
    "make_engine",
    "make_sessionmaker",
    "map_progress",
    "migrate_database",
    "notification_config",
    "outcome",
    "read_result",
    "result_url",
    "schedule_in_session",
    "schedule_many_in_session",
    "schedule_map_in_session",
    "send_schedule_until_recorded",
    "stored_result",
    "transaction",
]


@dataclass(frozen=True)
class Outcome:
    """A dispatch's end, as its one terminal event recorded it."""

    dispatch_id: str
    event: EventType  # WORKER_COMPLETED, WORKER_FAILED or WORKER_CANCELLED
    payload: dict[str, Any]  # {"output": ...} on completion, {"reason": ..., ...} otherwise


def outcome(session: Session, dispatch_id: str) -> Outcome | None:
    """The terminal event of `dispatch_id`, or None while it runs.

    Raises:
        InvalidId: `dispatch_id` is not a UUID.
    """
    check_dispatch_id(dispatch_id)
    event = dispatches.terminal_event(session, dispatch_id)
    if event is None:
        return None
    return Outcome(dispatch_id=dispatch_id, event=EventType(event.type), payload=dict(event.payload or {}))


@dataclass(frozen=True)
class ItemOutcome:
    """One item's end in a map dispatch, as its one item event recorded it."""

    index: int
    event: ItemEventType  # WORKER_ITEM_COMPLETED, WORKER_ITEM_FAILED or WORKER_ITEM_CANCELLED
    payload: dict[str, Any]  # {"item": index, "output": ...}, or {"item": index, "reason": ..., ...}


def item_outcomes(session: Session, dispatch_id: str) -> list[ItemOutcome]:
    """The ended items of a map dispatch (`schedule_map_in_session`), in the order they ended:
    the engine reads progress here while the map runs; each item appears once.

    Raises:
        InvalidId: `dispatch_id` is not a UUID.
    """
    check_dispatch_id(dispatch_id)
    return [
        ItemOutcome(index=int(e.payload["item"]), event=ItemEventType(e.type), payload=dict(e.payload))
        for e in maps.item_events(session, dispatch_id)
    ]


MapProgress = maps.Progress


def map_progress(session: Session, dispatch_id: str) -> MapProgress | None:
    """A map dispatch's progress: its items, and how many succeeded, failed, were cancelled, or
    are still open; None if `dispatch_id` is not a map.

    Raises:
        InvalidId: `dispatch_id` is not a UUID.
    """
    check_dispatch_id(dispatch_id)
    return maps.progress(session, dispatch_id)


def notification_config(settings: Settings) -> dict[str, Any]:
    """Celery settings for the engine's own app to receive the notifications: our broker, under
    our key prefix, with late acks (a notification a crashed engine worker took is sent to the
    next one), JSON only."""
    ours = celeryconfig.config(settings)
    keys = (
        "broker_url",
        "broker_transport_options",
        "task_acks_late",
        "task_reject_on_worker_lost",
        "task_serializer",
        "accept_content",
        "worker_prefetch_multiplier",
    )
    return {key: ours[key] for key in keys if key in ours}


# --- results in the object store (capabilities with `results: objectStore`) ------------------


def stored_result(session: Session, dispatch_id: str) -> ResultReference | None:
    """The verified reference the dispatch's WORKER_COMPLETED recorded (key, size, SHA-256);
    None while it runs, if it failed or was cancelled, or if its result is a small one.

    Raises:
        InvalidId: `dispatch_id` is not a UUID.
    """
    ended = outcome(session, dispatch_id)
    if ended is None or ended.event is not EventType.WORKER_COMPLETED:
        return None
    output = ended.payload.get("output")
    return parse_reference(output) if is_reference(output) else None


def read_result(session: Session, dispatch_id: str, *, settings: Settings | None = None) -> Iterator[bytes]:
    """The dispatch's stored result, streamed in chunks (the bytes delivery verified).

    Raises:
        NoStoredResult: the dispatch has none (see `stored_result`).
        ResultObjectMissing: it was deleted (`delete_result`, retention).
        ObjectStoreUnavailable, ConfigError: no object store is configured.
    """
    store, reference = _stored(session, dispatch_id, settings)
    return store.read(reference)


def result_url(
    session: Session, dispatch_id: str, *, settings: Settings | None = None, expires_s: int | None = None
) -> str:
    """A URL that reads the stored result without credentials, for `expires_s` seconds
    (default `K8S_DISPATCH_OBJECT_STORE_READ_URL_S`). Signed locally: it does not check that the
    object is still there.

    Raises: NoStoredResult, ConfigError.
    """
    store, reference = _stored(session, dispatch_id, settings)
    return store.read_url(reference, expires_s)


def delete_result(session: Session, dispatch_id: str, *, settings: Settings | None = None) -> ResultReference:
    """Delete the stored result (idempotent); the terminal event keeps its reference, and a
    later read raises ResultObjectMissing.

    Raises: NoStoredResult, ObjectStoreUnavailable, ConfigError.
    """
    store, reference = _stored(session, dispatch_id, settings)
    store.delete(reference)
    return reference


def _stored(
    session: Session, dispatch_id: str, settings: Settings | None
) -> tuple[artifacts.Artifacts, ResultReference]:
    reference = stored_result(session, dispatch_id)
    if reference is None:
        raise NoStoredResult(f"dispatch {dispatch_id} has no result in the object store")
    store = artifacts.for_settings(settings or get_settings())
    if store is None:
        raise ConfigError("no object store is configured (K8S_DISPATCH_OBJECT_STORE_ENDPOINT)")
    return store, reference
