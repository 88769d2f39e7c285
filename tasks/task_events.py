"""What Flower (and anything reading Celery's events) sees of our tasks: the work, findable by
dispatch id, with failed dispatches as failed tasks.

- Housekeeping (`HOUSEKEEPING_TASKS`: poll, admit, cleanup, the sweeps) sends no event: a
  task-sent is dropped from its message here, and the tasks themselves set `send_events=False`.
  Several run every poll interval; listed, they bury the work (72% of Flower's rows while idle).
- A task's shown arguments name the dispatches it carries. `complete_batch` carries Job
  snapshots, which Celery's own repr cuts to `{...}`; here they are shown as their dispatch ids,
  so that Flower's search for an id finds the task that recorded it.
- A dispatch recorded WORKER_FAILED is also sent as a `dispatch_failed` task that raises
  `DispatchFailed`: the batch that recorded the failure did its job and succeeds, while Flower's
  Failed filter and its workers' counters now count the dispatch. The echo carries no work: the
  event log is the record, and a lost echo loses nothing but the sight of it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from celery import Celery
from celery.app.amqp import AMQP
from kombu.exceptions import OperationalError

from k8s_dispatch.celeryconfig import (
    COMPLETE_BATCH_TASK,
    COMPLETE_QUEUE,
    CREATE_JOBS_TASK,
    DISPATCH_FAILED_TASK,
    HOUSEKEEPING_TASKS,
)
from k8s_dispatch.workers import labels as job_labels

if TYPE_CHECKING:
    from k8s_dispatch.delivery.runtime import Failed

log = logging.getLogger(__name__)

SHOWN_IDS = 200  # dispatch ids shown per message at most (they travel in its headers and events)
MESSAGE_CHARS = 500  # of a failure's message, its first line: the whole is in the event log


class DispatchFailed(Exception):
    """A dispatch ended WORKER_FAILED: what its `dispatch_failed` echo raises."""


def shown_args(name: str, args: Sequence[Any] | None) -> str | None:
    """The arguments to show for a message of task `name` (pure), or None for Celery's own repr:
    `create_jobs`' ids whole (up to SHOWN_IDS), `complete_batch`'s namespace and its Jobs'
    dispatch ids in place of their snapshots."""
    args = list(args or ())
    if name == CREATE_JOBS_TASK and len(args) == 1 and isinstance(args[0], list):
        return f"({_ids([str(i) for i in args[0]])},)"
    if name == COMPLETE_BATCH_TASK and len(args) == 2 and isinstance(args[1], list):
        ids = [_dispatch_id(job) for job in args[1]]
        return f"({args[0]!r}, {_ids(ids)})"
    return None


def _dispatch_id(job: object) -> str:
    """The id a snapshot names, whole (a long id's label is a hash; its annotation holds it)."""
    metadata = job.get("metadata") if isinstance(job, Mapping) else None
    if not isinstance(metadata, Mapping):
        return "?"
    named = job_labels.named_dispatch_ids(metadata.get("labels"), metadata.get("annotations"))
    return named[-1] if named else "?"


def _ids(ids: Sequence[str]) -> str:
    shown = ", ".join(ids[:SHOWN_IDS])
    more = f", ... {len(ids) - SHOWN_IDS} more" if len(ids) > SHOWN_IDS else ""
    return f"[{shown}{more}]"


class Messages(AMQP):
    """Celery's message builder (the app's `amqp` class), with `shown_args` as the arguments'
    repr and no task-sent event for housekeeping."""

    def as_task_v2(
        self, task_id: str, name: str, args: Any = None, kwargs: Any = None, *rest: Any, **options: Any
    ) -> Any:
        if options.get("argsrepr") is None:
            options["argsrepr"] = shown_args(name, args if isinstance(args, (list, tuple)) else None)
        message = super().as_task_v2(task_id, name, args, kwargs, *rest, **options)
        return message._replace(sent_event=None) if name in HOUSEKEEPING_TASKS else message


def failure_echo(sender: Celery) -> Failed:
    """`Runtime.on_failed`: sends a failed dispatch's `dispatch_failed` echo through `sender`. A
    broker that refuses it is logged, never raised: the failure is recorded already."""

    def echo(dispatch_id: str, reason: str, message: str) -> None:
        first = message.strip().splitlines()[0][:MESSAGE_CHARS] if message.strip() else ""
        try:
            sender.send_task(
                DISPATCH_FAILED_TASK,
                kwargs={"dispatch_id": dispatch_id, "reason": reason, "message": first},
                queue=COMPLETE_QUEUE,
            )
        except OperationalError as e:
            log.info("dispatch %s failed (%s); its echo for Flower was not sent: %s", dispatch_id, reason, e)

    return echo


def failure_text(dispatch_id: str, reason: str, message: str) -> str:
    """What a `dispatch_failed` echo raises (pure)."""
    return f"dispatch {dispatch_id} failed: {reason}" + (f": {message}" if message else "")
