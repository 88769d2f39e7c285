"""A map dispatch's progress as `status` and `show` report it: its items succeeded, failed,
cancelled and still open, and its failed items with their reasons, from the database alone.

Running or waiting: the database records when an item ends, never when its Pod starts, so an
open item is "running or waiting" there. What it does know is said: a map whose Job was not
created yet runs nothing (every open item waits), and its Job runs at most `parallelism` items
at once (`running_at_most`). The split itself is the cluster's (the Job's active Pods by
index); `status` and `show` stay on the database, which still answers with the cluster down
and after the Pods are gone.

`read_progress` and `read_failed_items` do the reading; the rest is pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from k8s_dispatch.ops.headline import headline
from k8s_dispatch.store import maps
from k8s_dispatch.store.models import TERMINAL_STATES, CaseEvent, Dispatch, DispatchState, ItemEventType, MapItemEnd

DEFAULT_FAILED_ITEMS = 20  # failed items `show` lists; the rest are counted


@dataclass(frozen=True)
class MapProgress:
    """How far one map is: its shape, its items' ends by kind, and whether its Job was made."""

    items: int
    parallelism: int
    succeeded: int
    failed: int
    cancelled: int
    job_created: bool  # a Job was made for it: its open items may be running
    ended: bool = False  # the map's own terminal event is recorded
    max_failed_items: int | None = None
    min_succeeded: int | None = None

    @property
    def open(self) -> int:
        return max(0, self.items - self.succeeded - self.failed - self.cancelled)

    @property
    def running_at_most(self) -> int:
        """The most items that can be running: none before its Job or after its end."""
        return 0 if self.ended or not self.job_created else min(self.parallelism, self.open)

    @property
    def running(self) -> int | None:
        """Items running, where the database knows (none can be); None: the cluster knows."""
        return 0 if self.running_at_most == 0 else None

    @property
    def waiting(self) -> int | None:
        """Items waiting for a Pod, where the database knows; None: the cluster knows."""
        return self.open if self.running_at_most == 0 else None

    def summary(self) -> str:
        """One line: `3 of 10 succeeded, 1 failed, 6 open (at most 2 running, the rest waiting)`."""
        parts = [f"{self.succeeded} of {self.items} succeeded", f"{self.failed} failed"]
        if self.cancelled:
            parts.append(f"{self.cancelled} cancelled")
        parts.append(f"{self.open} open{self.open_detail()}")
        return ", ".join(parts)

    def open_detail(self) -> str:
        if not self.open:
            return ""
        if self.running_at_most == 0:
            return " (all waiting: no Job yet)" if not self.ended else ""
        return f" (at most {self.running_at_most} running, the rest waiting)"

    def rule(self) -> str:
        """How the map passes and when its Job stops, in words."""
        passes = "every item" if self.min_succeeded is None else f"at least {self.min_succeeded}"
        stops = "" if self.max_failed_items is None else f"; stops once more than {self.max_failed_items} failed"
        return f"{self.items} items, parallelism {self.parallelism}, passes with {passes} succeeded{stops}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "items": self.items,
            "parallelism": self.parallelism,
            "max_failed_items": self.max_failed_items,
            "min_succeeded": self.min_succeeded,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "cancelled": self.cancelled,
            "open": self.open,
            "running": self.running,  # null: the database cannot tell (the cluster can)
            "waiting": self.waiting,
            "running_at_most": self.running_at_most,
        }


@dataclass(frozen=True)
class ItemFailure:
    """One failed item, as its item event recorded it."""

    index: int
    reason: str
    message: str | None  # its headline: a traceback's exception line, cut to one short line
    exit_code: int | None
    at: datetime

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "reason": self.reason,
            "message": self.message,
            "exit_code": self.exit_code,
            "at": self.at.isoformat(),
        }


# --- reading -------------------------------------------------------------------------------


def read_progress(session: Session, rows: Sequence[Dispatch]) -> dict[str, MapProgress]:
    """The progress of the maps among `rows`, by dispatch id (two queries; one, finding no map,
    when there is none)."""
    by_id = {row.dispatch_id: row for row in rows}
    shapes = maps.map_shapes(session, by_id)
    if not shapes:
        return {}
    counts: dict[str, dict[str, int]] = {d: {} for d in shapes}
    query = (
        sa.select(MapItemEnd.dispatch_id, MapItemEnd.type, sa.func.count())
        .where(MapItemEnd.dispatch_id.in_(sorted(shapes)))
        .group_by(MapItemEnd.dispatch_id, MapItemEnd.type)
    )
    for dispatch_id, kind, n in session.execute(query):
        counts[str(dispatch_id)][str(kind)] = int(n)
    return {
        d: MapProgress(
            items=shape.items,
            parallelism=shape.parallelism,
            succeeded=counts[d].get(ItemEventType.ITEM_COMPLETED.value, 0),
            failed=counts[d].get(ItemEventType.ITEM_FAILED.value, 0),
            cancelled=counts[d].get(ItemEventType.ITEM_CANCELLED.value, 0),
            job_created=by_id[d].job_created_at is not None,
            ended=DispatchState(by_id[d].state) in TERMINAL_STATES,
            max_failed_items=shape.max_failed_items,
            min_succeeded=shape.min_succeeded,
        )
        for d, shape in shapes.items()
    }


def read_failed_items(session: Session, row: Dispatch, *, limit: int = DEFAULT_FAILED_ITEMS) -> list[ItemFailure]:
    """The map's first `limit` failed items, in the order they failed (the first failures say
    most; the items a failed map's end closed come last), from their item events: an indexed
    read of the case's log that stops at `limit`."""
    if limit <= 0:
        return []
    query = (
        sa.select(CaseEvent)
        .where(
            CaseEvent.case_id == row.case_id,
            CaseEvent.dispatch_id == row.dispatch_id,
            CaseEvent.type == ItemEventType.ITEM_FAILED.value,
        )
        .order_by(CaseEvent.id)
        .limit(limit)
    )
    return [_failure(event) for event in session.scalars(query)]


def _failure(event: CaseEvent) -> ItemFailure:
    payload = event.payload if isinstance(event.payload, dict) else {}
    message = payload.get("message")
    exit_code = payload.get("exit_code")
    index = payload.get("item")
    return ItemFailure(
        index=index if isinstance(index, int) and not isinstance(index, bool) else -1,
        reason=str(payload.get("reason") or "Unknown"),
        message=headline(message) if isinstance(message, str) and message.strip() else None,
        exit_code=exit_code if isinstance(exit_code, int) and not isinstance(exit_code, bool) else None,
        at=event.created_at,
    )
