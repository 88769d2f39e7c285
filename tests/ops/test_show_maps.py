"""`k8s-dispatch show` of a map dispatch (PostgreSQL and SQLite): its items' progress and its first
failed items with reason, message and exit code, then how many more; its own events without its
items'; the same as JSON; and a dispatch that is not a map shows no map at all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from map_databases import STORES, Router, migrated_url
from rich.console import Console

from k8s_dispatch.ops.show import read_story, render
from k8s_dispatch.store import dispatches, maps, scheduling
from k8s_dispatch.store.db import make_engine, make_sessionmaker, transaction
from k8s_dispatch.store.models import EventType, ItemEventType

TRACEBACK = 'Traceback (most recent call last):\n  File "/app/run.py", line 3, in <module>\nValueError: bad row 7\n'


@pytest.fixture(params=STORES)
def url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    return migrated_url(request, tmp_path / "show-maps.db")


def _map(url: str, *, items: int, ends: list[maps.ItemEnd] | None = None, created: bool = True) -> str:
    """A map of `items` items, its Job made (or not), and these item ends (their dispatch id is
    filled in)."""
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    try:
        with transaction(sessions) as session:
            scheduling.create_case(session, case_id="cm", tenancy_id="acme")
            request = maps.MapRequest(
                case_id="cm", tenancy_id="acme", capability="cap", items=[{"n": i} for i in range(items)],
                idempotency_key=f"m-{items}-{created}", parallelism=4, max_failed_items=items,
            )  # fmt: skip
            dispatch_id = maps.schedule_map(session, request, router=Router(), max_input_bytes=1000).dispatch_id
        if created:
            with transaction(sessions) as session:
                dispatches.mark_created(session, dispatch_id, job_name=f"kd-{dispatch_id}", namespace="jobs", attempt=0)
        for end in ends or []:  # one transaction each: they end in this order
            with transaction(sessions) as session:
                maps.record_item_ends(session, [maps.ItemEnd(dispatch_id, end.item_index, end.type, end.payload)])
    finally:
        engine.dispose()
    return dispatch_id


def _failed(index: int, reason: str, **more: object) -> maps.ItemEnd:
    return maps.ItemEnd("", index, ItemEventType.ITEM_FAILED, {"reason": reason, **more})


def _done(index: int) -> maps.ItemEnd:
    return maps.ItemEnd("", index, ItemEventType.ITEM_COMPLETED, {"output": {"n": index}})


def _story(url: str, dispatch_id: str, **kwargs: Any) -> Any:
    engine = make_engine(url)
    try:
        with transaction(make_sessionmaker(engine)) as session:
            return read_story(session, dispatch_id, **kwargs)
    finally:
        engine.dispose()


def _text(story: Any) -> str:
    console = Console(width=200, record=True)
    console.print(render(story))
    return console.export_text()


def test_a_map_shows_its_progress_and_its_failed_items_with_their_reasons(url: str) -> None:
    ends = [
        _done(0),
        _failed(5, "NonZeroExit", exit_code=3, message=TRACEBACK),
        _done(1),
        _failed(2, "OOMKilled", exit_code=137),
        _failed(9, "ResultNotJson", message="x" * 500),
    ]
    dispatch_id = _map(url, items=12, ends=ends)
    story = _story(url, dispatch_id, failed_items=2)
    data = json.loads(json.dumps(story.to_dict()))
    progress = data["map"]
    assert (progress["items"], progress["succeeded"], progress["failed"], progress["open"]) == (12, 2, 3, 7)
    assert (progress["running"], progress["waiting"], progress["running_at_most"]) == (None, None, 4)
    # The first failures, in the order they failed, then how many more.
    assert [(f["index"], f["reason"], f["exit_code"]) for f in progress["failed_items"]] == [
        (5, "NonZeroExit", 3),
        (2, "OOMKilled", 137),
    ]
    assert progress["failed_items"][0]["message"] == "ValueError: bad row 7"
    assert progress["failed_items_not_shown"] == 1
    # Its own events only: the items' are counted above (and are the engine's, item by item).
    assert [e["type"] for e in data["events"]] == [EventType.WORKER_SCHEDULED.value]
    text = _text(story)
    for shown in ("map: 12 items, parallelism 4", "2 of 12 succeeded, 3 failed, 7 open (at most 4 running",
                  "NonZeroExit", "ValueError: bad row 7", "OOMKilled", "137", "and 1 more failed items"):  # fmt: skip
        assert shown in text, text
    assert "WORKER_ITEM" not in text


def test_a_long_item_message_is_cut_short(url: str) -> None:
    dispatch_id = _map(url, items=2, ends=[_failed(1, "ResultNotJson", message="word " * 200)])
    story = _story(url, dispatch_id)
    (failure,) = story.to_dict()["map"]["failed_items"]
    assert len(failure["message"]) <= 200 and failure["message"].endswith("...")
    assert story.to_dict()["map"]["failed_items_not_shown"] == 0
    assert "more failed items" not in _text(story)


def test_a_map_with_no_job_yet_has_every_open_item_waiting(url: str) -> None:
    story = _story(url, _map(url, items=3, created=False))
    progress = story.to_dict()["map"]
    assert (progress["open"], progress["running"], progress["waiting"]) == (3, 0, 3)
    assert progress["failed_items"] == []
    assert "3 open (all waiting: no Job yet)" in _text(story)


def test_an_ended_map_shows_its_end_and_no_item_open(url: str) -> None:
    dispatch_id = _map(url, items=3, ends=[_done(0)])
    engine = make_engine(url)
    try:
        with transaction(make_sessionmaker(engine)) as session:
            dispatches.record_terminal(session, dispatch_id, EventType.WORKER_FAILED, {"reason": "TooFewSucceeded"})
            maps.end_open_items(session, {dispatch_id: (EventType.WORKER_FAILED, "TooFewSucceeded")})
    finally:
        engine.dispose()
    story = _story(url, dispatch_id)
    progress = story.to_dict()["map"]
    assert (progress["succeeded"], progress["failed"], progress["open"], progress["running"]) == (1, 2, 0, 0)
    assert {f["reason"] for f in progress["failed_items"]} == {"TooFewSucceeded"}
    assert [e["type"] for e in story.to_dict()["events"]] == ["WORKER_SCHEDULED", "WORKER_FAILED"]
    assert "1 of 3 succeeded, 2 failed, 0 open" in _text(story)


def test_a_dispatch_that_is_not_a_map_has_no_map_in_its_story(url: str) -> None:
    engine = make_engine(url)
    try:
        with transaction(make_sessionmaker(engine)) as session:
            scheduling.create_case(session, case_id="c1", tenancy_id="acme")
            dispatch_id = scheduling.schedule(
                session, case_id="c1", tenancy_id="acme", capability="cap", input={}, idempotency_key="k",
                router=Router(), max_input_bytes=1000,
            ).dispatch_id  # fmt: skip
    finally:
        engine.dispose()
    story = _story(url, dispatch_id)
    assert story.map is None and "map" not in story.to_dict()
    assert "items:" not in _text(story) and "map:" not in _text(story)


def test_the_command_prints_the_map_as_json(url: str) -> None:
    dispatch_id = _map(url, items=4, ends=[_failed(3, "NonZeroExit", exit_code=1), _failed(0, "NonZeroExit")])
    env = {k: v for k, v in os.environ.items() if not k.startswith("K8S_DISPATCH_")}
    env["K8S_DISPATCH_DATABASE_URL"] = url
    command = [sys.executable, "-m", "k8s_dispatch.cli", "show", dispatch_id, "--json", "--failed-items", "1"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    progress = json.loads(result.stdout)["map"]
    assert [f["index"] for f in progress["failed_items"]] == [3]
    assert (progress["failed"], progress["failed_items_not_shown"], progress["open"]) == (2, 1, 2)
