"""Map dispatches (fan-out, issue 29) from the engine's side: `schedule_map_in_session` in the
caller's transaction, and the `schedule_map` task for engines that send Celery messages.

A map is written as `store.maps` writes it, through the same `schedule_many_in_session` every
dispatch goes through: its Job's creation is sent after the outermost commit (nothing on a
rollback), and a limit queues it like any dispatch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery import Celery
from sqlalchemy.orm import Session

from k8s_dispatch.store import maps, scheduling
from k8s_dispatch.store.db import transaction
from k8s_dispatch.tasks.app import app
from k8s_dispatch.tasks.jobs import RETRY
from k8s_dispatch.tasks.scheduling import schedule_many_in_session
from k8s_dispatch.tasks.worker_runtime import get_runtime

SCHEDULE_MAP_TASK = "k8s-dispatch.schedule_map"


def schedule_map_in_session(
    session: Session,
    *,
    case_id: str,
    tenancy_id: str,
    capability: str,
    items: Sequence[Any],
    idempotency_key: str,
    parallelism: int,
    router: scheduling.CapabilityRouter,
    max_input_bytes: int,
    max_stored_input_bytes: int | None = None,
    max_failed_items: int | None = None,
    min_succeeded: int | None = None,
    dispatch_id: str | None = None,
    priority: int = 0,
    via: Celery | None = None,
    now: Any = None,
) -> scheduling.ScheduleResult:
    """A map dispatch over `items` (each one Pod's input) in the caller's transaction; its
    Indexed Job's creation is sent after commit. `max_failed_items`: the Job stops once more
    items failed; `min_succeeded`: the map passes with at least that many (None: every item).
    `max_stored_input_bytes` (`Settings.max_stored_input_bytes`): an object store carries the
    items, so they may be larger (`store.maps.map_input_limit`).

    Raises:
        As `store.maps.schedule_map`: InvalidInput (items, parallelism, limits),
        InputNotSerialisable / InputTooLarge (an item, or all of them), UnknownCapability,
        UnknownCase, TenancyMismatch, IdempotencyConflict, InvalidId. Nothing is written.
    """
    request = maps.MapRequest(
        case_id=case_id,
        tenancy_id=tenancy_id,
        capability=capability,
        items=items,
        idempotency_key=idempotency_key,
        parallelism=parallelism,
        max_failed_items=max_failed_items,
        min_succeeded=min_succeeded,
        dispatch_id=dispatch_id,
        priority=priority,
    )
    prepared = maps.prepare_map(
        request, router=router, max_input_bytes=max_input_bytes, max_stored_input_bytes=max_stored_input_bytes
    )
    with session.begin_nested():  # the map's rows and its dispatch, all or nothing
        (result,) = schedule_many_in_session(
            session, [prepared.request], router=router, max_input_bytes=max_input_bytes, via=via, now=now
        )
        maps.write_items(session, result, prepared)
    return result


@app.task(name=SCHEDULE_MAP_TASK, **RETRY)
def schedule_map(
    case_id: str,
    tenancy_id: str,
    capability: str,
    items: list[Any],
    idempotency_key: str,
    parallelism: int,
    max_failed_items: int | None = None,
    min_succeeded: int | None = None,
    dispatch_id: str | None = None,
    priority: int = 0,
) -> str:
    """The engine's map by task call: `schedule_map_in_session` in a transaction of its own; the
    map's dispatch id. Until it runs the request is only this message: send it again with the
    same idempotency key until the map exists."""
    rt = get_runtime()
    with transaction(rt.sessions) as session:
        result = schedule_map_in_session(
            session,
            case_id=case_id,
            tenancy_id=tenancy_id,
            capability=capability,
            items=items,
            idempotency_key=idempotency_key,
            parallelism=parallelism,
            router=rt.resolver,
            max_input_bytes=rt.settings.max_input_bytes,
            max_stored_input_bytes=rt.settings.max_stored_input_bytes,
            max_failed_items=max_failed_items,
            min_succeeded=min_succeeded,
            dispatch_id=dispatch_id,
            priority=priority,
        )
    return result.dispatch_id
