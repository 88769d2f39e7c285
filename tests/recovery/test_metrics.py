"""Worker metrics and the state-change log line: counters per state and reason, recovery findings
per category, poll lag, the /metrics endpoint over HTTP, and one logfmt line per change that
carries dispatch id, case id and tenancy (logged on commit only, for changes in a caller's
transaction).
"""

from __future__ import annotations

import logging
import urllib.request
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from k8s_dispatch.delivery import metrics, statelog
from k8s_dispatch.delivery.metrics import DEADLINE_SLACK_S, Metrics, job_finished_at, jobs_past_deadline, poll_lag_s
from k8s_dispatch.recovery.plan import Category
from k8s_dispatch.recovery.report import SweepReport
from k8s_dispatch.store import scheduling
from k8s_dispatch.store.db import transaction

NOW = datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


# --- counters ------------------------------------------------------------------------------


def test_state_changes_are_counted_per_state_and_failures_per_reason() -> None:
    registry = CollectorRegistry()
    m = Metrics(registry)
    for state in ("SCHEDULED", "SCHEDULED", "CREATED", "COMPLETED"):
        m.state_changed(state)
    m.state_changed("FAILED", reason="DeadlineExceeded")
    m.state_changed("FAILED", reason="DeadlineExceeded")
    m.state_changed("FAILED")
    m.state_changed("CANCELLED", reason="UserCancelled")  # a reason on another state is not a failure

    changes = "k8s_dispatch_dispatch_state_changes_total"
    assert value(registry, changes, state="SCHEDULED") == 2
    assert value(registry, changes, state="CREATED") == 1
    assert value(registry, changes, state="COMPLETED") == 1
    assert value(registry, changes, state="FAILED") == 3
    assert value(registry, changes, state="CANCELLED") == 1
    failures = "k8s_dispatch_dispatch_failures_total"
    assert value(registry, failures, reason="DeadlineExceeded") == 2
    assert value(registry, failures, reason="Unknown") == 1
    assert value(registry, failures, reason="UserCancelled") == 0


def test_duplicates_prevented_are_counted_by_what_stopped_them() -> None:
    registry = CollectorRegistry()
    m = Metrics(registry)
    m.duplicate_prevented(by="guard")
    m.duplicate_prevented(by="guard")
    m.duplicate_prevented(by="database")
    assert value(registry, "k8s_dispatch_duplicates_prevented_total", by="guard") == 2
    assert value(registry, "k8s_dispatch_duplicates_prevented_total", by="database") == 1


def sweep_report(*, dry_run: bool = False) -> SweepReport:
    report = SweepReport(dry_run=dry_run, started_at=NOW)
    report.categories[Category.SCHEDULED_WITHOUT_JOB].found = 3
    report.categories[Category.SCHEDULED_WITHOUT_JOB].acted = 3
    report.categories[Category.FINISHED_UNRECORDED].found = 5
    report.categories[Category.FINISHED_UNRECORDED].acted = 4
    report.categories[Category.FINISHED_UNRECORDED].errors = 1
    report.unnotified.found = 2
    report.finished_at = NOW + timedelta(seconds=2)
    return report


def test_a_sweep_adds_its_findings_actions_and_errors_per_category() -> None:
    registry = CollectorRegistry()
    m = Metrics(registry)
    m.sweep_done(sweep_report())
    m.sweep_done(sweep_report())
    found, acted, errors = (f"k8s_dispatch_recovery_{kind}_total" for kind in ("findings", "actions", "errors"))
    assert value(registry, found, category="scheduled_without_job") == 6
    assert value(registry, acted, category="scheduled_without_job") == 6
    assert value(registry, found, category="finished_unrecorded") == 10
    assert value(registry, acted, category="finished_unrecorded") == 8
    assert value(registry, errors, category="finished_unrecorded") == 2
    assert value(registry, found, category="unnotified") == 4
    # Every category is present, zero when nothing was found: dashboards need no special case.
    assert registry.get_sample_value(found, {"category": "orphan"}) == 0
    assert value(registry, "k8s_dispatch_recovery_sweeps_total") == 2
    assert (
        value(registry, "k8s_dispatch_recovery_last_sweep_timestamp_seconds")
        == (NOW + timedelta(seconds=2)).timestamp()
    )


def test_a_dry_run_sweep_counts_nothing() -> None:
    registry = CollectorRegistry()
    Metrics(registry).sweep_done(sweep_report(dry_run=True))
    assert value(registry, "k8s_dispatch_recovery_sweeps_total") == 0
    assert value(registry, "k8s_dispatch_recovery_findings_total", category="finished_unrecorded") == 0


# --- poll lag (pure) ------------------------------------------------------------------------


def job(*, conditions: list[dict[str, Any]] | None = None, completion: str | None = None) -> dict[str, Any]:
    status: dict[str, Any] = {"conditions": conditions or []}
    if completion is not None:
        status["completionTime"] = completion
    return {"metadata": {"name": "j"}, "status": status}


def stamp(seconds_ago: float) -> str:
    return (NOW - timedelta(seconds=seconds_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.mark.parametrize(
    ("the_job", "expected_age_s"),
    [
        (job(conditions=[{"type": "Complete", "status": "True", "lastTransitionTime": stamp(30)}]), 30),
        (job(conditions=[{"type": "Failed", "status": "True", "lastTransitionTime": stamp(7)}]), 7),
        # The interim condition (1.31+) counts as the finish too.
        (job(conditions=[{"type": "SuccessCriteriaMet", "status": "True", "lastTransitionTime": stamp(4)}]), 4),
        # A condition that is not True says nothing; completionTime is the fallback.
        (
            job(
                conditions=[{"type": "Complete", "status": "False", "lastTransitionTime": stamp(99)}],
                completion=stamp(12),
            ),
            12,
        ),
        (job(conditions=[{"type": "Suspended", "status": "True", "lastTransitionTime": stamp(99)}]), None),
        (job(), None),
        (job(completion="not a time"), None),
        ({"metadata": {}}, None),
    ],
)
def test_job_finished_at_reads_the_terminal_condition_or_the_completion_time(the_job, expected_age_s) -> None:
    finished = job_finished_at(the_job)
    if expected_age_s is None:
        assert finished is None
    else:
        assert finished is not None and (NOW - finished).total_seconds() == expected_age_s


def test_poll_lag_is_the_oldest_finished_jobs_wait_or_zero() -> None:
    done = lambda s: job(conditions=[{"type": "Complete", "status": "True", "lastTransitionTime": stamp(s)}])  # noqa: E731
    assert poll_lag_s([done(3), done(41), done(9), job()], now=NOW) == 41
    assert poll_lag_s([], now=NOW) == 0
    assert poll_lag_s([job()], now=NOW) == 0
    assert poll_lag_s([done(-5)], now=NOW) == 0  # a clock ahead of ours is no negative lag


def test_poll_done_sets_the_gauges() -> None:
    registry = CollectorRegistry()
    m = Metrics(registry)
    m.poll_done(finished=4, lag_s=12.5)
    assert value(registry, "k8s_dispatch_poll_lag_seconds") == 12.5
    assert value(registry, "k8s_dispatch_poll_finished_jobs") == 4
    assert value(registry, "k8s_dispatch_poll_last_timestamp_seconds") > NOW.timestamp()
    m.poll_done(finished=0, lag_s=0.0)
    assert value(registry, "k8s_dispatch_poll_lag_seconds") == 0


def test_the_latest_sweeps_findings_and_oldest_scheduled_wait_are_gauges_that_fall_back_to_zero() -> None:
    registry = CollectorRegistry()
    m = Metrics(registry)
    m.sweep_done(sweep_report())  # 3 scheduled without a Job
    stuck = sweep_report()
    stuck.oldest_scheduled_s = 95.5
    m.sweep_done(stuck)
    gauge = "k8s_dispatch_recovery_last_findings"
    assert value(registry, gauge, category="scheduled_without_job") == 3  # not added up: the latest
    assert value(registry, gauge, category="finished_unrecorded") == 5
    assert value(registry, "k8s_dispatch_recovery_oldest_scheduled_seconds") == 95.5
    m.sweep_done(SweepReport(dry_run=False, started_at=NOW))  # found nothing
    assert value(registry, "k8s_dispatch_recovery_oldest_scheduled_seconds") == 0
    assert value(registry, gauge, category="scheduled_without_job") == 0
    assert registry.get_sample_value(gauge, {"category": "orphan"}) == 0  # every category is exported


def running(*, started_s_ago: float | None, deadline: object, finished: bool = False) -> dict[str, Any]:
    status: dict[str, Any] = {"active": 1}
    if started_s_ago is not None:
        status["startTime"] = stamp(started_s_ago)
    if finished:
        status["conditions"] = [{"type": "Failed", "status": "True", "lastTransitionTime": stamp(1)}]
    spec: dict[str, Any] = {} if deadline is None else {"activeDeadlineSeconds": deadline}
    return {"metadata": {"name": "r"}, "spec": spec, "status": status}


@pytest.mark.parametrize(
    ("the_job", "past"),
    [
        (running(started_s_ago=600 + DEADLINE_SLACK_S + 1, deadline=600), 1),
        (running(started_s_ago=600 + DEADLINE_SLACK_S - 1, deadline=600), 0),  # within the slack
        (running(started_s_ago=100, deadline=600), 0),
        (running(started_s_ago=10_000, deadline=None), 0),  # no deadline: never past it
        (running(started_s_ago=None, deadline=600), 0),  # not started: the deadline counts from the start
        (running(started_s_ago=10_000, deadline=600, finished=True), 0),  # failed at its deadline
        (running(started_s_ago=10_000, deadline=True), 0),  # not a number of seconds
        (running(started_s_ago=10_000, deadline="600"), 0),
    ],
)
def test_jobs_past_deadline_counts_running_jobs_past_their_active_deadline(the_job, past) -> None:
    assert jobs_past_deadline([the_job], now=NOW) == past


def test_poll_done_sets_the_jobs_past_deadline() -> None:
    registry = CollectorRegistry()
    m = Metrics(registry)
    m.poll_done(finished=0, lag_s=0.0, past_deadline=2)
    assert value(registry, "k8s_dispatch_poll_jobs_past_deadline") == 2
    m.poll_done(finished=0, lag_s=0.0)
    assert value(registry, "k8s_dispatch_poll_jobs_past_deadline") == 0


def test_completion_latency_is_observed_from_the_jobs_finish() -> None:
    registry = CollectorRegistry()
    m = Metrics(registry)
    done = lambda s: job(conditions=[{"type": "Complete", "status": "True", "lastTransitionTime": stamp(s)}])  # noqa: E731
    m.completion_recorded(done(2), now=NOW)
    m.completion_recorded(done(40), now=NOW)
    m.completion_recorded(done(-5), now=NOW)  # an API server clock ahead of ours: 0, never negative
    m.completion_recorded(job(), now=NOW)  # no finish time: nothing observed
    histogram = "k8s_dispatch_completion_latency_seconds"
    assert value(registry, histogram + "_count") == 3
    assert value(registry, histogram + "_sum") == 42
    assert value(registry, histogram + "_bucket", le="0.25") == 1
    assert value(registry, histogram + "_bucket", le="2.0") == 2
    assert value(registry, histogram + "_bucket", le="30.0") == 2
    assert value(registry, histogram + "_bucket", le="60.0") == 3


def test_api_requests_are_counted_by_verb_and_answer() -> None:
    registry = CollectorRegistry()
    m = Metrics(registry)
    for verb, code in [("list", "200"), ("list", "200"), ("create", "201"), ("create", "409"), ("patch", "error")]:
        m.api_request(verb, code)
    requests = "k8s_dispatch_api_requests_total"
    assert value(registry, requests, verb="list", code="200") == 2
    assert value(registry, requests, verb="create", code="409") == 1
    assert value(registry, requests, verb="patch", code="error") == 1


# --- the endpoint --------------------------------------------------------------------------


def test_the_endpoint_serves_the_process_metrics_over_http() -> None:
    port = metrics.serve(0, addr="127.0.0.1")
    try:
        assert metrics.serve(0, addr="127.0.0.1") == port  # once per process
        metrics.METRICS.state_changed("COMPLETED")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            assert response.status == 200
            text = response.read().decode()
    finally:
        metrics.stop_serving()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    completed = [
        s for s in families["k8s_dispatch_dispatch_state_changes"].samples if s.labels == {"state": "COMPLETED"}
    ]
    assert completed and completed[0].value >= 1
    for name in (
        "k8s_dispatch_recovery_findings",
        "k8s_dispatch_duplicates_prevented",
        "k8s_dispatch_poll_lag_seconds",
    ):
        assert name in families
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


# --- the state-change line -------------------------------------------------------------------


def state_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "k8s_dispatch.state"]


def test_a_state_change_is_one_logfmt_line_with_dispatch_case_and_tenancy(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="k8s_dispatch.state")
    before = REGISTRY.get_sample_value("k8s_dispatch_dispatch_state_changes_total", {"state": "FAILED"}) or 0
    statelog.state_changed(
        "FAILED",
        dispatch_id="d-1",
        case_id="case 7",
        tenancy_id="acme",
        capability="demo.x",
        reason="JobLost",
        attempt=None,
    )
    [record] = state_lines(caplog)
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        'state-change state=FAILED dispatch_id=d-1 case_id="case 7" tenancy_id=acme capability=demo.x reason=JobLost'
    )
    assert record.k8s_dispatch == {  # type: ignore[attr-defined]
        "state": "FAILED", "dispatch_id": "d-1", "case_id": "case 7", "tenancy_id": "acme",
        "capability": "demo.x", "reason": "JobLost",
    }  # fmt: skip
    assert REGISTRY.get_sample_value("k8s_dispatch_dispatch_state_changes_total", {"state": "FAILED"}) == before + 1


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("plain", "plain"),
        ("two words", '"two words"'),
        ('say "hi"', '"say \\"hi\\""'),
        ("a=b", '"a=b"'),
        ("", '""'),
        ("line\nbreak", '"line\\nbreak"'),
        (3, "3"),
    ],
)
def test_logfmt_quotes_what_would_break_a_line(raw: object, shown: str) -> None:
    assert statelog.logfmt({"k": raw}) == f"k={shown}"


class Router:
    def worker_for(self, capability: str) -> str:
        return "w"


def schedule_one(session: Any, case_id: str) -> str:
    result = scheduling.schedule(
        session,
        case_id=case_id,
        tenancy_id="acme",
        capability="demo.x",
        input={},
        idempotency_key=f"k-{uuid.uuid4()}",
        router=Router(),
        max_input_bytes=1024,
    )
    statelog.on_commit(session, "SCHEDULED", dispatch_id=result.dispatch_id, case_id=case_id, tenancy_id="acme")
    return result.dispatch_id


def test_a_change_in_a_callers_transaction_is_logged_when_it_commits_and_never_if_it_rolls_back(
    db_sessionmaker, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="k8s_dispatch.state")
    case_id = f"case-{uuid.uuid4().hex[:8]}"
    with transaction(db_sessionmaker) as session:
        scheduling.create_case(session, case_id=case_id, tenancy_id="acme")

    with pytest.raises(RuntimeError), transaction(db_sessionmaker) as session:
        schedule_one(session, case_id)
        assert state_lines(caplog) == []  # not before the commit
        raise RuntimeError("the caller's transaction fails")
    assert state_lines(caplog) == []

    with transaction(db_sessionmaker) as session:
        dispatch_id = schedule_one(session, case_id)
        assert state_lines(caplog) == []
    [record] = state_lines(caplog)
    assert f"dispatch_id={dispatch_id} case_id={case_id} tenancy_id=acme" in record.getMessage()


def test_discarded_task_messages_are_counted_by_task_and_reason() -> None:
    registry = CollectorRegistry()
    m = Metrics(registry)
    m.task_discarded(task="k8s-dispatch.poll", reason="expired")
    m.task_discarded(task="k8s-dispatch.poll", reason="superseded")
    m.task_discarded(task="k8s-dispatch.poll", reason="superseded")
    name = "k8s_dispatch_tasks_discarded_total"
    assert value(registry, name, task="k8s-dispatch.poll", reason="expired") == 1
    assert value(registry, name, task="k8s-dispatch.poll", reason="superseded") == 2
    assert value(registry, name, task="k8s-dispatch.sweep", reason="expired") == 0
