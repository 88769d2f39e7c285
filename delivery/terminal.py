"""The one writer of terminal events, and what follows each: every end of a dispatch (completed,
failed, cancelled, lost, timed out in the queue, given up by the sweep) is written by `record`,
in the caller's transaction, and announced by `announce` once that transaction committed.

The store's unique index on the terminal event is the arbiter: `record` returns the dispatches
this call won, and only those are announced (a state-change line each, then the engine told, and
admission run for the slots they free). A send that fails leaves the dispatch unnotified, and
the sweep notifies it later: at least once.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy.orm import Session

from k8s_dispatch.core.errors import Transient
from k8s_dispatch.delivery import statelog, stats
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.delivery.statelog import DispatchLike
from k8s_dispatch.store import dispatches, maps
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import STATE_FOR_TERMINAL_EVENT, EventType

log = logging.getLogger(__name__)


def record(session: Session, events: Sequence[dispatches.TerminalEvent], *, maps_among: bool = True) -> set[str]:
    """Write these terminal events in the caller's transaction; the dispatch ids this call won.

    A dispatch that has its end already is left as it is (the unique index decides between
    racing writers); the row's update takes the dispatch's row lock, which is what keeps a
    create from making a Job for a dispatch that ends meanwhile (`delivery.create`).
    A map's end ends its items still open, cancelled or failed with it (`store.maps.end_open_items`:
    one SELECT for the maps among the ended); `maps_among=False` is a caller that holds no map.

    Raises:
        UnknownDispatch, InvalidInput, InputNotSerialisable: nothing is written.
    """
    if not events:
        return set()
    won = dispatches.record_terminals(session, events)
    if won and maps_among:
        ends = {e.dispatch_id: (e.type, e.payload.get("reason")) for e in events if e.dispatch_id in won}
        maps.end_open_items(session, ends)
    return won


def record_items(session: Session, ends: Sequence[maps.ItemEnd]) -> set[tuple[str, int]]:
    """Write map items' ends in the caller's transaction; the (dispatch, item) pairs this call
    won. The primary key on (dispatch, item) is the arbiter, as the terminal event's index is
    for a dispatch (`store.maps.record_item_ends`).

    Raises:
        InputNotSerialisable: a payload the store cannot keep (nothing is written).
    """
    return maps.record_item_ends(session, ends)


def announce(rt: Runtime, ended: Sequence[tuple[DispatchLike, dispatches.TerminalEvent]]) -> set[str]:
    """After the transaction that `record`ed them committed: a state-change line per ended
    dispatch (and a failed one shown: `Runtime.on_failed`), then the engine told
    (`notify_engines`); the ids sent."""
    for dispatch, event in ended:
        statelog.dispatch_changed(dispatch, STATE_FOR_TERMINAL_EVENT[event.type], reason=event.payload.get("reason"))
        if rt.on_failed is not None and event.type == EventType.WORKER_FAILED:
            rt.on_failed(
                event.dispatch_id, str(event.payload.get("reason") or ""), str(event.payload.get("message") or "")
            )
    return notify_engines(rt, [event.dispatch_id for _, event in ended]) if ended else set()


def notify_engine(rt: Runtime, dispatch_id: str) -> bool:
    """Tell the engine a dispatch ended, then record that it was told; False if not sent."""
    return dispatch_id in notify_engines(rt, [dispatch_id])


def notify_engines(rt: Runtime, dispatch_ids: Sequence[str]) -> set[str]:
    """Tell the engine these dispatches ended, then record (in one transaction) that it was
    told; the ids sent.

    Called after the terminal events committed. A send that fails (or a process with no
    notifier) leaves the dispatch unnotified, and the sweep notifies it later: at least once.
    """
    if rt.on_ended is not None and dispatch_ids:
        rt.on_ended(dispatch_ids)  # their slots are free: admission may run
    if rt.notifier is None:
        return set()
    sent: list[str] = []
    for dispatch_id in dispatch_ids:
        try:
            rt.notifier(dispatch_id)
        except Transient as e:
            log.warning("could not notify the engine of dispatch %s (%s); the sweep will retry", dispatch_id, e)
            continue
        sent.append(dispatch_id)
    if sent:
        with transaction(rt.sessions) as session:
            dispatches.mark_notified_many(session, sent)
        rt.stats.incr(stats.NOTIFICATIONS_SENT, len(sent))
    return set(sent)


def fail_dispatch(
    rt: Runtime, dispatch_id: str, *, reason: str, message: str | None = None, detail: Mapping[str, Any] | None = None
) -> bool:
    """Record WORKER_FAILED with `reason` (e.g. JobLost), and `detail` if given, and notify the
    engine; False if the dispatch had ended already.

    Raises:
        UnknownDispatch: no such dispatch.
    """
    payload: dict[str, Any] = {"reason": reason} if message is None else {"reason": reason, "message": message}
    if detail is not None:
        payload["detail"] = dict(detail)
    event = dispatches.TerminalEvent(dispatch_id, EventType.WORKER_FAILED, payload)
    with transaction(rt.sessions) as session:
        won = bool(record(session, [event]))
        row = dispatches.get_dispatch(session, dispatch_id)
    if won:
        assert row is not None  # the write found and updated it in this transaction
        announce(rt, [(row, event)])
    return won
