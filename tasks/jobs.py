"""The Celery tasks: schedule, create_job(s), poll, complete(_batch), cancel, and a failure's echo
for Flower (dispatch_failed). Thin: ids in, work elsewhere.

Each task hands its ids to `delivery` (create, complete, cancel: the path the recovery sweep uses too) and
lets the error tree drive Celery: `Transient` errors are retried with backoff and jitter,
`Permanent` ones fail at once. Every task is idempotent, which is what makes late acks and
redelivery after a lost worker safe.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from collections.abc import Sequence
from functools import partial
from typing import Any, TypedDict, TypeVar, cast

import redis
from celery import Task
from celery.utils.time import get_exponential_backoff_interval
from kombu.connection import ConnectionPool
from kombu.exceptions import ChannelError, LimitExceeded, OperationalError

from k8s_dispatch import celeryconfig as names
from k8s_dispatch.core.errors import DispatchError, Permanent, Transient
from k8s_dispatch.core.settings import PollMode
from k8s_dispatch.delivery import disruptions, handoff, jobwatch, statelog
from k8s_dispatch.delivery.cancel import CANCELLED_REASON, cancel_dispatch
from k8s_dispatch.delivery.cleanup import SELECTOR_CHUNK, delete_delivered_later, delete_noted
from k8s_dispatch.delivery.complete import complete_job, complete_jobs, job_snapshot
from k8s_dispatch.delivery.crashpoints import Point, crashpoint
from k8s_dispatch.delivery.create import create_job_for, create_jobs_for
from k8s_dispatch.delivery.metrics import METRICS, jobs_past_deadline, poll_lag_s
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.store import scheduling
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import DispatchState, utcnow
from k8s_dispatch.store.secret_inputs import unseal
from k8s_dispatch.tasks import admission, lease, prompt_poll, supersede
from k8s_dispatch.tasks.app import app
from k8s_dispatch.tasks.task_events import DispatchFailed, failure_text
from k8s_dispatch.tasks.worker_runtime import get_runtime
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.job_status import job_state

log = logging.getLogger(__name__)
T = TypeVar("T")


class RetryOptions(TypedDict):
    """The retry options every task passes to `app.task` (typed, so `**RETRY` is checked against
    its parameters)."""

    autoretry_for: tuple[type[BaseException], ...]
    dont_autoretry_for: tuple[type[BaseException], ...]
    throws: tuple[type[Exception], ...]
    retry_backoff: int
    retry_backoff_max: int
    retry_jitter: bool
    max_retries: int


# Retried with exponential backoff (1 s, 2 s, 4 s ... at most 60 s, jittered). After the last
# retry the dispatch is still safe in the database: the recovery sweep picks it up. Every error
# but a Permanent one is retried: an unforeseen one (a bug, an OSError from a library) must not
# end a task whose work is still to do, and Celery logs each retry with its exception.
RETRY: RetryOptions = {
    "autoretry_for": (Exception,),
    "dont_autoretry_for": (Permanent,),
    # Expected ends, logged without a traceback: a Permanent refusal, or a Transient one that
    # outlasted the retries (the database and the cluster still hold the work for the sweep).
    "throws": (DispatchError,),
    "retry_backoff": 1,
    "retry_backoff_max": 60,
    "retry_jitter": True,
    "max_retries": 8,
}
# Finished Jobs per `complete_batch` message: at most HANDOFF_BATCH_MAX (one Pod LIST's selector
# chunk), and no fewer than HANDOFF_BATCH_MIN, so a page's Jobs are shared among the worker's
# threads (latency) without costing a Pod LIST and a bulk delete for every one or two (API load):
# the trade-off is measured by the `api_load` benchmark (docs/benchmarks/).
HANDOFF_BATCH_MAX = SELECTOR_CHUNK
HANDOFF_BATCH_MIN = 5


# --- schedule -----------------------------------------------------------------------------


@app.task(name=names.SCHEDULE_TASK, **RETRY)
def schedule(
    case_id: str,
    tenancy_id: str,
    capability: str,
    input: Any,
    idempotency_key: str,
    dispatch_id: str | None = None,
    priority: int = 0,
    sealed_input: str | None = None,
) -> str:
    """The engine's entry by task call: write the dispatch, then enqueue its Job's creation.

    Until this runs the request is only this message (a broker flush loses it): at-least-once
    only if the engine sends it again with the same idempotency key until the dispatch exists,
    as `tasks.scheduling.send_schedule_until_recorded` does. `sealed_input`: a secret input,
    sealed by the sender (the message never holds it in the clear), scheduled secret."""
    rt = get_runtime()
    secret = sealed_input is not None
    if sealed_input is not None:
        input = json.loads(unseal(sealed_input, rt.settings.input_key))
    with transaction(rt.sessions) as session:
        result = scheduling.schedule(
            session,
            case_id=case_id,
            tenancy_id=tenancy_id,
            capability=capability,
            input=input,
            idempotency_key=idempotency_key,
            router=rt.resolver,
            max_input_bytes=rt.settings.max_input_bytes,
            dispatch_id=dispatch_id,
            priority=priority,
            secret=secret,
            input_key=rt.settings.input_key,
            max_stored_input_bytes=rt.settings.max_stored_input_bytes,
        )
    if result.created:
        statelog.state_changed(
            result.state,
            dispatch_id=result.dispatch_id,
            case_id=case_id,
            tenancy_id=tenancy_id,
            capability=capability,
        )
    crashpoint(Point.AFTER_SCHEDULE_COMMIT)
    if result.state is DispatchState.SCHEDULED:
        create_job.delay(result.dispatch_id)
    elif result.state is DispatchState.QUEUED:
        admit.delay()
    return result.dispatch_id


@app.task(name=names.ADMIT_TASK, **RETRY, send_events=False)
def admit(periodic: bool = False) -> int:
    """Admit queued dispatches to the slots free under the limits and send their creates (how
    many). Sent after a queued schedule commits (coalesced with the passes running elsewhere) and
    by beat every poll interval (`periodic`: a pass whatever Redis says)."""
    rt = get_runtime()
    if periodic:
        return len(admission.run_pass(rt, app))
    return admission.run_coalesced(rt, app)


# --- create, complete, cancel ---------------------------------------------------------------


@app.task(name=names.CREATE_JOB_TASK, **RETRY)
def create_job(dispatch_id: str) -> str:
    """One dispatch's Job (the `schedule` task's message, and messages queued before `create_jobs`)."""
    return create_job_for(get_runtime(), dispatch_id).value


@app.task(name=names.CREATE_JOBS_TASK, **RETRY)
def create_jobs(dispatch_ids: list[str]) -> dict[str, int]:
    """A transaction's dispatches (`schedule_in_session`'s message), their Jobs created one after
    the other; a Transient error retries the whole batch (the Jobs made before it are marked,
    and adopted by the retry). How many of each outcome."""
    return dict(Counter(outcome.value for outcome in create_jobs_for(get_runtime(), dispatch_ids).values()))


@app.task(name=names.COMPLETE_TASK, **RETRY)
def complete(namespace: str, job_name: str) -> str:
    """One Job, read fresh (GET): for callers without a snapshot; poll sends `complete_batch`."""
    return complete_job(get_runtime(), namespace, job_name).value


@app.task(bind=True, name=names.COMPLETE_BATCH_TASK, **RETRY)
def complete_batch(
    self: Task[[str, list[dict[str, Any]]], dict[str, int]], namespace: str, jobs: list[dict[str, Any]]
) -> dict[str, int]:
    """Finished Jobs of one namespace as poll's LIST saw them (`complete.job_snapshot`): one
    Pod LIST for them all, no GET per Job, and the bulk delete left to the next cleanup (one for
    every batch of a cleanup interval). A Transient error stops the batch; the Jobs it left are
    retried (with backoff, as RETRY's) in a new message of their own.
    """
    rt = get_runtime()
    done = complete_jobs(rt, namespace, jobs, delete=False)
    if done.released:  # removed by the next cleanup's one bulk delete for every batch since the last
        delete_delivered_later(rt, namespace)
    if done.error is not None:
        countdown = get_exponential_backoff_interval(
            factor=RETRY["retry_backoff"],
            retries=self.request.retries,
            maximum=RETRY["retry_backoff_max"],
            full_jitter=True,
        )
        raise self.retry(args=(namespace, done.unavailable), exc=done.error, countdown=countdown)
    counts: dict[str, int] = {}
    for outcome in done.outcomes:
        counts[outcome.value] = counts.get(outcome.value, 0) + 1
    return counts


@app.task(name=names.CANCEL_TASK, **RETRY)
def cancel(dispatch_id: str, reason: str = CANCELLED_REASON, recorded: bool = False) -> bool:
    """Cancel by task call (the cancel lives only in this message until it runs), or, with
    `recorded`, `cancel_in_session`'s follow-up: the cancel is in the database already, this
    deletes the Job at once and notifies the engine (if lost, the sweep deletes the Job)."""
    return cancel_dispatch(get_runtime(), dispatch_id, reason=reason, recorded=recorded)


@app.task(name=names.DISPATCH_FAILED_TASK, throws=(DispatchFailed,))
def dispatch_failed(dispatch_id: str, reason: str, message: str = "") -> None:
    """A failed dispatch's echo (`tasks.task_events`): fails, so that Flower shows the failure
    as one. Sent after the failure is recorded; it does nothing else.

    Raises:
        DispatchFailed: always (an expected error: logged in one line, never retried).
    """
    raise DispatchFailed(failure_text(dispatch_id, reason, message))


# --- poll -----------------------------------------------------------------------------------


@app.task(name=names.POLL_TASK, send_events=False)
def poll() -> dict[str, int]:
    """List our undelivered Jobs page by page (one LIST per page, no GET per Job); hand the
    finished ones to `complete_batch`, a few messages per page carrying the LIST's snapshots.
    While completions are queued, a Job handed off before is not handed again (its marker is
    renewed instead: `delivery.handoff`).

    A poll that meets an unavailable API or Redis gives up: the next interval polls again. One
    that another poll started shortly before is superseded by it and skips (`tasks.supersede`);
    so is one that finds another still under way (`tasks.lease`): polls never pile up on the
    worker threads.
    """
    rt = get_runtime()
    if not supersede.go_ahead(
        rt.redis, rt.settings.key_prefix, names.POLL_TASK, window_s=supersede.window_s(rt.settings.poll_interval_s)
    ):
        return {"seen": 0, "handed_off": 0, "superseded": 1}
    running = lease.take(
        rt.redis, rt.settings.key_prefix, names.POLL_TASK, ttl_s=lease.ttl_s(rt.settings.poll_interval_s)
    )
    if running is None:
        return {"seen": 0, "handed_off": 0, "running": 1}
    try:
        return _poll(rt, running)
    finally:
        running.release()


def _poll(rt: Runtime, running: lease.Lease) -> dict[str, int]:
    """`poll`'s work, under its lease (renewed as it goes)."""
    ttl_s = handoff.ttl_s(rt.settings.poll_interval_s)
    seen = handed = waiting = overdue = 0
    lag_s = 0.0
    # A backlog of completions: the markers of Jobs still waiting in it are renewed, not handed again.
    renew = _queued(names.COMPLETE_QUEUE) > 0
    selector = job_labels.undelivered_selector(rt.settings.effective_deployment)  # never another deployment's
    if rt.settings.poll_mode is PollMode.WATCH:
        return _poll_watch(rt, ttl_s=ttl_s, renew=renew, running=running)
    try:
        for namespace in rt.namespaces():
            running.renew()
            for page in rt.kube.iter_jobs(namespace, label_selector=selector, page_size=rt.settings.poll_page_size):
                seen += len(page)
                finished = [job for job in page if job_state(job).terminal]
                waiting, lag_s = waiting + len(finished), max(lag_s, poll_lag_s(finished, now=utcnow()))
                overdue += jobs_past_deadline([job for job in page if not job_state(job).terminal], now=utcnow())
                handed += _hand_off(
                    rt.redis, rt.settings.key_prefix, namespace, finished,
                    ttl_s=ttl_s, workers=rt.settings.worker_concurrency, renew=renew,
                )  # fmt: skip
    except (Transient, redis.RedisError) as e:
        log.warning("poll stopped early (%s); the next one continues", e)
    else:
        METRICS.poll_done(finished=waiting, lag_s=lag_s, past_deadline=overdue)
    return {"seen": seen, "handed_off": handed}


@app.task(name=names.CLEANUP_TASK, send_events=False)
def cleanup() -> dict[str, int]:
    """Poll's follow-ups that need not be as prompt as a completion, every CLEANUP_POLLS polls (beat):
    per namespace ONE LIST of our failed Pods (disruptions recorded, their Pods freed, a dispatch
    past its maxDisruptions failed) and the bulk delete of the Jobs released since the last one.
    Apart from poll, so that neither request is paid per poll (with long Jobs few finish per poll)
    nor adds to a poll's duration. Superseded like poll; an unavailable API or Redis stops it, and
    the next one goes on."""
    rt = get_runtime()
    window = supersede.window_s(names.CLEANUP_POLLS * rt.settings.poll_interval_s)
    if not supersede.go_ahead(rt.redis, rt.settings.key_prefix, names.CLEANUP_TASK, window_s=window):
        return {"superseded": 1}
    failed = deleted = 0
    try:
        for namespace in rt.namespaces():
            failed += len(disruptions.scan(rt, namespace))
            deleted += delete_noted(rt, namespace)
    except (Transient, redis.RedisError) as e:
        log.warning("cleanup stopped early (%s); the next one continues", e)
    return {"disrupted_failed": failed, "deleted": deleted}


def _poll_watch(
    rt: Runtime, *, ttl_s: float, renew: bool, running: lease.Lease, namespaces: Sequence[str] | None = None
) -> dict[str, int]:
    """Poll by resuming the namespaces' watches side by side (`delivery.jobwatch`): the events
    since the last poll, not every Job; the finished Jobs not yet delivered are handed off as a
    LIST poll would. A namespace whose API or Redis failed is polled again by the next poll, from
    the version stored; the others' positions stand. `namespaces`: these only (a prompt poll's),
    not every one; the gauges are then left as the last full poll set them. The streams kept
    ring this process's doorbell (`tasks.prompt_poll`)."""
    settings = rt.settings
    try:
        polled = jobwatch.poll_namespaces(
            rt.kube, rt.redis, prefix=settings.key_prefix, deployment=settings.effective_deployment,
            namespaces=rt.namespaces() if namespaces is None else namespaces, page_size=settings.poll_page_size,
            poll_interval_s=settings.poll_interval_s, hold_s=settings.poll_watch_hold_s, waiting=running.renew,
            hand_off=partial(_hand_off, rt.redis, settings.key_prefix, ttl_s=ttl_s,
                             workers=settings.worker_concurrency, renew=renew),
            ring=_doorbell(settings.poll_interval_s).ring if settings.poll_prompt else None,
        )  # fmt: skip
    except redis.RedisError as e:
        log.warning("poll stopped (%s); the next one resumes from the versions stored", e)
        return {"seen": 0, "handed_off": 0, "listed": 0}
    done = polled.done.values()
    if polled.failed:
        namespace, error = next(iter(sorted(polled.failed.items())))
        log.warning("poll of %d namespaces failed (%s: %s); the next one resumes from the version stored",
                    len(polled.failed), namespace, error)  # fmt: skip
    elif namespaces is None:
        # Running Jobs are not read by a watch poll: the sweep sets the past-deadline gauge from
        # the database instead (`recovery.deadlines`).
        METRICS.finished_jobs_waiting.set(sum(len(d.finished) for d in done))
        METRICS.poll_lag.set(max((poll_lag_s(d.finished, now=utcnow()) for d in done), default=0.0))
        METRICS.last_poll.set(utcnow().timestamp())
    return {
        "seen": sum(d.seen for d in done),
        "handed_off": sum(d.handed_off for d in done),
        "listed": sum(d.listed for d in done),
    }


_doorbell_lock = threading.Lock()
_doorbells: dict[float, prompt_poll.Doorbell] = {}


def _doorbell(poll_interval_s: float) -> prompt_poll.Doorbell:
    """This process's doorbell (made on first use: after a fork)."""
    with _doorbell_lock:
        if poll_interval_s not in _doorbells:
            _doorbells[poll_interval_s] = prompt_poll.Doorbell(
                poll_at_once, gap_s=prompt_poll.gap_s(poll_interval_s), give_up_s=poll_interval_s
            )
        return _doorbells[poll_interval_s]


def poll_at_once(namespaces: Sequence[str]) -> bool:
    """A prompt poll of `namespaces` (`tasks.prompt_poll`), by this process, under poll's lease;
    False (nothing done) while another poll holds it. Like beat's, it renews the markers of the
    Jobs already handed off while completions are queued: prompt polls that ring all along keep
    beat's from the lease, and a marker left to expire behind a backlog sends its Job again."""
    rt = get_runtime()
    settings = rt.settings
    running = lease.take(
        rt.redis, settings.key_prefix, names.POLL_TASK, ttl_s=lease.ttl_s(settings.poll_interval_s), quiet=True
    )
    if running is None:
        return False
    try:
        renew = _queued(names.COMPLETE_QUEUE) > 0
        done = _poll_watch(
            rt, ttl_s=handoff.ttl_s(settings.poll_interval_s), renew=renew, running=running, namespaces=namespaces
        )
    finally:
        running.release()
    log.debug("prompt poll of %s: %s", ", ".join(namespaces), done)
    return True


def _hand_off(
    client: redis.Redis,
    prefix: str,
    namespace: str,
    jobs: list[dict[str, Any]],
    *,
    ttl_s: float,
    workers: int,
    renew: bool = False,
) -> int:
    """Send `complete_batch` for the Jobs not handed off within `ttl_s` (one Redis round trip
    per page, a marker per Job: `delivery.handoff`, which the sweep reads to leave these Jobs
    to their queued message; with `renew`, the markers of those handed off before are renewed);
    the number of Jobs handed off."""
    marked = handoff.mark(client, prefix, namespace, jobs, ttl_s, renew=renew)
    fresh = [job_snapshot(job) for job, is_new in zip(jobs, marked, strict=True) if is_new]
    for batch in batches(fresh, workers=workers):
        complete_batch.delay(namespace, batch)
    return len(fresh)


def _queued(queue: str) -> int:
    """How many messages wait in `queue` on the broker (one round trip); 0 if it cannot say (an
    unreachable broker): poll then renews nothing. Not `passive=True`: kombu's Redis transport
    checks a queue's existence with an EXISTS it does not prefix with `global_keyprefix`, so a
    passive declare never finds ours; declaring our own declared queue again changes nothing."""
    # celery-types declares `app.pool` a ProducerPool; Celery's is kombu's ConnectionPool
    # (`pools.connections[...]`), whose resources kombu's stubs leave untyped.
    pool = cast(ConnectionPool, app.pool)
    try:
        with pool.acquire(block=True, timeout=5) as connection:  # the producers' pooled connections
            count: int = connection.default_channel.queue_declare(queue=queue).message_count
            return count
    except (ChannelError, LimitExceeded, OperationalError, redis.RedisError, OSError) as e:
        log.warning("could not read the length of %s (%s); renewing no hand-off", queue, e)
        return 0


def batches(
    items: list[T], *, workers: int, least: int = HANDOFF_BATCH_MIN, most: int = HANDOFF_BATCH_MAX
) -> list[list[T]]:
    """`items` in order, cut into as many batches as `workers` but none under `least` items
    (one batch if there are fewer), more only where a batch would pass `most`; their sizes as
    even as can be (pure)."""
    if not items:
        return []
    count = max(min(workers, len(items) // least), -(-len(items) // most), 1)
    base, extra = divmod(len(items), count)
    cut, start = [], 0
    for i in range(count):
        end = start + base + (1 if i < extra else 0)
        cut.append(items[start:end])
        start = end
    return cut
