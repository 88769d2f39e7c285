"""Prometheus metrics of one worker process: dispatch state changes, recovery findings,
duplicates prevented and poll lag, served on `K8S_DISPATCH_METRICS_PORT` when it is set.

Counters are per process, as Prometheus expects (sum them across workers in the query).
The functions below are what the delivery path, the poll task and the sweep call; each is
cheap and never raises, so a metric can never fail a delivery.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer


log = logging.getLogger(__name__)


class CategoryCounts(Protocol):
    found: int
    acted: int
    errors: int


class FinishedSweep(Protocol):
    """What `sweep_done` reads of a sweep's report (`recovery.report.SweepReport` is one): the
    metrics stay below the sweep, which calls them."""

    dry_run: bool
    oldest_scheduled_s: float
    finished_at: datetime | None

    def rows(self) -> Iterable[tuple[str, CategoryCounts]]: ...


NAMESPACE = "k8s_dispatch"
# Job finished -> terminal event recorded: about a poll interval when all is well (the alert on
# poll lag watches it), minutes when completions fall behind.
LATENCY_BUCKETS_S = (0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)
# Scheduled -> admitted: nothing when no limit is full, hours behind a paused tenancy.
QUEUE_WAIT_BUCKETS_S = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0, 14400.0)
# A running Job counts as past its deadline only this long after it: the Job controller fails
# it at the deadline, and the API server's clock (the Job's startTime) may differ from ours.
DEADLINE_SLACK_S = 120.0


class Metrics:
    """The metric families, registered in one registry (the default one, or a test's own)."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.registry = registry
        self.state_changes = Counter(
            "dispatch_state_changes",
            "Dispatches this process moved into a state (SCHEDULED, CREATED, COMPLETED, FAILED, CANCELLED).",
            ["state"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.failures = Counter(
            "dispatch_failures",
            "Dispatches this process recorded as FAILED, by reason (BackoffLimitExceeded, JobLost, ...).",
            ["reason"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.duplicates_prevented = Counter(
            "duplicates_prevented",
            "Second deliveries stopped: by the Redis guard (another replica held the claim) or by "
            "the database (the terminal event was recorded already).",
            ["by"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.recovery_findings = Counter(
            "recovery_findings",
            "What recovery sweeps found, by category.",
            ["category"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.recovery_actions = Counter(
            "recovery_actions",
            "What recovery sweeps did about their findings, by category.",
            ["category"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.recovery_errors = Counter(
            "recovery_errors",
            "Sweep actions or listings that failed (the next sweep retries them), by category.",
            ["category"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.sweeps = Counter("recovery_sweeps", "Recovery sweeps run.", namespace=NAMESPACE, registry=registry)
        self.last_sweep = Gauge(
            "recovery_last_sweep_timestamp_seconds",
            "When the latest recovery sweep of this process finished (Unix time).",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.poll_lag = Gauge(
            "poll_lag_seconds",
            "At the latest poll, how long the oldest finished Job had been waiting for its result to be "
            "recorded (0: none waiting). Grows when completions fall behind.",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.finished_jobs_waiting = Gauge(
            "poll_finished_jobs",
            "Finished Jobs seen by the latest poll (their results not yet recorded and cleaned up).",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.tasks_discarded = Counter(
            "tasks_discarded",
            "Task messages this worker dropped without running them, by task and reason: expired (an "
            "`expires` this worker's clock said had passed), revoked, terminated, or superseded (a poll "
            "or sweep that another one started shortly before).",
            ["task", "reason"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.last_poll = Gauge(
            "poll_last_timestamp_seconds",
            "When the latest poll of this process finished (Unix time).",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.last_findings = Gauge(
            "recovery_last_findings",
            "What the latest recovery sweep of this process found, by category: a count that stays "
            "above 0 sweep after sweep is work that does not move (scheduled_without_job: dispatches "
            "queued past the grace period with no Job).",
            ["category"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.oldest_scheduled = Gauge(
            "recovery_oldest_scheduled_seconds",
            "At the latest recovery sweep of this process, how long the oldest dispatch still scheduled "
            "without a Job past the grace period had waited (0: none). Past the grace period plus a sweep "
            "interval, its Job cannot be created (quota, API, config).",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.jobs_past_deadline = Gauge(
            "poll_jobs_past_deadline",
            "Running Jobs past their activeDeadlineSeconds (by more than "
            f"{DEADLINE_SLACK_S:.0f} s): the Job controller should have failed them. As the latest "
            "LIST poll saw them, or with the poll by watch as the latest sweep counted them in the database.",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.completion_latency = Histogram(
            "completion_latency_seconds",
            "From a Job's finish (its Complete or Failed condition, by the API server's clock) to its "
            "terminal event recorded by this process.",
            buckets=LATENCY_BUCKETS_S,
            namespace=NAMESPACE,
            registry=registry,
        )
        self.queue_wait = Histogram(
            "queue_wait_seconds",
            "From a dispatch's scheduling to its admission under its limits (core/limits.py), by "
            "the database's clock: how long fair share made it wait.",
            ["tenancy"],
            buckets=QUEUE_WAIT_BUCKETS_S,
            namespace=NAMESPACE,
            registry=registry,
        )
        self.tenancy_running = Gauge(
            "tenancy_running",
            "Dispatches holding a slot (admitted, not ended), by tenancy, as the last sweep counted.",
            ["tenancy"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.tenancy_queued = Gauge(
            "tenancy_queued",
            "Dispatches waiting for a slot under their limits, by tenancy, as the last sweep counted.",
            ["tenancy"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.api_requests = Counter(
            "api_requests",
            "Requests this process sent to the Kubernetes API, by verb (get, list, create, patch, "
            "delete, deletecollection) and answer: the HTTP status code, or `error` for none (refused, "
            "reset, timed out).",
            ["verb", "code"],
            namespace=NAMESPACE,
            registry=registry,
        )

    # --- what the call sites use ------------------------------------------------------------

    def state_changed(self, state: str, *, reason: str | None = None) -> None:
        self.state_changes.labels(state=state).inc()
        if state == "FAILED":
            self.failures.labels(reason=reason or "Unknown").inc()

    def duplicate_prevented(self, *, by: str) -> None:
        self.duplicates_prevented.labels(by=by).inc()

    def task_discarded(self, *, task: str, reason: str) -> None:
        self.tasks_discarded.labels(task=task, reason=reason).inc()

    def sweep_done(self, report: FinishedSweep) -> None:
        """Count one finished sweep's findings (a dry run counts nothing)."""
        if report.dry_run:
            return
        for name, counts in report.rows():
            category = name.split(" ")[-1]  # "1 scheduled_without_job" -> "scheduled_without_job"
            self.recovery_findings.labels(category=category).inc(counts.found)
            self.recovery_actions.labels(category=category).inc(counts.acted)
            self.recovery_errors.labels(category=category).inc(counts.errors)
            self.last_findings.labels(category=category).set(counts.found)
        self.oldest_scheduled.set(report.oldest_scheduled_s)
        self.sweeps.inc()
        finished = report.finished_at or datetime.now(UTC)
        self.last_sweep.set(finished.timestamp())

    def poll_done(self, *, finished: int, lag_s: float, past_deadline: int = 0) -> None:
        """Record a whole poll: the finished Jobs it saw, the oldest one's wait (`poll_lag_s`) and
        the running Jobs past their deadline (`jobs_past_deadline`)."""
        self.finished_jobs_waiting.set(finished)
        self.poll_lag.set(lag_s)
        self.jobs_past_deadline.set(past_deadline)
        self.last_poll.set(datetime.now(UTC).timestamp())

    def completion_recorded(self, job: Mapping[str, Any], *, now: datetime | None = None) -> None:
        """Observe one Job's completion latency, to `now` (default: this process's clock);
        nothing when its finish time is unknown."""
        finished = job_finished_at(job)
        if finished is not None:
            now = now if now is not None else datetime.now(UTC)
            self.completion_latency.observe(max(0.0, (now - finished).total_seconds()))

    def admitted(self, tenancy: str, *, waited_s: float) -> None:
        self.queue_wait.labels(tenancy=tenancy).observe(waited_s)

    def tenancies_counted(self, counts: Mapping[str, tuple[int, int]]) -> None:
        """Set the per-tenancy gauges from (running, queued); a tenancy no longer counted goes to 0."""
        for gauge, index in ((self.tenancy_running, 0), (self.tenancy_queued, 1)):
            for labels in list(_label_values(gauge)):
                if labels not in counts:
                    gauge.labels(tenancy=labels).set(0)
            for tenancy, values in counts.items():
                gauge.labels(tenancy=tenancy).set(values[index])

    def api_request(self, verb: str, code: str) -> None:
        """Count one Kubernetes API request (`workers.kube.KubeClient`'s `on_request`)."""
        self.api_requests.labels(verb=verb, code=code).inc()


# --- pure -------------------------------------------------------------------------------


def _label_values(gauge: Gauge) -> Iterable[str]:
    """The tenancy label values a gauge has children for."""
    for metric in gauge.collect():
        for sample in metric.samples:
            value = sample.labels.get("tenancy")
            if value is not None:
                yield value


def job_finished_at(job: Mapping[str, Any]) -> datetime | None:
    """When a Job finished: its Complete/Failed condition's transition time, else completionTime."""
    status = job.get("status") or {}
    for condition in status.get("conditions") or []:
        if (
            isinstance(condition, Mapping)
            and condition.get("type") in ("Complete", "Failed", "SuccessCriteriaMet", "FailureTarget")
            and condition.get("status") == "True"
        ):
            stamp = _timestamp(condition.get("lastTransitionTime"))
            if stamp is not None:
                return stamp
    return _timestamp(status.get("completionTime"))


def poll_lag_s(finished_jobs: Iterable[Mapping[str, Any]], *, now: datetime) -> float:
    """Seconds the oldest of `finished_jobs` has waited since it finished (0 if none or unknown)."""
    ages = [(now - at).total_seconds() for at in map(job_finished_at, finished_jobs) if at is not None]
    return max([0.0, *ages])


def jobs_past_deadline(jobs: Iterable[Mapping[str, Any]], *, now: datetime, slack_s: float = DEADLINE_SLACK_S) -> int:
    """How many of `jobs` run (not finished) past `status.startTime` + `spec.activeDeadlineSeconds`
    + `slack_s`; a Job with no deadline or no start time is never past it."""
    count = 0
    for job in jobs:
        deadline = (job.get("spec") or {}).get("activeDeadlineSeconds")
        status = job.get("status") or {}
        started = _timestamp(status.get("startTime"))
        if not isinstance(deadline, int) or isinstance(deadline, bool) or started is None:
            continue
        if job_finished_at(job) is None and (now - started).total_seconds() > deadline + slack_s:
            count += 1
    return count


def _timestamp(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


# --- the process's metrics and their endpoint --------------------------------------------

METRICS = Metrics()

_server: WSGIServer | None = None
_server_lock = threading.Lock()


def serve(port: int, *, addr: str = "0.0.0.0") -> int:
    """Serve this process's metrics on `port` (0: any free port) at /metrics; returns the port.

    Once per process: a second call returns the port already served.

    Raises:
        OSError: the port cannot be bound.
    """
    global _server
    with _server_lock:
        if _server is None:
            _server, _thread = start_http_server(port, addr=addr, registry=METRICS.registry)
        return int(_server.server_address[1])


def stop_serving() -> None:
    """Stop the endpoint (at worker shutdown, and in tests)."""
    global _server
    with _server_lock:
        if _server is not None:
            _server.shutdown()
            _server.server_close()
            _server = None
