"""`k8s-dispatch status` and maps (PostgreSQL and SQLite): the maps not ended, the oldest first,
each with its items succeeded, failed and open (waiting when it has no Job yet), capped with how
many more; an ended map is not among them; the JSON carries the same; the command prints both."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from map_databases import STORES, Router, migrated_url
from rich.console import Console

from k8s_dispatch.ops.status import read_status, render
from k8s_dispatch.store import dispatches, maps, scheduling
from k8s_dispatch.store.db import make_engine, make_sessionmaker, transaction
from k8s_dispatch.store.models import EventType, ItemEventType

NOW = datetime(2026, 12, 2, 18, 0, tzinfo=UTC)


@pytest.fixture(params=STORES)
def url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    """An empty, migrated database for this test alone: the maps in it are all ours."""
    return migrated_url(request, tmp_path / "status-maps.db")


def populate(url: str) -> dict[str, str]:
    """Three maps and one plain dispatch, at known times: name -> dispatch id.

    - `running` (the oldest): its Job made, 2 of 6 items succeeded, 1 failed;
    - `unmade`: no Job yet, its 3 items all waiting;
    - `ended`: failed, its open items ended with it (not in progress);
    - `plain`: a dispatch that is not a map (never a map row).
    """
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    ids: dict[str, str] = {}
    try:
        with transaction(sessions) as session:
            scheduling.create_case(session, case_id="cs", tenancy_id="acme")
            for name, items, minutes_ago in (("running", 6, 30), ("unmade", 3, 20), ("ended", 2, 40)):
                request = maps.MapRequest(
                    case_id="cs", tenancy_id="acme", capability=f"cap.{name}", items=list(range(items)),
                    idempotency_key=name, parallelism=2,
                )  # fmt: skip
                ids[name] = maps.schedule_map(
                    session, request, router=Router(), max_input_bytes=1000, now=NOW - timedelta(minutes=minutes_ago)
                ).dispatch_id
            ids["plain"] = scheduling.schedule(
                session, case_id="cs", tenancy_id="acme", capability="cap.plain", input={}, idempotency_key="p",
                router=Router(), max_input_bytes=1000, now=NOW - timedelta(minutes=50),
            ).dispatch_id  # fmt: skip
        with transaction(sessions) as session:
            for name in ("running", "ended"):
                dispatches.mark_created(session, ids[name], job_name=f"kd-{name}", namespace="jobs", attempt=0)
            ends = [
                (0, ItemEventType.ITEM_COMPLETED),
                (1, ItemEventType.ITEM_FAILED),
                (4, ItemEventType.ITEM_COMPLETED),
            ]
            maps.record_item_ends(
                session,
                [
                    maps.ItemEnd(ids["running"], i, kind, {"output": i} if kind == ItemEventType.ITEM_COMPLETED
                                 else {"reason": "NonZeroExit", "exit_code": 1})
                    for i, kind in ends
                ],
            )  # fmt: skip
        with transaction(sessions) as session:
            dispatches.record_terminal(session, ids["ended"], EventType.WORKER_FAILED, {"reason": "TooFewSucceeded"})
            maps.end_open_items(session, {ids["ended"]: (EventType.WORKER_FAILED, "TooFewSucceeded")})
    finally:
        engine.dispose()
    return ids


def _report(url: str, **kwargs: Any) -> Any:
    engine = make_engine(url)
    try:
        with transaction(make_sessionmaker(engine)) as session:
            return read_status(session, now=NOW, **kwargs)
    finally:
        engine.dispose()


def test_maps_in_progress_show_their_items_oldest_first_and_ended_ones_do_not(url: str) -> None:
    ids = populate(url)
    data = json.loads(json.dumps(_report(url).to_dict()))
    assert data["maps_pending"] == 2
    rows = data["maps_in_progress"]
    assert [m["dispatch_id"] for m in rows] == [ids["running"], ids["unmade"]]
    running, unmade = rows
    assert (running["capability"], running["state"], running["items"]) == ("cap.running", "CREATED", 6)
    assert (running["succeeded"], running["failed"], running["open"]) == (2, 1, 3)
    assert (running["running"], running["waiting"], running["running_at_most"]) == (None, None, 2)
    assert (unmade["state"], unmade["open"], unmade["running"], unmade["waiting"]) == ("SCHEDULED", 3, 0, 3)
    console = Console(width=160, record=True)
    console.print(render(_report(url)))
    text = console.export_text()
    table = text.split("maps in progress")[1].split("ended but the engine not told yet")[0]
    assert ids["running"] in table and ids["unmade"] in table and ids["ended"] not in table
    assert "3 (≤2 running)" in table and "3 waiting" in table and "more" not in table


def test_the_maps_listed_are_capped_and_the_rest_counted(url: str) -> None:
    ids = populate(url)
    report = _report(url, maps=1)
    assert [m.dispatch_id for m in report.maps] == [ids["running"]] and report.maps_pending == 2
    console = Console(width=160, record=True)
    console.print(render(report))
    assert "and 1 more" in console.export_text()
    assert _report(url, maps=0).maps == [] and _report(url, maps=0).maps_pending == 2


def test_no_map_no_maps_table(url: str) -> None:
    report = _report(url)
    assert (report.maps, report.maps_pending, report.to_dict()["maps_in_progress"]) == ([], 0, [])
    console = Console(width=160, record=True)
    console.print(render(report))
    assert "maps in progress" not in console.export_text()


def test_the_command_prints_the_maps_in_json_and_in_its_table(url: str) -> None:
    ids = populate(url)
    env = {k: v for k, v in os.environ.items() if not k.startswith("K8S_DISPATCH_")}
    env.update(K8S_DISPATCH_DATABASE_URL=url, COLUMNS="160")
    base = [sys.executable, "-m", "k8s_dispatch.cli", "status"]
    result = subprocess.run([*base, "--json"], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert [m["dispatch_id"] for m in json.loads(result.stdout)["maps_in_progress"]] == [ids["running"], ids["unmade"]]
    result = subprocess.run([*base, "--maps", "1"], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert ids["running"] in result.stdout and ids["unmade"] not in result.stdout and "and 1 more" in result.stdout
