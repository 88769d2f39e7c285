"""Retention and orphans: the objects under our prefix that must go (run by a beat task).

Inputs too large for a Job's env (`PREFIX/DISPATCH_ID/input`) and a map's packed item inputs
(`PREFIX/DISPATCH_ID/items/ROOT`, one per set of items a Job of it ran) are objects of their
dispatch like its results: kept while it runs, orphans once it has ended.

Archived container logs (`PREFIX/DISPATCH_ID/ATTEMPT/logs/POD`) are the record of what ran, of
every attempt, won or lost: kept like a recorded result, so deleted `retention_days` after their
dispatch ended (never, with no retention), and by their own age only when no dispatch owns them.

An object is its dispatch's *recorded result* when the dispatch's terminal event is a
WORKER_COMPLETED whose output references its key. Every other object is an orphan (a losing or
superseded attempt, a failed or cancelled dispatch, an upload delivery refused), deleted once
its dispatch has ended and `orphan_grace_s` has passed; one with no dispatch row at all (or a
key not of our layout) once it is that old itself. A running dispatch's objects are never
touched: its attempt may still be uploading or about to be recorded. Recorded results older
than `retention_days` (counted from their terminal event) are deleted too.

Times are compared on one clock each: terminal events on the database's, objects on the
store's (against the database's now: a grace of minutes or more absorbs the difference).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.orm import Session

from k8s_dispatch.artifacts import keys
from k8s_dispatch.artifacts.errors import InvalidResultReference
from k8s_dispatch.artifacts.reference import parse_reference
from k8s_dispatch.artifacts.service import Artifacts
from k8s_dispatch.artifacts.store import StoredObject
from k8s_dispatch.store.db import database_now
from k8s_dispatch.store.models import TERMINAL_EVENT_TYPES, CaseEvent, Dispatch, EventType

LOOKUP_CHUNK = 500  # dispatch ids per query


@dataclass
class CleanupReport:
    listed: int = 0
    kept: int = 0
    orphans_deleted: int = 0
    expired_deleted: int = 0
    orphans_waiting: int = 0  # orphans still within their grace
    deleted_keys: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, int]:
        return {
            "listed": self.listed,
            "kept": self.kept,
            "orphans_deleted": self.orphans_deleted,
            "expired_deleted": self.expired_deleted,
            "orphans_waiting": self.orphans_waiting,
        }


@dataclass(frozen=True)
class _Ended:
    at: datetime  # the terminal event's time (the database's clock)
    recorded_key: str | None  # the key its output references, if it completed with one


def clean(artifacts: Artifacts, sessions: Callable[[], Session], *, now: datetime | None = None) -> CleanupReport:
    """Delete the orphans and expired results under `artifacts.prefix`, one page of listing at
    a time; `now` defaults to the database's clock.

    Raises:
        ObjectStoreUnavailable: the store cannot be listed or an object deleted (the next run
            goes on; a deletion is idempotent).
    """
    report = CleanupReport()
    with sessions() as session:
        if now is None:
            now = _aware(database_now(session))
        grace = timedelta(seconds=artifacts.orphan_grace_s)
        retention = timedelta(days=artifacts.retention_days) if artifacts.retention_days else None
        page: list[StoredObject] = []
        for item in artifacts.store.list(artifacts.prefix + "/"):
            page.append(item)
            if len(page) >= LOOKUP_CHUNK:
                _settle(artifacts, session, page, now=now, grace=grace, retention=retention, report=report)
                page = []
        if page:
            _settle(artifacts, session, page, now=now, grace=grace, retention=retention, report=report)
    return report


def _settle(
    artifacts: Artifacts,
    session: Session,
    page: list[StoredObject],
    *,
    now: datetime,
    grace: timedelta,
    retention: timedelta | None,
    report: CleanupReport,
) -> None:
    parsed = {item.key: keys.dispatch_of(artifacts.prefix, item.key) for item in page}
    ids = {p for p in parsed.values() if p is not None}
    known, ended = _lookup(session, ids)
    for item in page:
        report.listed += 1
        owner = parsed[item.key]
        if owner is None or owner not in known:  # not ours to match: by its own age
            orphan_since: datetime | None = _aware(item.modified)
            expired = False
        else:
            # A stored input is needed while its dispatch runs (any attempt may read it) and never
            # recorded: it goes with the dispatch's other objects once the dispatch has ended.
            end = ended.get(owner)
            if end is None:  # still running: an attempt may be uploading now
                report.kept += 1
                continue
            if end.recorded_key == item.key or keys.parse_log_key(artifacts.prefix, item.key) is not None:
                expired = retention is not None and end.at + retention <= now
                orphan_since = None
            else:
                orphan_since, expired = end.at, False
        if expired:
            artifacts.store.delete(item.key)
            report.expired_deleted += 1
            report.deleted_keys.append(item.key)
        elif orphan_since is None:
            report.kept += 1
        elif orphan_since + grace <= now:
            artifacts.store.delete(item.key)
            report.orphans_deleted += 1
            report.deleted_keys.append(item.key)
        else:
            report.orphans_waiting += 1


def _lookup(session: Session, ids: Iterable[str]) -> tuple[set[str], dict[str, _Ended]]:
    """The dispatch ids that have a row, and the ended ones' terminal event."""
    wanted = sorted(ids)
    known: set[str] = set()
    ended: dict[str, _Ended] = {}
    for start in range(0, len(wanted), LOOKUP_CHUNK):
        chunk = wanted[start : start + LOOKUP_CHUNK]
        known.update(session.scalars(sa.select(Dispatch.dispatch_id).where(Dispatch.dispatch_id.in_(chunk))))
        rows = session.execute(
            sa.select(CaseEvent.dispatch_id, CaseEvent.type, CaseEvent.payload, CaseEvent.created_at).where(
                CaseEvent.dispatch_id.in_(chunk), CaseEvent.type.in_([t.value for t in TERMINAL_EVENT_TYPES])
            )
        )
        for dispatch_id, kind, payload, at in rows:
            recorded = None
            if kind == EventType.WORKER_COMPLETED.value and isinstance(payload, dict):
                try:
                    recorded = parse_reference(payload.get("output")).key
                except InvalidResultReference:
                    recorded = None  # a small result: none of its objects is recorded
            ended[str(dispatch_id)] = _Ended(at=_aware(at), recorded_key=recorded)
    return known, ended


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
