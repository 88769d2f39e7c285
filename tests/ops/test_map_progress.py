"""`ops.map_progress`'s pure part: what a map's progress says about its open items (running or
waiting), in words and as data, for each place a map can be in."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from k8s_dispatch.ops.map_progress import ItemFailure, MapProgress


def _progress(**changes: object) -> MapProgress:
    base: dict[str, object] = {
        "items": 10, "parallelism": 3, "succeeded": 4, "failed": 1, "cancelled": 0, "job_created": True,
    }  # fmt: skip
    return MapProgress(**{**base, **changes})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "running", "waiting", "at_most", "says"),
    [
        # No Job yet (queued, or admitted and not created): nothing runs, every open item waits.
        ({"job_created": False}, 0, 5, 0, "5 open (all waiting: no Job yet)"),
        # Its Job exists: the database cannot split open items; at most `parallelism` run.
        ({}, None, None, 3, "5 open (at most 3 running, the rest waiting)"),
        ({"succeeded": 8}, None, None, 1, "1 open (at most 1 running, the rest waiting)"),
        # Every item ended: nothing is open.
        ({"succeeded": 9}, 0, 0, 0, "9 of 10 succeeded, 1 failed, 0 open"),
        # The map ended: its open items were ended with it, nothing runs.
        ({"ended": True, "succeeded": 2, "cancelled": 7}, 0, 0, 0, "1 failed, 7 cancelled, 0 open"),
    ],
)
def test_open_items_are_running_or_waiting_as_far_as_the_database_knows(
    changes: dict[str, object], running: int | None, waiting: int | None, at_most: int, says: str
) -> None:
    progress = _progress(**changes)
    assert (progress.running, progress.waiting, progress.running_at_most) == (running, waiting, at_most)
    assert says in progress.summary()
    data = progress.to_dict()
    assert (data["running"], data["waiting"], data["running_at_most"]) == (running, waiting, at_most)
    assert data["open"] == progress.items - progress.succeeded - progress.failed - progress.cancelled


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({}, "10 items, parallelism 3, passes with every item succeeded"),
        (
            {"min_succeeded": 7, "max_failed_items": 2},
            "passes with at least 7 succeeded; stops once more than 2 failed",
        ),
    ],
)
def test_the_rule_says_how_the_map_passes_and_when_it_stops(changes: dict[str, object], says: str) -> None:
    assert says in _progress(**changes).rule()


def test_an_item_failure_is_plain_json() -> None:
    at = datetime(2026, 12, 2, 18, 0, tzinfo=UTC)
    failure = ItemFailure(index=7, reason="OOMKilled", message=None, exit_code=137, at=at)
    assert failure.to_dict() == {
        "index": 7, "reason": "OOMKilled", "message": None, "exit_code": 137, "at": "2026-12-02T18:00:00+00:00",
    }  # fmt: skip
