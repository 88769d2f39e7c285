"""The Celery tasks: schedule, create_job, poll, complete, cancel. Thin: ids in, work elsewhere.

Each task hands its ids to `recovery.delivery` (the path the recovery sweep uses too) and
lets the error tree drive Celery: `Transient` errors are retried with backoff and jitter,
`Permanent` ones fail at once. Every task is idempotent, which is what makes late acks and
redelivery after a lost worker safe.
"""

from __future__ import annotations

import logging
from typing import Any

import redis

import celeryconfig as names
from engine import store
from engine.db import transaction
from engine.errors import Transient
from engine.models import DispatchState, utcnow
from recovery import delivery, statelog
from recovery.crashpoints import Point, crashpoint
from recovery.metrics import METRICS, poll_lag_s
from tasks.app import app, get_runtime
from workers import labels as job_labels
from workers.job_status import job_state

log = logging.getLogger(__name__)

# Retried with exponential backoff (1 s, 2 s, 4 s ... at most 60 s, jittered). After the last
# retry the dispatch is still safe in the database: the recovery sweep picks it up.
RETRY = dict(autoretry_for=(Transient,), retry_backoff=1, retry_backoff_max=60, retry_jitter=True, max_retries=8)
# A terminal Job handed to `complete` is not handed again for this long, however often poll
# runs; if that completion got lost, the Job is handed again after it.
HANDOFF_MIN_TTL_S = 10.0
HANDOFF_INTERVALS = 5


# --- schedule -----------------------------------------------------------------------------


@app.task(name=names.SCHEDULE_TASK, **RETRY)
def schedule(
    case_id: str,
    tenancy_id: str,
    capability: str,
    input: Any,  # noqa: A002 - the engine's word
    idempotency_key: str,
    dispatch_id: str | None = None,
) -> str:
    """The engine's entry by task call: write the dispatch, then enqueue its Job's creation."""
    rt = get_runtime()
    with transaction(rt.sessions) as session:
        result = store.schedule(
            session,
            case_id=case_id,
            tenancy_id=tenancy_id,
            capability=capability,
            input=input,
            idempotency_key=idempotency_key,
            router=rt.resolver,
            max_input_bytes=rt.settings.max_input_bytes,
            dispatch_id=dispatch_id,
        )
    if result.created:
        statelog.state_changed(
            DispatchState.SCHEDULED, dispatch_id=result.dispatch_id, case_id=case_id, tenancy_id=tenancy_id, capability=capability
        )
    crashpoint(Point.AFTER_SCHEDULE_COMMIT)
    if result.state is DispatchState.SCHEDULED:
        create_job.delay(result.dispatch_id)
    return result.dispatch_id


# --- create, complete, cancel ---------------------------------------------------------------


@app.task(name=names.CREATE_JOB_TASK, **RETRY)
def create_job(dispatch_id: str) -> str:
    return delivery.create_job_for(get_runtime(), dispatch_id).value


@app.task(name=names.COMPLETE_TASK, **RETRY)
def complete(namespace: str, job_name: str) -> str:
    return delivery.complete_job(get_runtime(), namespace, job_name).value


@app.task(name=names.CANCEL_TASK, **RETRY)
def cancel(dispatch_id: str, reason: str = delivery.CANCELLED_REASON) -> bool:
    return delivery.cancel_dispatch(get_runtime(), dispatch_id, reason=reason)


# --- poll -----------------------------------------------------------------------------------


@app.task(name=names.POLL_TASK)
def poll() -> dict[str, int]:
    """List our Jobs page by page (one LIST per page, no GET per Job); hand finished ones to `complete`.

    A poll that meets an unavailable API or Redis gives up: the next interval polls again.
    """
    rt = get_runtime()
    ttl_s = max(HANDOFF_MIN_TTL_S, HANDOFF_INTERVALS * rt.settings.poll_interval_s)
    seen = handed = waiting = 0
    lag_s = 0.0
    try:
        for namespace in rt.namespaces():
            for page in rt.kube.iter_jobs(
                namespace, label_selector=job_labels.selector(), page_size=rt.settings.poll_page_size
            ):
                seen += len(page)
                finished = [job for job in page if job_state(job).terminal]
                waiting, lag_s = waiting + len(finished), max(lag_s, poll_lag_s(finished, now=utcnow()))
                handed += _hand_off(rt.redis, rt.settings.key_prefix, namespace, finished, ttl_s=ttl_s)
    except (Transient, redis.RedisError) as e:
        log.warning("poll stopped early (%s); the next one continues", e)
    else:
        METRICS.poll_done(finished=waiting, lag_s=lag_s)
    return {"seen": seen, "handed_off": handed}


def _hand_off(client: redis.Redis, prefix: str, namespace: str, jobs: list[dict[str, Any]], *, ttl_s: float) -> int:
    """Send `complete` for each Job not handed off within `ttl_s` (one Redis round trip per page)."""
    if not jobs:
        return 0
    keys = []
    for job in jobs:
        metadata = job.get("metadata") or {}
        # The uid too: a Job re-created under the same name is a new hand-off.
        keys.append(f"{prefix}:handoff:{namespace}/{metadata.get('name')}/{metadata.get('uid')}")
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.set(key, 1, nx=True, px=int(ttl_s * 1000))
    fresh = pipe.execute()
    handed = 0
    for job, is_new in zip(jobs, fresh):
        if is_new:
            complete.delay(namespace, job["metadata"]["name"])
            handed += 1
    return handed
