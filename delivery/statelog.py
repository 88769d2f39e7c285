"""One structured log line per dispatch state change, and its count in the metrics.

Called right after the change committed (schedule, Job created, completed, failed,
cancelled), from `tasks.jobs`, `delivery` and `recovery.sweep`. The line is
logfmt, so `grep dispatch_id=...` or any log pipeline finds every step of a dispatch:

    state-change state=COMPLETED dispatch_id=5f0c... case_id=case-7 tenancy_id=acme capability=demo.sha256

The same fields go into the record's `extra` (`record.k8s_dispatch`) for JSON formatters.
"""

from __future__ import annotations

import logging
from typing import Protocol

from sqlalchemy import event
from sqlalchemy.orm import Session

from k8s_dispatch.delivery.metrics import METRICS

log = logging.getLogger("k8s_dispatch.state")

MARKER = "state-change"  # the first word of every line: what to grep for
_PENDING_KEY = "k8s_dispatch.state_changes"
_HOOKED_KEY = "k8s_dispatch.state_changes_hooked"


class DispatchLike(Protocol):
    """Anything carrying a dispatch's identity: a DispatchRecord, a DispatchRef, a Dispatch row."""

    @property
    def dispatch_id(self) -> str: ...
    @property
    def case_id(self) -> str: ...
    @property
    def tenancy_id(self) -> str: ...
    @property
    def capability(self) -> str: ...


def state_changed(
    state: str,
    *,
    dispatch_id: str,
    case_id: str,
    tenancy_id: str,
    capability: str | None = None,
    **detail: object,
) -> None:
    """Log the change (INFO; WARNING for FAILED) and count it. Never raises.

    `detail`: more fields for the line (reason, attempt, job, via...); None values are left out.
    """
    state = str(state)  # a DispatchState's plain value, for the line and the metric
    fields: dict[str, object] = {
        "state": state,
        "dispatch_id": dispatch_id,
        "case_id": case_id,
        "tenancy_id": tenancy_id,
        "capability": capability,
        **detail,
    }
    fields = {k: v for k, v in fields.items() if v is not None}
    level = logging.WARNING if state == "FAILED" else logging.INFO
    log.log(level, "%s %s", MARKER, logfmt(fields), extra={"k8s_dispatch": fields})
    reason = detail.get("reason")
    METRICS.state_changed(state, reason=reason if isinstance(reason, str) else None)


def dispatch_changed(dispatch: DispatchLike, state: str, **detail: object) -> None:
    """`state_changed` with the identity taken from `dispatch`."""
    state_changed(
        state,
        dispatch_id=dispatch.dispatch_id,
        case_id=dispatch.case_id,
        tenancy_id=dispatch.tenancy_id,
        capability=dispatch.capability,
        **detail,
    )


def on_commit(session: Session, state: str, **identity: object) -> None:
    """`state_changed(state, **identity)` once `session`'s transaction commits; dropped on rollback.

    For changes written in a caller's transaction (`tasks.jobs.schedule_in_session`).
    """
    session.info.setdefault(_PENDING_KEY, []).append((state, identity))
    if not session.info.get(_HOOKED_KEY):
        session.info[_HOOKED_KEY] = True
        event.listen(session, "after_commit", _log_pending)
        event.listen(session, "after_rollback", _drop_pending)


def _log_pending(session: Session) -> None:
    for state, identity in session.info.pop(_PENDING_KEY, []):
        state_changed(state, **identity)


def _drop_pending(session: Session) -> None:
    session.info.pop(_PENDING_KEY, None)


def logfmt(fields: dict[str, object]) -> str:
    """`key=value` pairs; values with spaces, quotes, `=` or nothing at all are quoted."""
    return " ".join(f"{key}={_value(value)}" for key, value in fields.items())


def _value(value: object) -> str:
    text = str(value)
    if text and not any(c.isspace() or c in '"=\\' for c in text):
        return text
    escaped = (
        text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
    )
    return f'"{escaped}"'
