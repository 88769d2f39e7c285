"""`k8s-dispatch status`: counts by state, the oldest dispatch still pending, the latest failures
with reasons and messages, from a database of its own (PostgreSQL and SQLite); the report's JSON
and its tables; and the command itself as a script would run it (exit 0, JSON on stdout).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from rich.console import Console

from k8s_dispatch.core.limits import Limits, TenancyLimit
from k8s_dispatch.ops.status import CreateWait, Failure, Pending, StatusReport, format_age, read_status, render
from k8s_dispatch.store import admission, dispatches, migrate, scheduling
from k8s_dispatch.store.db import make_engine, make_sessionmaker, transaction
from k8s_dispatch.store.models import EventType

NOW = datetime(2025, 6, 1, 12, 0, 0, tzinfo=UTC)
REPO = Path(__file__).resolve().parents[2]


class Router:
    def worker_for(self, capability: str) -> str:
        return "w"


@pytest.fixture(params=["postgresql", "sqlite"])
def fresh_db_url(request, tmp_path) -> str:
    """An empty, migrated database for this test alone: the counts are then all ours."""
    if request.param == "postgresql":
        url = request.getfixturevalue("new_pg_database")()
    else:
        url = f"sqlite:///{tmp_path / 'status.db'}"
    migrate.upgrade(url)
    return url


def populate(url: str) -> dict[str, str]:
    """Dispatches in every state, at known times; returns name -> dispatch id."""
    engine = make_engine(url)
    ids: dict[str, str] = {}
    try:
        with transaction(make_sessionmaker(engine)) as session:
            scheduling.create_case(session, case_id="case-1", tenancy_id="acme")

            def schedule(name: str, minutes_ago: float, capability: str = "demo.x") -> str:
                ids[name] = scheduling.schedule(
                    session,
                    case_id="case-1",
                    tenancy_id="acme",
                    capability=capability,
                    input={"n": name},
                    idempotency_key=f"key-{name}-{uuid.uuid4().hex[:6]}",
                    router=Router(),
                    max_input_bytes=1024,
                    now=NOW - timedelta(minutes=minutes_ago),
                ).dispatch_id
                return ids[name]

            schedule("old-scheduled", 90, capability="demo.slow")
            schedule("new-scheduled", 1)
            created = schedule("created", 30)
            dispatches.mark_created(session, created, job_name="j", namespace="default", attempt=0, now=NOW)
            done = schedule("completed", 200)  # older, but ended: not pending
            dispatches.record_terminal(
                session, done, EventType.WORKER_COMPLETED, {"output": 1}, now=NOW - timedelta(minutes=100)
            )
            dispatches.mark_notified(session, done)
            first = schedule("failed-first", 60)
            dispatches.record_terminal(
                session, first, EventType.WORKER_FAILED, {"reason": "JobLost", "message": "job  vanished\n twice"},
                now=NOW - timedelta(minutes=20),
            )  # fmt: skip
            later = schedule("failed-later", 60)
            dispatches.record_terminal(
                session, later, EventType.WORKER_FAILED, {"reason": "DeadlineExceeded"}, now=NOW - timedelta(minutes=5)
            )
            cancelled = schedule("cancelled", 10)
            dispatches.record_terminal(
                session, cancelled, EventType.WORKER_CANCELLED, {"reason": "UserCancelled"}, now=NOW
            )
    finally:
        engine.dispose()
    return ids


def read(url: str, **kwargs: object) -> StatusReport:
    engine = make_engine(url)
    try:
        with transaction(make_sessionmaker(engine)) as session:
            return read_status(session, now=NOW, **kwargs)  # type: ignore[arg-type]
    finally:
        engine.dispose()


def test_the_report_counts_states_finds_the_oldest_pending_and_lists_failures_newest_first(fresh_db_url) -> None:
    ids = populate(fresh_db_url)
    report = read(fresh_db_url)

    assert report.counts == {"QUEUED": 0, "SCHEDULED": 2, "CREATED": 1, "COMPLETED": 1, "FAILED": 2, "CANCELLED": 1}
    assert (report.total, report.pending) == (7, 3)
    oldest = report.oldest_pending
    assert oldest is not None
    assert (oldest.dispatch_id, oldest.state, oldest.capability) == (ids["old-scheduled"], "SCHEDULED", "demo.slow")
    assert (oldest.case_id, oldest.tenancy_id, oldest.age_s) == ("case-1", "acme", 90 * 60)
    assert [(f.dispatch_id, f.reason, f.message) for f in report.recent_failures] == [
        (ids["failed-later"], "DeadlineExceeded", None),
        (ids["failed-first"], "JobLost", "job vanished twice"),
    ]
    assert report.recent_failures[0].finished_at == NOW - timedelta(minutes=5)
    assert report.unnotified == 3  # two failed and the cancelled one; the completed one was told

    assert [f.dispatch_id for f in read(fresh_db_url, failures=1).recent_failures] == [ids["failed-later"]]
    assert read(fresh_db_url, failures=0).recent_failures == []


def test_an_empty_database_reports_zeros_and_nothing_pending(fresh_db_url) -> None:
    report = read(fresh_db_url)
    assert report.counts == {"QUEUED": 0, "SCHEDULED": 0, "CREATED": 0, "COMPLETED": 0, "FAILED": 0, "CANCELLED": 0}
    assert report.oldest_pending is None and report.recent_failures == [] and report.unnotified == 0
    text = rendered(report)
    assert "oldest pending: none" in text and "no failures" in text


def sample_report() -> StatusReport:
    return StatusReport(
        generated_at=NOW,
        counts={"QUEUED": 0, "SCHEDULED": 4, "CREATED": 2, "COMPLETED": 10, "FAILED": 1, "CANCELLED": 0},
        oldest_pending=Pending(
            dispatch_id="d-old",
            state="CREATED",
            capability="demo.x",
            case_id="c1",
            tenancy_id="acme",
            created_at=NOW - timedelta(seconds=185),
            age_s=185.0,
        ),
        recent_failures=[
            Failure(
                dispatch_id="d-f",
                capability="demo.y",
                case_id="c2",
                tenancy_id="globex",
                reason="BackoffLimitExceeded",
                message="exit 2",
                finished_at=NOW,
            )
        ],
        unnotified=1,
    )


def rendered(report: StatusReport) -> str:
    console = Console(record=True, width=160, file=open(os.devnull, "w"))  # noqa: SIM115 - closed below, after export
    try:
        console.print(render(report))
        return console.export_text()
    finally:
        console.file.close()


def test_the_tables_show_every_state_the_oldest_pending_and_each_failure() -> None:
    text = rendered(sample_report())
    lines = {line.strip("│ ").split()[0]: line for line in text.splitlines() if line.startswith("│")}
    assert lines["SCHEDULED"].split()[-2] == "4" and lines["CANCELLED"].split()[-2] == "0"
    assert lines["total"].split()[-2] == "17"
    assert "oldest pending: d-old CREATED demo.x case=c1 tenancy=acme, waiting 3m05s" in text
    assert "engine not told yet: 1" in text
    failure = text.splitlines()[text.splitlines().index("latest 1 failures") + 1 :]
    assert failure[0].split() == [
        "2025-06-01",
        "12:00:00",
        "BackoffLimitExceeded",
        "demo.y",
        "tenancy=globex",
        "case=c2",
        "d-f",
    ]
    assert failure[1].strip() == "exit 2"


def test_the_json_holds_everything_the_tables_show() -> None:
    data = json.loads(json.dumps(sample_report().to_dict()))
    assert data["total"] == 17 and data["pending"] == 6 and data["unnotified"] == 1
    assert data["counts"]["COMPLETED"] == 10
    assert data["oldest_pending"]["dispatch_id"] == "d-old" and data["oldest_pending"]["age_s"] == 185.0
    assert data["recent_failures"] == [
        {
            "dispatch_id": "d-f", "capability": "demo.y", "case_id": "c2", "tenancy_id": "globex",
            "reason": "BackoffLimitExceeded", "message": "exit 2", "finished_at": NOW.isoformat(),
            "exit_code": None, "signal": None, "container_reason": None,
        }
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (59.9, "59s"), (60, "1m00s"), (185, "3m05s"), (3600, "1h00m"), (7620, "2h07m"), (273600, "3d04h")],
)
def test_ages_read_at_a_glance(seconds: float, text: str) -> None:
    assert format_age(seconds) == text


def run_cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("K8S_DISPATCH_")}
    env["K8S_DISPATCH_DATABASE_URL"] = url
    return subprocess.run(
        [sys.executable, "-m", "k8s_dispatch.cli", "status", *args],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_the_command_prints_json_for_scripts_and_tables_for_people(fresh_db_url) -> None:
    ids = populate(fresh_db_url)
    result = run_cli(fresh_db_url, "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["counts"] == {"QUEUED": 0, "SCHEDULED": 2, "CREATED": 1, "COMPLETED": 1, "FAILED": 2, "CANCELLED": 1}
    assert data["oldest_pending"]["dispatch_id"] == ids["old-scheduled"]
    assert [f["reason"] for f in data["recent_failures"]] == ["DeadlineExceeded", "JobLost"]

    result = run_cli(fresh_db_url, "--failures", "1")
    assert result.returncode == 0, result.stderr
    assert "dispatches by state" in result.stdout and ids["old-scheduled"] in result.stdout
    assert "DeadlineExceeded" in result.stdout and "JobLost" not in result.stdout


def test_dispatches_waiting_for_their_create_are_shown_with_why() -> None:
    quota = 'QuotaExceeded: create job in ns: 403 Forbidden: jobs.batch "kd-w" is forbidden: exceeded quota: q'
    report = dataclasses.replace(
        sample_report(),
        create_waiting=3,
        create_waits=[CreateWait("d-wait", "demo.x", quota, NOW - timedelta(seconds=9))],
    )
    text = rendered(report)
    assert "waiting for their Job to be created: 3 (retried)" in text
    assert "d-wait" in text and "exceeded quota: q" in text
    assert report.to_dict()["create_waits"] == [
        {
            "dispatch_id": "d-wait",
            "capability": "demo.x",
            "error": quota,
            "since": (NOW - timedelta(seconds=9)).isoformat(),
        }
    ]
    assert "waiting for their Job" not in rendered(sample_report())


class LimitedRouter(Router):
    def __init__(self, limits: Limits) -> None:
        self.limits = limits


def test_the_fair_share_rows_show_running_queued_the_oldest_and_how_full_each_limit_is(fresh_db_url) -> None:
    limits = Limits(tenancies={"acme": TenancyLimit(2)}, capabilities={"demo.x": 5})
    engine = make_engine(fresh_db_url)
    try:
        sessions = make_sessionmaker(engine)
        with transaction(sessions) as session:
            scheduling.create_case(session, case_id="case-q", tenancy_id="acme")
            for i in range(5):
                scheduling.schedule(
                    session, case_id="case-q", tenancy_id="acme", capability="demo.x", input={"i": i},
                    idempotency_key=f"q-{i}", router=LimitedRouter(limits), max_input_bytes=1000,
                    now=NOW - timedelta(minutes=10 - i),
                )  # fmt: skip
        with transaction(sessions) as session:
            admission.admit(session, limits, now=NOW)
        report = read(fresh_db_url, limits=limits)
    finally:
        engine.dispose()
    assert report.counts["QUEUED"] == 3 and report.counts["SCHEDULED"] == 2
    (row,) = report.queues
    assert (row.tenancy_id, row.capability, row.running, row.queued) == ("acme", "demo.x", 2, 3)
    assert row.oldest_queued_s == 8 * 60  # the first two (10 and 9 minutes ago) were admitted
    assert (row.tenancy_limit, row.capability_limit) == (2, 5)
    assert report.to_dict()["queues"][0]["queued"] == 3
    text = rendered(report)
    assert "fair share" in text and "tenancy 2 / 2" in text and "capability 2 / 5" in text
