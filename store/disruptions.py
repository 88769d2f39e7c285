"""WORKER_DISRUPTED events: one per disrupted Pod of a dispatch, never two, whoever records it.

A disruption (an eviction, a preemption, a node lost) is not the work's failure: the Job
replaces the Pod, and the event log says "disrupted, retried". Poll, every replica's batch and
the sweep may all see the same disrupted Pod, so `record_disruptions` is idempotent per Pod uid:
in the caller's transaction it locks the dispatches' rows (in id order, as `record_terminals`
writes them, so racing writers wait and never deadlock), reads the Pods already recorded and
writes only the new ones. It writes nothing for a dispatch that has ended. The event type is a
plain string column, so no schema change: the lookup goes through the case index
(`ix_case_events_case_id`), a case's events being few.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from k8s_dispatch.core.errors import InvalidInput
from k8s_dispatch.core.payloads import canonical_json
from k8s_dispatch.store.db import database_now
from k8s_dispatch.store.models import TERMINAL_STATES, CaseEvent, Dispatch, DispatchState, EventType

POD_UID_KEY = "pod_uid"


@dataclass(frozen=True)
class DisruptionEvent:
    """One disrupted Pod of a dispatch; `payload` (node, reason, ...) must hold its `pod_uid`."""

    dispatch_id: str
    payload: Mapping[str, Any]

    @property
    def pod_uid(self) -> str:
        return str(self.payload.get(POD_UID_KEY) or "")


@dataclass(frozen=True)
class Disrupted:
    """A dispatch's disruptions after `record_disruptions`: how many in all, which were new."""

    dispatch_id: str
    total: int
    new: tuple[str, ...]  # pod uids this call recorded
    state: DispatchState


def record_disruptions(
    session: Session, events: Sequence[DisruptionEvent], *, now: datetime | None = None
) -> dict[str, Disrupted]:
    """Record each disrupted Pod once (WORKER_DISRUPTED), for dispatches that have not ended; by
    dispatch id, what each now counts (a dispatch that does not exist is left out).

    Raises:
        InvalidInput: an event names no pod uid, or its payload is not canonical JSON.
    """
    by_dispatch: dict[str, dict[str, dict[str, Any]]] = {}
    for event in events:
        if not event.pod_uid:
            raise InvalidInput(f"a disruption of dispatch {event.dispatch_id} names no {POD_UID_KEY}")
        payload = json.loads(canonical_json(dict(event.payload), what="a disruption's payload"))
        by_dispatch.setdefault(event.dispatch_id, {}).setdefault(event.pod_uid, payload)
    if not by_dispatch:
        return {}
    table = Dispatch.__table__
    rows = session.execute(
        sa.select(table.c.dispatch_id, table.c.case_id, table.c.state)
        .where(table.c.dispatch_id.in_(sorted(by_dispatch)))
        .order_by(table.c.dispatch_id)
        .with_for_update()
    ).all()
    cases = {row.dispatch_id: row.case_id for row in rows}
    seen: dict[str, set[str]] = {d: set() for d in cases}
    if cases:
        events_table = CaseEvent.__table__
        recorded = session.execute(
            sa.select(events_table.c.dispatch_id, events_table.c.payload).where(
                events_table.c.case_id.in_(sorted(set(cases.values()))),
                events_table.c.dispatch_id.in_(sorted(cases)),
                events_table.c.type == EventType.WORKER_DISRUPTED.value,
            )
        ).all()
        for stored in recorded:
            uid = stored.payload.get(POD_UID_KEY) if isinstance(stored.payload, Mapping) else None
            if isinstance(uid, str):
                seen[stored.dispatch_id].add(uid)
    now = now or database_now(session)
    out: dict[str, Disrupted] = {}
    inserts: list[dict[str, Any]] = []
    for row in rows:
        state = DispatchState(row.state)
        fresh = [] if state in TERMINAL_STATES else sorted(set(by_dispatch[row.dispatch_id]) - seen[row.dispatch_id])
        inserts += [
            {
                "case_id": row.case_id,
                "dispatch_id": row.dispatch_id,
                "type": EventType.WORKER_DISRUPTED.value,
                "payload": by_dispatch[row.dispatch_id][uid],
                "created_at": now,
            }
            for uid in fresh
        ]
        out[row.dispatch_id] = Disrupted(row.dispatch_id, len(seen[row.dispatch_id]) + len(fresh), tuple(fresh), state)
    if inserts:
        session.execute(sa.insert(CaseEvent.__table__), inserts)
    return out


def disruptions_of(session: Session, dispatch_id: str) -> list[CaseEvent]:
    """The dispatch's WORKER_DISRUPTED events, oldest first."""
    return list(
        session.scalars(
            sa.select(CaseEvent)
            .where(CaseEvent.dispatch_id == dispatch_id, CaseEvent.type == EventType.WORKER_DISRUPTED.value)
            .order_by(CaseEvent.id)
        )
    )
