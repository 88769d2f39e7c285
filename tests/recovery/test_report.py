"""The sweep report: counts per category, its error total, its table and its JSON."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from k8s_dispatch.recovery.plan import Category
from k8s_dispatch.recovery.report import MAX_PROBLEMS, SweepReport

START = datetime(2025, 1, 1, tzinfo=UTC)


def report_with_counts() -> SweepReport:
    report = SweepReport(dry_run=False, started_at=START, namespaces=["a", "b"], jobs_listed=12, dispatches_checked=3)
    report.categories[Category.FINISHED_UNRECORDED].found = 5
    report.categories[Category.FINISHED_UNRECORDED].acted = 4
    report.categories[Category.FINISHED_UNRECORDED].skipped = 1
    report.categories[Category.ORPHAN].found = 2
    report.unnotified.found = 1
    report.unnotified.errors = 1
    report.finished_at = START + timedelta(seconds=1.5)
    return report


def test_errors_add_up_actions_and_problems() -> None:
    report = report_with_counts()
    assert report.errors == 1
    report.categories[Category.CLEANUP].errors = 2
    report.add_problem("listing jobs in a: ApiUnavailable")
    assert report.errors == 4


def test_problems_are_counted_all_but_kept_bounded() -> None:
    report = SweepReport(dry_run=False, started_at=START)
    for i in range(MAX_PROBLEMS + 10):
        report.add_problem(f"problem {i}")
    assert report.errors == MAX_PROBLEMS + 10
    assert len(report.problems) == MAX_PROBLEMS


def test_json_has_every_category_and_round_trips() -> None:
    data = json.loads(json.dumps(report_with_counts().to_dict()))
    assert list(data["categories"]) == [c.label for c in Category]
    assert data["categories"]["finished_unrecorded"] == {"found": 5, "acted": 4, "skipped": 1, "errors": 0}
    assert data["categories"]["orphan"]["found"] == 2
    assert data["unnotified"] == {"found": 1, "acted": 0, "skipped": 0, "errors": 1}
    assert data["errors"] == 1 and data["duration_s"] == 1.5 and data["jobs_listed"] == 12
    assert data["dry_run"] is False and data["namespaces"] == ["a", "b"]


def test_table_has_a_row_per_category_with_aligned_counts() -> None:
    lines = report_with_counts().table().splitlines()
    assert lines[0].split() == ["category", "found", "acted", "skipped", "errors"]
    n = len(Category) + 1  # a row per category, then re-notifications
    rows = {line.split()[1] if line[0].isdigit() else line.split()[0]: line.split()[-4:] for line in lines[1 : n + 1]}
    assert list(rows) == [c.label for c in Category] + ["unnotified"]
    assert rows["finished_unrecorded"] == ["5", "4", "1", "0"]
    assert rows["orphan"] == ["2", "0", "0", "0"]
    assert rows["stopping"] == rows["tampered"] == ["0", "0", "0", "0"]
    assert rows["unnotified"] == ["1", "0", "0", "1"]
    assert len({len(line) for line in lines[1 : n + 1]}) == 1  # right-aligned columns
    assert "12 jobs listed in 2 namespace(s)" in lines[n + 1] and "1 error(s)" in lines[n + 1]


def test_summary_is_one_line_with_every_row() -> None:
    summary = report_with_counts().summary()
    assert "\n" not in summary
    assert "finished_unrecorded=5/4/1" in summary and "unnotified=1/0/0" in summary and "errors=1" in summary


def test_dry_run_says_so() -> None:
    report = SweepReport(dry_run=True, started_at=START)
    assert "dry run: nothing was changed" in report.table()
    assert "(dry run)" in report.summary()
