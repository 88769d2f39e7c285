"""Cancel a dispatch: its WORKER_CANCELLED recorded (`delivery.terminal`), the engine told, its Job
stopped and removed. A completion racing the cancel leaves exactly one terminal event."""

from __future__ import annotations

from k8s_dispatch.core.errors import UnknownDispatch
from k8s_dispatch.core.ids import check_dispatch_id
from k8s_dispatch.delivery import terminal
from k8s_dispatch.delivery.cleanup import cleanup_job
from k8s_dispatch.delivery.reconstruct import DispatchRecord
from k8s_dispatch.delivery.records import job_location
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.store import dispatches
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import DispatchState, EventType

CANCELLED_REASON = "Cancelled"


def cancel_dispatch(rt: Runtime, dispatch_id: str, *, reason: str = CANCELLED_REASON, recorded: bool = False) -> bool:
    """Record WORKER_CANCELLED and remove the Job; False if the dispatch had ended already.

    A completion racing the cancel leaves exactly one terminal event: whichever commits first.
    `recorded`: the cancel was written already (`tasks.scheduling.cancel_in_session`, whose
    message this is): only notify the engine, unless it was, and remove the Job.

    Raises:
        InvalidId: `dispatch_id` is not a UUID.
        UnknownDispatch: no such dispatch.
    """
    check_dispatch_id(dispatch_id)
    with transaction(rt.sessions) as session:
        row = dispatches.get_dispatch(session, dispatch_id)
        if row is None:
            raise UnknownDispatch(f"dispatch {dispatch_id} does not exist")
        record = DispatchRecord.from_row(row)
        event = dispatches.TerminalEvent(dispatch_id, EventType.WORKER_CANCELLED, {"reason": reason})
        won = not recorded and bool(terminal.record(session, [event]))
    if won:
        terminal.announce(rt, [(record, event)])
    elif recorded and record.state is DispatchState.CANCELLED and not record.notified:
        terminal.notify_engine(rt, dispatch_id)
    cleanup_job(rt, *job_location(rt, record))
    return won
