"""Celery settings for every k8s-dispatch process (worker, beat, Flower), all from K8S_DISPATCH_*.

Read by `tasks/app.py` (`config_from_object("k8s_dispatch.celeryconfig")`). What makes delivery safe lives
here: late acks and re-queue on a lost worker (every task is idempotent), a visibility timeout,
one prefetched message per thread, the named queues and routes, the beat schedule and events
for Flower. `config(settings)` builds the same mapping for any settings (a producer in another
process, the tests).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from kombu import Queue

from k8s_dispatch.core.settings import Settings, get_settings

# --- queues and task names ---------------------------------------------------------------
JOBS_QUEUE = "k8s-dispatch.jobs"  # schedule, create_job(s), cancel
COMPLETE_QUEUE = "k8s-dispatch.complete"  # complete(_batch): apart, so a burst of creates cannot delay results
SWEEP_QUEUE = "k8s-dispatch.sweep"  # poll and the recovery sweep

SCHEDULE_TASK = "k8s-dispatch.schedule"
CREATE_JOB_TASK = "k8s-dispatch.create_job"
CREATE_JOBS_TASK = "k8s-dispatch.create_jobs"  # a batch of dispatch ids: what schedule_in_session sends
CANCEL_TASK = "k8s-dispatch.cancel"
POLL_TASK = "k8s-dispatch.poll"
COMPLETE_TASK = "k8s-dispatch.complete"  # one Job, read fresh
COMPLETE_BATCH_TASK = "k8s-dispatch.complete_batch"  # poll's hand-off: finished Jobs as listed
SWEEP_TASK = "k8s-dispatch.sweep"  # the recovery sweep (tasks/recovery_tasks.py)
CLEANUP_TASK = "k8s-dispatch.cleanup"  # poll's follow-ups: disruptions, the bulk delete of delivered Jobs
CLEANUP_POLLS = 5  # beat sends cleanup once per this many poll intervals
ADMIT_TASK = "k8s-dispatch.admit"  # an admission pass under the limits (tasks/admission.py)
# Orphans and expired results in the object store (tasks/artifacts_tasks.py), when one is configured.
ARTIFACTS_CLEANUP_TASK = "k8s-dispatch.artifacts_cleanup"
ARTIFACTS_CLEANUP_MIN_INTERVAL_S = 300.0
# A failed dispatch shown as a failed task, for Flower (tasks/task_events.py): no work, an echo.
DISPATCH_FAILED_TASK = "k8s-dispatch.dispatch_failed"
# The periodic and on-demand passes: no events for Flower, their routine log lines at DEBUG.
HOUSEKEEPING_TASKS = frozenset({POLL_TASK, ADMIT_TASK, CLEANUP_TASK, SWEEP_TASK, ARTIFACTS_CLEANUP_TASK})


def artifacts_cleanup_interval_s(settings: Settings) -> float:
    """A LIST of the whole prefix per run: every sweep interval, but no more often than 5 minutes."""
    return max(settings.sweep_interval_s, ARTIFACTS_CLEANUP_MIN_INTERVAL_S)


def config(settings: Settings) -> dict[str, Any]:
    """The Celery settings for `settings`."""
    return {
        # --- broker ------------------------------------------------------------------
        "broker_url": settings.effective_broker_url,
        "broker_connection_retry_on_startup": True,
        "broker_transport_options": {
            # An unacknowledged message (its worker died mid-task) is delivered again after this.
            "visibility_timeout": settings.broker_visibility_timeout_s,
            # Every broker key (queues, unacked hash, fanout channels) under our prefix, so
            # several deployments or test runs share one Redis without meeting.
            "global_keyprefix": f"{settings.key_prefix}:",
        },
        # Results travel as events in the database, never through Celery.
        "task_ignore_result": True,
        "result_backend": None,
        # --- delivery semantics ------------------------------------------------------
        # Acknowledge after the task ran: a worker killed mid-task leaves the message to be
        # delivered again. Safe only because every task is idempotent (deterministic Job
        # names, guarded completions, a unique terminal event).
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        # With late acks, a task running when the broker connection drops is redelivered
        # anyway: cancel it rather than let it finish twice.
        "worker_cancel_long_running_tasks_on_connection_loss": True,
        "task_serializer": "json",
        "accept_content": ["json"],
        # --- worker --------------------------------------------------------------------
        # Threads, not prefork: the tasks wait on the API server, PostgreSQL and Redis. And a
        # worker is then ONE process, so a SIGKILL (the crash tests', the OOM killer's) takes
        # down exactly the process that held the messages, with no pool of children to
        # orphan or respawn.
        "worker_pool": "threads",
        "worker_concurrency": settings.worker_concurrency,
        # Celery's consumer on channels that survive a Redis restart (tasks/broker.py: Celery 5.7
        # closes a lost connection in a way kombu's Redis channels answer with AttributeError).
        "worker_consumer": "k8s_dispatch.tasks.broker:Consumer",
        # Time limits are enforced by the prefork pool only; under threads every I/O call
        # has its own timeout (Kubernetes requests, Redis sockets, database connects), which
        # is what bounds a task. Declared for anyone running `--pool prefork`.
        "task_time_limit": 300,
        "task_soft_time_limit": 240,
        # Events for Flower: task-sent from producers, the rest from workers. Each is a Redis
        # publish, about four per task: affordable because creates and completions travel in
        # batches (create_jobs, complete_batch), not a task per Job. Housekeeping sends none
        # (tasks/task_events.py), so that Flower's Tasks page is the work.
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        # --- queues and routes ---------------------------------------------------------
        # A worker consumes every queue listed here unless told otherwise (-Q).
        "task_queues": (Queue(JOBS_QUEUE), Queue(COMPLETE_QUEUE), Queue(SWEEP_QUEUE)),
        "task_default_queue": JOBS_QUEUE,
        "task_create_missing_queues": True,  # the engine's notify queue, declared when sent to
        "task_routes": {
            SCHEDULE_TASK: {"queue": JOBS_QUEUE},
            CREATE_JOB_TASK: {"queue": JOBS_QUEUE},
            CREATE_JOBS_TASK: {"queue": JOBS_QUEUE},
            CANCEL_TASK: {"queue": JOBS_QUEUE},
            ADMIT_TASK: {"queue": JOBS_QUEUE},
            COMPLETE_TASK: {"queue": COMPLETE_QUEUE},
            COMPLETE_BATCH_TASK: {"queue": COMPLETE_QUEUE},
            POLL_TASK: {"queue": SWEEP_QUEUE},
            CLEANUP_TASK: {"queue": SWEEP_QUEUE},
            SWEEP_TASK: {"queue": SWEEP_QUEUE},
            ARTIFACTS_CLEANUP_TASK: {"queue": SWEEP_QUEUE},
            DISPATCH_FAILED_TASK: {"queue": COMPLETE_QUEUE},
        },
        # Task modules besides the app's own `include` (Celery imports both at worker start).
        "imports": ("k8s_dispatch.tasks.artifacts_tasks", "k8s_dispatch.tasks.maps"),
        # --- beat ----------------------------------------------------------------------
        # Every entry is a plain interval, so beat needs no memory of last run times: the
        # in-memory scheduler writes no shelve file (nothing to leave behind, nothing for a
        # SIGTERM to find half-closed).
        # No `expires` on either: Celery would compare beat's clock with the worker's, and a
        # worker a few seconds ahead would drop every message. A backlog of polls or sweeps
        # (workers busy or down) is superseded by the task itself instead: each run skips if
        # another started within half its interval, by a Redis key's TTL (`tasks.supersede`).
        # Celery's in-memory scheduler with its intervals on the monotonic clock (a step of beat's
        # wall clock neither stops nor bursts the schedule), writing beat's liveness heartbeat for
        # each task it sends (tasks/beat_scheduler.py).
        "beat_scheduler": "k8s_dispatch.tasks.beat_scheduler:MonotonicScheduler",
        "beat_schedule": {
            "poll": {
                "task": POLL_TASK,
                "schedule": timedelta(seconds=settings.poll_interval_s),
                "options": {"queue": SWEEP_QUEUE},
            },
            "cleanup": {
                "task": CLEANUP_TASK,
                "schedule": timedelta(seconds=CLEANUP_POLLS * settings.poll_interval_s),
                "options": {"queue": SWEEP_QUEUE},
            },
            "admit": {
                "task": ADMIT_TASK,
                "schedule": timedelta(seconds=settings.poll_interval_s),
                # The net under lost admit messages: a pass whatever Redis says (queued work only).
                "kwargs": {"periodic": True},
                "options": {"queue": SWEEP_QUEUE},
            },
            "sweep": {
                "task": SWEEP_TASK,
                "schedule": timedelta(seconds=settings.sweep_interval_s),
                # The recovery sweep (workers also run one as they start, not superseded).
                "options": {"queue": SWEEP_QUEUE},
            },
            **_artifacts_schedule(settings),
        },
    }


def _artifacts_schedule(settings: Settings) -> dict[str, Any]:
    if settings.object_store_endpoint is None:
        return {}
    return {
        "artifacts-cleanup": {
            "task": ARTIFACTS_CLEANUP_TASK,
            "schedule": timedelta(seconds=artifacts_cleanup_interval_s(settings)),
            "options": {"queue": SWEEP_QUEUE},
        }
    }


# The module's own settings, for `config_from_object("k8s_dispatch.celeryconfig")`.
_settings = get_settings()
globals().update(config(_settings))
