"""The `status` command's report: dispatches by state, the oldest one still pending, the latest
failures with their reasons, the dispatches whose Job cannot be created yet (and why) and the maps
not ended with their items' progress (`ops.map_progress`), read from the database in one short
transaction.

`read_status` does the reading; `StatusReport.to_dict` (for `--json`) and `render` (rich
tables for the terminal) are pure, so what an operator sees is tested without a database.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from rich.console import Group
from rich.table import Table
from rich.text import Text
from sqlalchemy.orm import Session

from k8s_dispatch.core.limits import Limits
from k8s_dispatch.ops.headline import MAX_MESSAGE_CHARS as MAX_MESSAGE_CHARS
from k8s_dispatch.ops.headline import headline
from k8s_dispatch.ops.headline import trim as _trim
from k8s_dispatch.ops.map_progress import MapProgress, read_progress
from k8s_dispatch.store import admission, dispatches
from k8s_dispatch.store.models import (
    TERMINAL_EVENT_TYPES,
    TERMINAL_STATES,
    CaseEvent,
    Dispatch,
    DispatchMap,
    DispatchState,
    EventType,
)

DEFAULT_FAILURES = 10
DEFAULT_MAPS = 10  # maps in progress listed, the oldest first; the rest are counted


@dataclass(frozen=True)
class Pending:
    """The oldest dispatch not yet ended: how long the system has owed a result."""

    dispatch_id: str
    state: str
    capability: str
    case_id: str
    tenancy_id: str
    created_at: datetime
    age_s: float


@dataclass(frozen=True)
class Failure:
    dispatch_id: str
    capability: str
    case_id: str
    tenancy_id: str
    reason: str
    message: str | None
    finished_at: datetime | None
    # From the failure's detail (`workers.failure_detail`): how its container ended.
    exit_code: int | None = None
    signal: str | None = None
    container_reason: str | None = None


@dataclass(frozen=True)
class CreateWait:
    """A pending dispatch whose last create was refused for now (403 exceeded quota, ...): retried."""

    dispatch_id: str
    capability: str
    error: str
    since: datetime


@dataclass(frozen=True)
class QueueRow:
    """One (tenancy, capability) under fair share: what holds slots, what waits, the limits."""

    tenancy_id: str
    capability: str
    running: int
    queued: int
    oldest_queued_s: float | None
    tenancy_limit: int | None  # None: no limit
    capability_limit: int | None


@dataclass(frozen=True)
class MapRow:
    """A map dispatch not yet ended, and how far its items are."""

    dispatch_id: str
    capability: str
    tenancy_id: str
    state: str
    created_at: datetime
    progress: MapProgress


@dataclass(frozen=True)
class StatusReport:
    generated_at: datetime
    counts: dict[str, int]  # every DispatchState, zero if none
    oldest_pending: Pending | None
    recent_failures: list[Failure]  # newest first
    unnotified: int  # ended, the engine not told yet (the sweep retries)
    create_waits: list[CreateWait] = field(default_factory=list)  # newest first
    create_waiting: int = 0  # how many pending dispatches wait for their Job's create
    queues: list[QueueRow] = field(default_factory=list)  # under a limit, or waiting
    maps: list[MapRow] = field(default_factory=list)  # maps not ended, the oldest first
    maps_pending: int = 0  # how many maps are not ended (`maps` lists the first of them)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def pending(self) -> int:
        return sum(n for state, n in self.counts.items() if DispatchState(state) not in TERMINAL_STATES)

    def to_dict(self) -> dict[str, Any]:
        oldest = self.oldest_pending
        return {
            "generated_at": self.generated_at.isoformat(),
            "total": self.total,
            "pending": self.pending,
            "counts": dict(self.counts),
            "unnotified": self.unnotified,
            "oldest_pending": None
            if oldest is None
            else {
                "dispatch_id": oldest.dispatch_id,
                "state": oldest.state,
                "capability": oldest.capability,
                "case_id": oldest.case_id,
                "tenancy_id": oldest.tenancy_id,
                "created_at": oldest.created_at.isoformat(),
                "age_s": round(oldest.age_s, 3),
            },
            "recent_failures": [
                {
                    "dispatch_id": f.dispatch_id,
                    "capability": f.capability,
                    "case_id": f.case_id,
                    "tenancy_id": f.tenancy_id,
                    "reason": f.reason,
                    "message": f.message,
                    "finished_at": f.finished_at.isoformat() if f.finished_at else None,
                    "exit_code": f.exit_code,
                    "signal": f.signal,
                    "container_reason": f.container_reason,
                }
                for f in self.recent_failures
            ],
            "queues": [
                {
                    "tenancy_id": q.tenancy_id,
                    "capability": q.capability,
                    "running": q.running,
                    "queued": q.queued,
                    "oldest_queued_s": None if q.oldest_queued_s is None else round(q.oldest_queued_s, 3),
                    "tenancy_limit": q.tenancy_limit,
                    "capability_limit": q.capability_limit,
                }
                for q in self.queues
            ],
            "maps_pending": self.maps_pending,
            "maps_in_progress": [
                {
                    "dispatch_id": m.dispatch_id,
                    "capability": m.capability,
                    "tenancy_id": m.tenancy_id,
                    "state": m.state,
                    "created_at": m.created_at.isoformat(),
                    **m.progress.to_dict(),
                }
                for m in self.maps
            ],
            "create_waiting": self.create_waiting,
            "create_waits": [
                {
                    "dispatch_id": w.dispatch_id,
                    "capability": w.capability,
                    "error": w.error,
                    "since": w.since.isoformat(),
                }
                for w in self.create_waits
            ],
        }


# --- reading -------------------------------------------------------------------------------


def read_status(
    session: Session,
    *,
    now: datetime,
    failures: int = DEFAULT_FAILURES,
    limits: Limits | None = None,
    maps: int = DEFAULT_MAPS,
) -> StatusReport:
    """The report as of `now`, from the caller's session (read only); `limits`: the
    capabilities file's, for the fair-share rows' limits; `maps`: how many maps in progress to
    list."""
    limits = limits if limits is not None else Limits()
    pending_states = sorted(s for s in DispatchState if s not in TERMINAL_STATES)
    terminal_states = sorted(TERMINAL_STATES)
    oldest_row = session.scalars(
        sa.select(Dispatch)
        .where(Dispatch.state.in_(pending_states))
        .order_by(Dispatch.created_at, Dispatch.dispatch_id)
        .limit(1)
    ).one_or_none()
    failed_rows = session.scalars(
        sa.select(Dispatch)
        .where(Dispatch.state == DispatchState.FAILED)
        .order_by(Dispatch.finished_at.desc(), Dispatch.dispatch_id)
        .limit(failures)
    ).all()
    messages, details = _failure_messages(session, [row.dispatch_id for row in failed_rows])
    unnotified = session.scalar(
        sa.select(sa.func.count())
        .select_from(Dispatch)
        .where(Dispatch.notified_at.is_(None), Dispatch.state.in_(terminal_states))
    )
    waiting = _waiting_to_create(pending_states)
    wait_rows = session.scalars(
        sa.select(Dispatch)
        .where(waiting)
        .order_by(Dispatch.create_error_at.desc(), Dispatch.dispatch_id)
        .limit(failures)
    ).all()
    create_waiting = session.scalar(sa.select(sa.func.count()).select_from(Dispatch).where(waiting))
    map_rows, maps_pending = _pending_maps(session, pending_states, maps)
    return StatusReport(
        generated_at=now,
        counts=dispatches.counts_by_state(session),
        oldest_pending=None
        if oldest_row is None
        else Pending(
            dispatch_id=oldest_row.dispatch_id,
            state=DispatchState(oldest_row.state).value,
            capability=oldest_row.capability,
            case_id=oldest_row.case_id,
            tenancy_id=oldest_row.tenancy_id,
            created_at=oldest_row.created_at,
            age_s=max(0.0, (now - oldest_row.created_at).total_seconds()),
        ),
        recent_failures=[
            Failure(
                dispatch_id=row.dispatch_id,
                capability=row.capability,
                case_id=row.case_id,
                tenancy_id=row.tenancy_id,
                reason=row.reason or "Unknown",
                message=messages.get(row.dispatch_id),
                finished_at=row.finished_at,
                exit_code=_int(details.get(row.dispatch_id, {}).get("exit_code")),
                signal=_str(details.get(row.dispatch_id, {}).get("signal")),
                container_reason=_str(details.get(row.dispatch_id, {}).get("container_reason")),
            )
            for row in failed_rows
        ],
        unnotified=int(unnotified or 0),
        create_waits=[
            CreateWait(row.dispatch_id, row.capability, row.create_error or "", row.create_error_at)
            for row in wait_rows
            if row.create_error_at is not None  # always: `_waiting_to_create` asks for one
        ],
        create_waiting=int(create_waiting or 0),
        queues=[
            QueueRow(
                q.tenancy_id,
                q.capability,
                q.running,
                q.queued,
                None if q.oldest_queued_at is None else max(0.0, (now - q.oldest_queued_at).total_seconds()),
                limits.tenancy(q.tenancy_id).max_running,
                limits.capability(q.capability),
            )
            for q in admission.summary(session)
            if q.queued or limits.limits(q.tenancy_id, q.capability)
        ],
        maps=map_rows,
        maps_pending=maps_pending,
    )


def _pending_maps(session: Session, pending_states: list[DispatchState], limit: int) -> tuple[list[MapRow], int]:
    """The oldest `limit` maps not ended, with their progress, and how many there are."""
    pending_maps = sa.and_(DispatchMap.dispatch_id == Dispatch.dispatch_id, Dispatch.state.in_(pending_states))
    total = session.scalar(sa.select(sa.func.count()).select_from(Dispatch).join(DispatchMap, pending_maps))
    if not total or limit <= 0:
        return [], int(total or 0)
    rows = session.scalars(
        sa.select(Dispatch)
        .join(DispatchMap, pending_maps)
        .order_by(Dispatch.created_at, Dispatch.dispatch_id)
        .limit(limit)
    ).all()
    progress = read_progress(session, rows)
    return [
        MapRow(
            dispatch_id=row.dispatch_id,
            capability=row.capability,
            tenancy_id=row.tenancy_id,
            state=DispatchState(row.state).value,
            created_at=row.created_at,
            progress=progress[row.dispatch_id],
        )
        for row in rows
        if row.dispatch_id in progress  # always: the query joined their dispatch_maps rows
    ], int(total)


def _waiting_to_create(pending_states: list[DispatchState]) -> sa.ColumnElement[bool]:
    """Pending, and the last create failed after the last one that worked."""
    return sa.and_(
        Dispatch.state.in_(pending_states),
        Dispatch.create_error_at.is_not(None),
        sa.or_(Dispatch.job_created_at.is_(None), Dispatch.create_error_at > Dispatch.job_created_at),
    )


def _failure_messages(session: Session, dispatch_ids: list[str]) -> tuple[dict[str, str], dict[str, dict[str, Any]]]:
    """The `message` of each dispatch's terminal event (the reason's detail), where it has one,
    and its structured `detail` (exit code, signal, container reason...)."""
    if not dispatch_ids:
        return {}, {}
    events = session.scalars(
        sa.select(CaseEvent).where(
            CaseEvent.dispatch_id.in_(dispatch_ids),
            CaseEvent.type.in_(sorted(t.value for t in TERMINAL_EVENT_TYPES)),
        )
    )
    found: dict[str, str] = {}
    details: dict[str, dict[str, Any]] = {}
    for event in events:
        message = event.payload.get("message") if isinstance(event.payload, dict) else None
        if event.dispatch_id is None:  # never: the query asks for these dispatches' events
            continue
        if event.type == EventType.WORKER_FAILED and isinstance(message, str) and message.strip():
            found[event.dispatch_id] = headline(message)
        detail = event.payload.get("detail") if isinstance(event.payload, dict) else None
        if event.type == EventType.WORKER_FAILED and isinstance(detail, dict):
            details[event.dispatch_id] = detail
    return found, details


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None


# --- rendering (pure) ----------------------------------------------------------------------


def render(report: StatusReport) -> Group:
    """Tables for the terminal: states, the oldest pending dispatch, the latest failures."""
    states = Table(title="dispatches by state", title_justify="left")
    states.add_column("state")
    states.add_column("count", justify="right")
    for state in DispatchState:
        states.add_row(state.value, str(report.counts.get(state.value, 0)))
    states.add_row("total", str(report.total), style="bold")

    lines: list[Any] = [states]
    oldest = report.oldest_pending
    if oldest is None:
        lines.append("oldest pending: none")
    else:
        lines.append(
            f"oldest pending: {oldest.dispatch_id} {oldest.state} {oldest.capability} "
            f"case={oldest.case_id} tenancy={oldest.tenancy_id}, waiting {format_age(oldest.age_s)}"
        )
    if report.queues:
        lines.append(_queues_table(report.queues))
    if report.maps:
        lines.append(_maps_table(report.maps, report.maps_pending))
    if report.unnotified:
        lines.append(f"ended but the engine not told yet: {report.unnotified} (the sweep retries)")
    if report.create_waiting:
        lines.append(Text(f"waiting for their Job to be created: {report.create_waiting} (retried)", style="italic"))
        for w in report.create_waits:
            line = Text(f"  {w.since.strftime('%Y-%m-%d %H:%M:%S')}  {w.capability}  {w.dispatch_id}")
            lines.append(line)
            lines.append(Text(f"      {_trim(w.error)}", style="dim"))
    if report.recent_failures:
        # Lines, not a table: a UUID and a reason side by side leave no room in 80 columns.
        lines.append(Text(f"latest {len(report.recent_failures)} failures", style="italic"))
        for f in report.recent_failures:
            when = f.finished_at.strftime("%Y-%m-%d %H:%M:%S") if f.finished_at else "-"
            line = Text(f"  {when}  ")
            line.append(f.reason, style="bold red")
            line.append(f"  {f.capability}  tenancy={f.tenancy_id}  case={f.case_id}  {f.dispatch_id}")
            lines.append(line)
            if f.exit_code is not None or f.container_reason:
                how = " ".join(
                    part
                    for part in (
                        f.container_reason,
                        f"exit code {f.exit_code}" if f.exit_code is not None else None,
                        f"({f.signal})" if f.signal else None,
                    )
                    if part
                )
                lines.append(Text(f"      container: {how}  (k8s-dispatch show {f.dispatch_id})", style="dim"))
            if f.message:
                lines.append(Text(f"      {f.message}", style="dim"))
    else:
        lines.append("no failures")
    return Group(*lines)


def _maps_table(rows: list[MapRow], pending: int) -> Table:
    """Each map not ended: its items by how they ended; open items running or waiting (the
    database cannot tell which, but knows the most that can run: see `ops.map_progress`)."""
    more = pending - len(rows)
    table = Table(
        title="maps in progress",
        title_justify="left",
        caption=f"and {more} more (k8s-dispatch status --maps N)" if more > 0 else None,
        caption_justify="left",
    )
    for column in ("map", "capability", "items", "succeeded", "failed", "open"):
        table.add_column(column, justify="left" if column in ("map", "capability", "open") else "right")
    for m in rows:
        p = m.progress
        failed = str(p.failed) + (f" (+{p.cancelled} cancelled)" if p.cancelled else "")
        table.add_row(m.dispatch_id, m.capability, str(p.items), str(p.succeeded), failed, _open_cell(p))
    return table


def _open_cell(p: MapProgress) -> str:
    if p.open == 0:
        return "0"
    if p.waiting is not None:
        return f"{p.open} waiting"
    return f"{p.open} (≤{p.running_at_most} running)"


def _queues_table(rows: list[QueueRow]) -> Table:
    """Per (tenancy, capability); the limits column says how full each limit is as a whole."""
    by_tenancy: dict[str, int] = {}
    by_capability: dict[str, int] = {}
    for q in rows:
        by_tenancy[q.tenancy_id] = by_tenancy.get(q.tenancy_id, 0) + q.running
        by_capability[q.capability] = by_capability.get(q.capability, 0) + q.running
    table = Table(title="fair share", title_justify="left")
    for column in ("tenancy", "capability", "running", "queued", "oldest queued", "limits (running / limit)"):
        table.add_column(column, justify="right" if column in ("running", "queued") else "left")
    for q in rows:
        limits = [
            f"{label} {used} / {limit}"
            for label, used, limit in (
                ("tenancy", by_tenancy[q.tenancy_id], q.tenancy_limit),
                ("capability", by_capability[q.capability], q.capability_limit),
            )
            if limit is not None
        ]
        table.add_row(
            q.tenancy_id,
            q.capability,
            str(q.running),
            str(q.queued),
            "-" if q.oldest_queued_s is None else format_age(q.oldest_queued_s),
            ", ".join(limits) or "none",
        )
    return table


def format_age(seconds: float) -> str:
    """`42s`, `3m05s`, `2h07m`, `3d04h`."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"
