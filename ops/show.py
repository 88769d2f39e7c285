"""The `show` command's story of one dispatch: its row, every event of it in order, its attempts,
the disruptions its Pods met, why it failed (the Pod's and container's reasons, exit code and
signal, the log tail, the Warning Events) and its timings, read from the database alone in one
short transaction (the cluster may have forgotten the Pods long since: what they said is in the
event log).

A map dispatch's story also holds its items' progress and its first failed items with their
reasons (`ops.map_progress`); its events are the map's own, its items' events being counted
there (every item's are in the engine's log: `api.item_outcomes`).

`read_story` does the reading; `Story.to_dict` (for `--json`) and `render` are pure.
`write_logs` (`show ID --logs`) copies out the container logs `archiveLogs` kept in the object
store, which outlive the Pods.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, BinaryIO

import sqlalchemy as sa
from rich.console import Group
from rich.table import Table
from rich.text import Text
from sqlalchemy.orm import Session

from k8s_dispatch import artifacts
from k8s_dispatch.artifacts import logs
from k8s_dispatch.core.errors import ConfigError, UnknownDispatch
from k8s_dispatch.core.ids import check_dispatch_id
from k8s_dispatch.ops.map_progress import (
    DEFAULT_FAILED_ITEMS,
    ItemFailure,
    MapProgress,
    read_failed_items,
    read_progress,
)
from k8s_dispatch.ops.status import format_age
from k8s_dispatch.store import admission, dispatches
from k8s_dispatch.store.models import CaseEvent, Dispatch, EventType, ItemEventType

if TYPE_CHECKING:
    from k8s_dispatch.core.settings import Settings


@dataclass(frozen=True)
class StoryEvent:
    id: int
    type: str
    at: datetime
    payload: dict[str, Any]


@dataclass(frozen=True)
class Story:
    dispatch_id: str
    case_id: str
    tenancy_id: str
    capability: str
    state: str
    reason: str | None
    job: str | None  # namespace/name
    attempt: int  # the current Job's attempt, from 0: one more each time a lost Job is made again
    created_at: datetime
    job_created_at: datetime | None
    finished_at: datetime | None
    notified_at: datetime | None
    events: list[StoryEvent] = field(default_factory=list)
    priority: int = 0
    admitted_at: datetime | None = None  # a limit queued it until then
    place: int | None = None  # queued: its place in its tenancy's queue for its capability (1: next)
    map: MapProgress | None = None  # a map dispatch's items; None: not a map
    failed_items: list[ItemFailure] = field(default_factory=list)  # a map's first failed items

    @property
    def attempts(self) -> int:
        """Jobs made for it so far: none before its first create, then one per attempt."""
        return self.attempt + 1 if self.job else 0

    @property
    def disruptions(self) -> list[dict[str, Any]]:
        return [e.payload for e in self.events if e.type == EventType.WORKER_DISRUPTED]

    @property
    def end(self) -> StoryEvent | None:
        ends = {EventType.WORKER_COMPLETED, EventType.WORKER_FAILED, EventType.WORKER_CANCELLED}
        return next((e for e in self.events if e.type in ends), None)

    @property
    def failure(self) -> dict[str, Any]:
        """The failure's structured detail (exit code, reasons, log tail, events), if it failed."""
        end = self.end
        detail = end.payload.get("detail") if end is not None and end.type == EventType.WORKER_FAILED else None
        return detail if isinstance(detail, dict) else {}

    def timings(self) -> dict[str, float | None]:
        """Seconds: scheduled -> Job created (queued), Job created -> end (ran), scheduled -> end."""

        def span(start: datetime | None, end: datetime | None) -> float | None:
            return None if start is None or end is None else round(max(0.0, (end - start).total_seconds()), 3)

        return {
            "waited_for_slot_s": span(self.created_at, self.admitted_at),
            "queued_s": span(self.created_at, self.job_created_at),
            "ran_s": span(self.job_created_at, self.finished_at),
            "total_s": span(self.created_at, self.finished_at),
        }

    @property
    def failed_items_not_shown(self) -> int:
        return 0 if self.map is None else max(0, self.map.failed - len(self.failed_items))

    def to_dict(self) -> dict[str, Any]:
        def when(value: datetime | None) -> str | None:
            return value.isoformat() if value else None

        story = {
            "dispatch_id": self.dispatch_id,
            "case_id": self.case_id,
            "tenancy_id": self.tenancy_id,
            "capability": self.capability,
            "state": self.state,
            "reason": self.reason,
            "job": self.job,
            "attempts": self.attempts,
            "attempt": self.attempt,
            "created_at": when(self.created_at),
            "job_created_at": when(self.job_created_at),
            "finished_at": when(self.finished_at),
            "notified_at": when(self.notified_at),
            "priority": self.priority,
            "admitted_at": when(self.admitted_at),
            "place_in_queue": self.place,
            "timings": self.timings(),
            "disruptions": self.disruptions,
            "failure": self.failure,
            "events": [{"id": e.id, "type": e.type, "at": e.at.isoformat(), "payload": e.payload} for e in self.events],
        }
        if self.map is not None:  # a dispatch that is not a map keeps the keys it always had
            story["map"] = {
                **self.map.to_dict(),
                "failed_items": [f.to_dict() for f in self.failed_items],
                "failed_items_not_shown": self.failed_items_not_shown,
            }
        return story


def read_story(session: Session, dispatch_id: str, *, failed_items: int = DEFAULT_FAILED_ITEMS) -> Story:
    """The dispatch's story, from the caller's session (read only); for a map, its progress and
    its first `failed_items` failed items.

    Raises:
        InvalidId: not a dispatch id.
        UnknownDispatch: no such dispatch.
    """
    check_dispatch_id(dispatch_id)
    row = dispatches.get_dispatch(session, dispatch_id)
    if row is None:
        raise UnknownDispatch(f"dispatch {dispatch_id} does not exist")
    progress = read_progress(session, [row]).get(dispatch_id)
    events = [
        StoryEvent(
            e.id, e.type, e.created_at, _redacted(e.payload if isinstance(e.payload, dict) else {"value": e.payload})
        )
        for e in (dispatches.events_for(session, dispatch_id) if progress is None else _map_events(session, row))
    ]
    return Story(
        dispatch_id=row.dispatch_id,
        case_id=row.case_id,
        tenancy_id=row.tenancy_id,
        capability=row.capability,
        state=str(row.state.value if hasattr(row.state, "value") else row.state),
        reason=row.reason,
        job=f"{row.job_namespace}/{row.job_name}" if row.job_name else None,
        attempt=row.attempts or 0,
        created_at=row.created_at,
        job_created_at=row.job_created_at,
        finished_at=row.finished_at,
        notified_at=row.notified_at,
        events=events,
        priority=row.priority or 0,
        admitted_at=row.admitted_at,
        place=admission.place(session, dispatch_id),
        map=progress,
        failed_items=[] if progress is None else read_failed_items(session, row, limit=failed_items),
    )


def _map_events(session: Session, row: Dispatch) -> list[CaseEvent]:
    """A map's own events, in order, without its items' (up to one per item: counted instead)."""
    query = (
        sa.select(CaseEvent)
        .where(
            CaseEvent.case_id == row.case_id,
            CaseEvent.dispatch_id == row.dispatch_id,
            CaseEvent.type.not_in([t.value for t in ItemEventType]),
        )
        .order_by(CaseEvent.id)
    )
    return list(session.scalars(query))


# --- rendering (pure) ----------------------------------------------------------------------


def render(story: Story) -> Group:
    """The story for the terminal: who and where, timings, the events, disruptions, why it failed."""
    head = Text()
    head.append(f"{story.dispatch_id}  ", style="bold")
    head.append(story.state, style="bold red" if story.state == "FAILED" else "bold")
    if story.reason:
        head.append(f" {story.reason}", style="red")
    lines: list[Any] = [
        head,
        f"capability {story.capability}  tenancy={story.tenancy_id}  case={story.case_id}",
        f"job {story.job or '-'}  attempts {story.attempts}  disruptions {len(story.disruptions)}",
    ]
    if story.place is not None:
        lines.append(
            Text(f"queued under its limits: place {story.place} in {story.tenancy_id}'s queue for {story.capability}"
                 f" (priority {story.priority})", style="italic")
        )  # fmt: skip
    if story.map is not None:
        lines.extend(_map_lines(story))
    timing = story.timings()
    lines.append(
        "timings: "
        + ", ".join(
            f"{label} {format_age(value) if value >= 1 else f'{value:.2f}s'}"
            for label, value in (
                ("waited for a slot", timing["waited_for_slot_s"]),
                ("queued", timing["queued_s"]),
                ("ran", timing["ran_s"]),
                ("total", timing["total_s"]),
            )
            if value is not None
        )
    )
    table = Table(title="events", title_justify="left")
    for column in ("#", "at", "type", "what"):
        table.add_column(column)
    for e in story.events:
        table.add_row(str(e.id), e.at.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3], e.type, _what(e))
    lines.append(table)
    failure = story.failure
    if failure:
        lines.append(Text("why it failed", style="italic"))
        facts = [
            ("job", failure.get("job_reason"), failure.get("job_message")),
            ("pod", failure.get("pod"), failure.get("node") and f"on node {failure['node']}"),
            ("pod reason", failure.get("pod_reason"), failure.get("pod_message")),
            ("container", failure.get("container_reason"), _exit(failure)),
        ]
        for label, value, more in facts:
            if value or more:
                lines.append(f"  {label}: {value or ''}{'  ' + str(more) if more else ''}")
        for event in failure.get("events") or []:
            lines.append(f"  event: {event.get('object')} {event.get('reason')}: {event.get('message')}")
        if failure.get("log_tail"):
            lines.append(Text("  log tail:", style="italic"))
            lines.append(Text("\n".join("    " + line for line in str(failure["log_tail"]).splitlines()), style="dim"))
        if failure.get("log_key"):
            lines.append(f"  whole log: {failure['log_key']} (show {story.dispatch_id} --logs)")
    return Group(*lines)


def _map_lines(story: Story) -> list[Any]:
    """The map's rule, its progress on one line, and its first failed items (then how many more)."""
    progress = story.map
    if progress is None:
        return []
    lines: list[Any] = [f"map: {progress.rule()}", Text(f"items: {progress.summary()}", style="bold")]
    if story.failed_items:
        table = Table(title="failed items", title_justify="left")
        for column in ("item", "reason", "exit code", "message"):
            table.add_column(column, justify="right" if column in ("item", "exit code") else "left")
        for f in story.failed_items:
            exit_code = "-" if f.exit_code is None else str(f.exit_code)
            table.add_row(str(f.index), f.reason, exit_code, _short(f.message or "", 100))
        lines.append(table)
    if story.failed_items_not_shown:
        lines.append(
            Text(f"and {story.failed_items_not_shown} more failed items (--failed-items N lists more)", style="italic")
        )
    return lines


SECRET_SHOWN = "(secret: kept encrypted, never shown)"


def _redacted(payload: dict[str, Any]) -> dict[str, Any]:
    """A secret input's event says so in place of its input (which it never holds: this also
    covers a row an engine wrote itself with the input in it)."""
    if payload.get("secret") is True and "input" in payload:
        return {**payload, "input": SECRET_SHOWN}
    return payload


def _exit(failure: dict[str, Any]) -> str | None:
    if "exit_code" not in failure:
        return None
    signal = failure.get("signal")
    return f"exit code {failure['exit_code']}" + (f" ({signal})" if signal else "")


def _what(event: StoryEvent) -> str:
    p = event.payload
    if event.type == EventType.WORKER_DISRUPTED:
        return f"pod {p.get('pod')} {p.get('reason')} on node {p.get('node')}: replaced"
    if event.type == EventType.WORKER_COMPLETED:
        return "output " + _short(p.get("output"))
    if "reason" in p:
        return f"{p.get('reason')}" + (f": {_short(p.get('message'))}" if p.get("message") else "")
    return _short(p)


def _short(value: object, limit: int = 120) -> str:
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- archived logs (`show ID --logs`) ------------------------------------------------------


def write_logs(settings: Settings, dispatch_id: str, out: BinaryIO) -> int:
    """Write the dispatch's archived container logs (its capability's `archiveLogs`) to `out`,
    oldest attempt first, each under a `==> KEY <==` line; how many. Read from the object store
    alone: the Pods, and the cluster's copy of their logs, may be long gone.

    Raises:
        InvalidId: not a dispatch id.
        ConfigError: no object store is configured.
        ObjectStoreUnavailable: the store cannot be read.
    """
    check_dispatch_id(dispatch_id)
    store = artifacts.for_settings(settings)
    if store is None:
        raise ConfigError("no object store is configured (K8S_DISPATCH_OBJECT_STORE_ENDPOINT), so no log is archived")
    found = logs.archived_logs(store, dispatch_id)
    for archived in found:
        out.write(f"==> {archived.key} (attempt {archived.attempt}, pod {archived.pod}) <==\n".encode())
        last = b"\n"
        for chunk in logs.read_log(store, archived):
            out.write(chunk)
            last = chunk[-1:] or last
        if last != b"\n":
            out.write(b"\n")
    return len(found)
