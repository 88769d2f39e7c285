"""Orphans and retention against a real object store and database: only a dispatch's recorded
result outlives its dispatch; a running dispatch's objects are never touched."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta

import pytest
from objectstore import ObjectStoreServer
from records import end, put, schedule
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from k8s_dispatch.artifacts import Artifacts
from k8s_dispatch.artifacts.cleanup import clean
from k8s_dispatch.core.settings import load_settings
from k8s_dispatch.store.db import make_sessionmaker
from k8s_dispatch.store.models import EventType, utcnow


@pytest.fixture
def sessions(pg_url: str, engine_factory: Callable[..., Engine]) -> sessionmaker[Session]:
    return make_sessionmaker(engine_factory(pg_url))


@pytest.fixture
def artifacts(object_store: ObjectStoreServer, unique_prefix: str) -> Artifacts:
    built = Artifacts.from_settings(load_settings(object_store.env(unique_prefix)))
    assert built is not None
    return replace(built, orphan_grace_s=0)


def test_only_recorded_results_outlive_their_dispatch(artifacts: Artifacts, sessions: sessionmaker[Session]) -> None:
    completed, cancelled, failed, running = (schedule(sessions) for _ in range(4))
    losing = put(artifacts, completed, 0, b"attempt 0, a Job re-created since")
    recorded = put(artifacts, completed, 1, b"attempt 1, delivered")
    end(sessions, completed, EventType.WORKER_COMPLETED, {"output": recorded.to_output()})
    cancelled_object = put(artifacts, cancelled, 0, b"uploaded, then cancelled")
    end(sessions, cancelled, EventType.WORKER_CANCELLED, {"reason": "Cancelled"})
    refused = put(artifacts, failed, 0, b"refused by verification")
    end(sessions, failed, EventType.WORKER_FAILED, {"reason": "ResultObjectMismatch"})
    in_flight = put(artifacts, running, 0, b"an attempt still running")
    stranger = put(artifacts, str(uuid.uuid4()), 0, b"no dispatch row at all")
    artifacts.store.put(f"{artifacts.prefix}/not-our-layout", b"?")

    waiting = clean(replace(artifacts, orphan_grace_s=3600), sessions)
    assert (waiting.orphans_deleted, waiting.orphans_waiting, waiting.kept) == (0, 5, 2)

    report = clean(artifacts, sessions)

    assert sorted(report.deleted_keys) == sorted(
        [losing.key, cancelled_object.key, refused.key, stranger.key, f"{artifacts.prefix}/not-our-layout"]
    )
    assert report.to_dict() == {
        "listed": 7,
        "kept": 2,
        "orphans_deleted": 5,
        "expired_deleted": 0,
        "orphans_waiting": 0,
    }
    remaining = sorted(item.key for item in artifacts.store.list(artifacts.prefix + "/"))
    assert remaining == sorted([recorded.key, in_flight.key])
    assert clean(artifacts, sessions).orphans_deleted == 0  # a second run finds nothing more


def test_retention_deletes_recorded_results_older_than_its_days(
    artifacts: Artifacts, sessions: sessionmaker[Session]
) -> None:
    dispatch_id = schedule(sessions)
    recorded = put(artifacts, dispatch_id, 0, b"kept for a day")
    end(sessions, dispatch_id, EventType.WORKER_COMPLETED, {"output": recorded.to_output()})
    kept = replace(artifacts, retention_days=1)

    assert clean(kept, sessions, now=utcnow() + timedelta(hours=23)).expired_deleted == 0
    assert clean(replace(artifacts, retention_days=0), sessions, now=utcnow() + timedelta(days=400)).kept == 1
    report = clean(kept, sessions, now=utcnow() + timedelta(days=1, minutes=1))

    assert report.deleted_keys == [recorded.key]
    assert artifacts.store.size(recorded.key) is None
