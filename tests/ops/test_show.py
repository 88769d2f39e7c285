"""`k8s-dispatch show`: a dispatch's story read from the database (PostgreSQL and SQLite), its
JSON and its text, and the command's exit code for an id it cannot show."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from datetime import timedelta

import pytest
from rich.console import Console

from k8s_dispatch.core.errors import InvalidId, UnknownDispatch
from k8s_dispatch.core.limits import Limits, TenancyLimit
from k8s_dispatch.ops.show import read_story, render
from k8s_dispatch.store import admission, dispatches, migrate, scheduling
from k8s_dispatch.store.db import database_now, make_engine, make_sessionmaker, transaction
from k8s_dispatch.store.disruptions import DisruptionEvent, record_disruptions
from k8s_dispatch.store.models import EventType


class Router:
    def worker_for(self, capability: str) -> str:
        return "w"


@pytest.fixture(params=["postgresql", "sqlite"])
def url(request, tmp_path) -> str:
    if request.param == "postgresql":
        url = request.getfixturevalue("new_pg_database")()
    else:
        url = f"sqlite:///{tmp_path / 'show.db'}"
    migrate.upgrade(url)
    return url


def _failed_dispatch(url: str) -> str:
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    try:
        with transaction(sessions) as session:
            scheduling.create_case(session, case_id="c1", tenancy_id="acme")
            dispatch_id = scheduling.schedule(
                session, case_id="c1", tenancy_id="acme", capability="cap", input={}, idempotency_key="k",
                router=Router(), max_input_bytes=1000,
            ).dispatch_id  # fmt: skip
        with transaction(sessions) as session:
            dispatches.mark_created(session, dispatch_id, job_name=f"kd-{dispatch_id}", namespace="jobs", attempt=0)
            event = {"pod_uid": "u1", "pod": "kd-x-aaaaa", "node": "n1", "reason": "EvictionByEvictionAPI"}
            record_disruptions(session, [DisruptionEvent(dispatch_id, event)])
        detail = {"exit_code": 137, "signal": "SIGKILL", "container_reason": "OOMKilled", "log_tail": "boom\n",
                  "events": [{"object": "Job/kd-x", "reason": "BackoffLimitExceeded", "message": "limit"}]}  # fmt: skip
        with transaction(sessions) as session:
            dispatches.record_terminal(
                session, dispatch_id, EventType.WORKER_FAILED, {"reason": "OOMKilled", "message": "m", "detail": detail}
            )
    finally:
        engine.dispose()
    return dispatch_id


def test_the_story_holds_events_disruptions_failure_and_timings(url: str) -> None:
    dispatch_id = _failed_dispatch(url)
    engine = make_engine(url)
    try:
        with transaction(make_sessionmaker(engine)) as session:
            story = read_story(session, dispatch_id)
            with pytest.raises(UnknownDispatch):
                read_story(session, str(uuid.uuid4()))
            with pytest.raises(InvalidId):
                read_story(session, "not-an-id")
    finally:
        engine.dispose()
    data = json.loads(json.dumps(story.to_dict()))
    assert [e["type"] for e in data["events"]] == ["WORKER_SCHEDULED", "WORKER_DISRUPTED", "WORKER_FAILED"]
    assert (data["state"], data["reason"], data["job"]) == ("FAILED", "OOMKilled", f"jobs/kd-{dispatch_id}")
    assert [d["pod"] for d in data["disruptions"]] == ["kd-x-aaaaa"]
    assert data["failure"]["exit_code"] == 137
    assert data["timings"]["total_s"] >= data["timings"]["ran_s"] >= 0
    console = Console(width=200, record=True)
    console.print(render(story))
    text = console.export_text()
    for shown in ("OOMKilled", "exit code 137 (SIGKILL)", "boom", "kd-x-aaaaa EvictionByEvictionAPI on node n1",
                  "Job/kd-x BackoffLimitExceeded: limit", "disruptions 1"):  # fmt: skip
        assert shown in text, text


def test_text_and_json_count_the_same_attempts(url: str) -> None:
    """One Job made: `attempts 1` in both (the row keeps the Job's attempt index, 0)."""
    engine = make_engine(url)
    try:
        with transaction(make_sessionmaker(engine)) as session:
            story = read_story(session, _failed_dispatch(url))
    finally:
        engine.dispose()
    console = Console(width=200, record=True)
    console.print(render(story))
    assert (story.to_dict()["attempts"], story.to_dict()["attempt"]) == (1, 0)
    assert "attempts 1 " in console.export_text()


def test_the_command_exits_3_for_an_id_it_cannot_show(url: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("K8S_DISPATCH_")}
    env["K8S_DISPATCH_DATABASE_URL"] = url
    for wrong in (str(uuid.uuid4()), "nope"):
        result = subprocess.run(
            [sys.executable, "-m", "k8s_dispatch.cli", "show", wrong], env=env, capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip
        assert result.returncode == 3 and "error: " in result.stderr, result.stderr


class LimitedRouter(Router):
    limits = Limits(tenancies={"acme": TenancyLimit(1)})


def test_a_queued_dispatch_shows_its_place_in_its_queue_and_an_admitted_one_its_wait(url) -> None:
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    try:
        with transaction(sessions) as session:
            scheduling.create_case(session, case_id="cq", tenancy_id="acme")
            first, second, urgent = (
                scheduling.schedule(
                    session, case_id="cq", tenancy_id="acme", capability="cap", input={"i": i},
                    idempotency_key=f"q{i}", router=LimitedRouter(), max_input_bytes=1000, priority=priority,
                    now=database_now(session) - timedelta(seconds=10 - i),  # first in: by time
                ).dispatch_id
                for i, priority in ((0, 0), (1, 0), (2, 9))
            )  # fmt: skip
        with transaction(sessions) as session:
            assert [read_story(session, d).place for d in (urgent, first, second)] == [1, 2, 3]
            admission.admit(session, LimitedRouter.limits, now=database_now(session))
        with transaction(sessions) as session:
            admitted, waiting = read_story(session, urgent), read_story(session, second)
    finally:
        engine.dispose()
    assert admitted.place is None and admitted.admitted_at is not None and admitted.priority == 9
    assert admitted.timings()["waited_for_slot_s"] is not None
    assert waiting.state == "QUEUED" and waiting.place == 2
    assert waiting.to_dict()["place_in_queue"] == 2
    console = Console(width=200, record=True)
    console.print(render(waiting))
    assert "place 2 in acme's queue for cap" in console.export_text()
