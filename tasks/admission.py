"""Admission under Celery: run a pass (`store.admission`) and make the admitted dispatches' Jobs
in the same worker thread (a `create_jobs` message only for what the API refused for now); when
to run one.

Passes run when a dispatch is queued (the `admit` task, sent after the schedule commits), when
dispatches end or their Jobs stop (inline, in the worker that recorded it: `Runtime.on_ended`), and every
poll interval from beat (the net under lost messages and crashed workers; also what fills the
slots a map frees as its last items end, which trigger no pass of their own). The triggered ones
are coalesced through Redis (a burst of queued schedules runs a few passes, not one each);
beat's runs regardless. Correctness never rests on Redis: the database's admission turn makes
any number of passes safe, and a pass that was skipped is covered by the next one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import redis
from celery import Celery
from kombu.exceptions import OperationalError

from k8s_dispatch import celeryconfig as names
from k8s_dispatch.core.errors import DispatchError
from k8s_dispatch.delivery import statelog
from k8s_dispatch.delivery.crashpoints import Point, crashpoint
from k8s_dispatch.delivery.create import create_jobs_for
from k8s_dispatch.delivery.metrics import METRICS
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.recovery import sweep
from k8s_dispatch.store import admission
from k8s_dispatch.store.db import database_now, transaction
from k8s_dispatch.store.models import DispatchState
from k8s_dispatch.tasks.scheduling import CREATE_BATCH

log = logging.getLogger(__name__)

# A pass holds the "running" key this long at most: a holder that dies stops coalescing for no
# longer than this (beat's passes go on regardless).
RUNNING_LEASE_MS = 10_000


def run_pass(rt: Runtime, sender: Celery) -> list[admission.Admitted]:
    """One admission pass, committed, then the admitted dispatches' Jobs made here
    (`create_admitted`). A crash before they are made leaves them SCHEDULED for the sweep, their
    slots held.

    Raises:
        Transient: the database is unavailable (nothing admitted).
    """
    with transaction(rt.sessions) as session:
        admitted = admission.admit(session, rt.resolver.limits, now=database_now(session))
    if not admitted:
        return admitted
    crashpoint(Point.AFTER_ADMIT_COMMIT)
    for a in admitted:
        METRICS.admitted(a.tenancy_id, waited_s=a.waited_s)
        statelog.state_changed(
            DispatchState.SCHEDULED, dispatch_id=a.dispatch_id, case_id=a.case_id, tenancy_id=a.tenancy_id,
            capability=a.capability, via="admission", waited_s=round(a.waited_s, 3), parallelism=a.parallelism,
        )  # fmt: skip
    create_admitted(rt, sender, [a.dispatch_id for a in admitted])
    return admitted


def create_admitted(rt: Runtime, sender: Celery, dispatch_ids: Sequence[str]) -> None:
    """Make the Jobs of dispatches just admitted, CREATE_BATCH at a time, in this thread.

    Why not a `create_jobs` message: a slot is held from admission, and a message waits its turn
    behind everything queued on the jobs queue (an engine's schedules, its re-sent ones) for a
    worker thread, which overlapping sweeps and slow passes may all hold under load: every slot
    admission fills then stays held by a dispatch with no Job until the sweep makes it, and
    admission admits nothing meanwhile. A batch the API refuses for now (a Transient: 429, 5xx, a full quota) goes to
    `create_jobs`, retried with backoff, as does the rest after it; a message that cannot be sent
    leaves them SCHEDULED for the sweep. Never raises a DispatchError."""
    ids = list(dispatch_ids)
    for start in range(0, len(ids), CREATE_BATCH):
        batch = ids[start : start + CREATE_BATCH]
        try:
            create_jobs_for(rt, batch)
        except DispatchError as e:  # a Transient, or a typed refusal of the batch: the task decides again
            log.info(
                "%d admitted dispatches: their jobs cannot be made now (%s); create_jobs retries", len(ids) - start, e
            )
            _send_creates(sender, ids[start:])
            return


def _send_creates(sender: Celery, dispatch_ids: Sequence[str]) -> None:
    ids = list(dispatch_ids)
    for start in range(0, len(ids), CREATE_BATCH):
        batch = ids[start : start + CREATE_BATCH]
        try:
            sender.send_task(names.CREATE_JOBS_TASK, args=[batch], queue=names.JOBS_QUEUE)
        except OperationalError as e:
            log.warning(
                "%d dispatches admitted but create_jobs was not sent (%s); the sweep creates them", len(batch), e
            )


def run_coalesced(rt: Runtime, sender: Celery) -> int:
    """Run passes until no request for one is left, unless another process is running them (it
    sees this request); the number of dispatches admitted here. Redis unreachable: one pass."""
    wanted, running = _keys(rt.settings.key_prefix)
    client = rt.redis
    admitted = 0
    try:
        client.set(wanted, 1)
        while client.set(running, 1, nx=True, px=RUNNING_LEASE_MS):
            try:
                while client.getdel(wanted):
                    admitted += len(run_pass(rt, sender))
            finally:
                client.delete(running)
            if not client.exists(wanted):  # a request made while we let go is ours to serve
                return admitted
        return admitted
    except redis.RedisError as e:
        log.warning("admission: cannot coalesce passes (%s); running one", e)
        return admitted + len(run_pass(rt, sender))


def on_ended(rt: Runtime, sender: Celery, dispatch_ids: Sequence[str]) -> None:
    """`Runtime.on_ended`: dispatches ended, so run admission (if limits are configured). A slot
    frees once its Job runs no more: a completion's at once; a failure's or a cancel's once its
    Job is seen finished or gone, recorded here first (`sweep.mark_stopped`): a Job still
    running is deleted now (the cancel's own clean-up that follows finds it gone), and one that
    cannot be is left to the sweep, its slot held. Never raises: the end is recorded, and the
    sweep and beat's next pass follow."""
    if not rt.resolver.limits:
        return
    try:
        sweep.mark_stopped(rt, dispatch_ids, stop=True)
    except DispatchError as e:
        log.info("checking the jobs of %d ended dispatches failed (%s); the sweep does", len(dispatch_ids), e)
    try:
        run_coalesced(rt, sender)
    except DispatchError as e:
        log.warning("admission after %d ended dispatches failed (%s); beat's next pass admits", len(dispatch_ids), e)


def count_tenancies(rt: Runtime) -> None:
    """Set the per-tenancy running and queued gauges (the sweep calls it, where limits exist):
    one grouped read of the open dispatches. Never raises."""
    if not rt.resolver.limits:
        return
    try:
        with transaction(rt.sessions) as session:
            rows = admission.summary(session)
    except DispatchError as e:
        log.warning("counting the tenancies' slots failed (%s)", e)
        return
    METRICS.tenancies_counted(admission.by_tenancy(rows))


def _keys(prefix: str) -> tuple[str, str]:
    return f"{prefix}:admission:wanted", f"{prefix}:admission:running"
