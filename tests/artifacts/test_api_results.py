"""The engine's side: a recorded reference read through `k8s_dispatch.api` (streamed, or by a
short-lived URL) and deleted; no stored result is a typed error."""

from __future__ import annotations

import urllib.request
import uuid
from collections.abc import Callable

import pytest
from objectstore import ObjectStoreServer
from records import end, put, schedule
from sqlalchemy.engine import Engine

from k8s_dispatch import api
from k8s_dispatch.artifacts import Artifacts
from k8s_dispatch.core.settings import Settings, load_settings
from k8s_dispatch.store.db import make_sessionmaker
from k8s_dispatch.store.models import EventType


@pytest.fixture
def settings(object_store: ObjectStoreServer, unique_prefix: str) -> Settings:
    return load_settings(object_store.env(unique_prefix))


def test_the_engine_streams_gets_a_url_for_and_deletes_its_result(
    settings: Settings, pg_url: str, engine_factory: Callable[..., Engine]
) -> None:
    sessions = make_sessionmaker(engine_factory(pg_url))
    store = api.artifacts.for_settings(settings)
    assert isinstance(store, Artifacts)
    dispatch_id = schedule(sessions)
    data = uuid.uuid4().bytes * 40_000
    reference = put(store, dispatch_id, 0, data)
    with sessions() as session:
        assert api.stored_result(session, dispatch_id) is None  # running
        with pytest.raises(api.NoStoredResult):
            api.read_result(session, dispatch_id, settings=settings)
    end(sessions, dispatch_id, EventType.WORKER_COMPLETED, {"output": reference.to_output()})

    with sessions() as session:
        assert api.stored_result(session, dispatch_id) == reference
        assert b"".join(api.read_result(session, dispatch_id, settings=settings)) == data
        with urllib.request.urlopen(api.result_url(session, dispatch_id, settings=settings, expires_s=30)) as r:
            assert r.read() == data
        assert api.delete_result(session, dispatch_id, settings=settings) == reference
        with pytest.raises(api.ResultObjectMissing):
            b"".join(api.read_result(session, dispatch_id, settings=settings))


def test_a_small_or_failed_result_is_no_stored_result(pg_url: str, engine_factory: Callable[..., Engine]) -> None:
    sessions = make_sessionmaker(engine_factory(pg_url))
    small, failed = schedule(sessions), schedule(sessions)
    end(sessions, small, EventType.WORKER_COMPLETED, {"output": {"words": 3}})
    end(sessions, failed, EventType.WORKER_FAILED, {"reason": "ResultObjectMismatch"})
    with sessions() as session:
        for dispatch_id in (small, failed):
            assert api.stored_result(session, dispatch_id) is None
            with pytest.raises(api.NoStoredResult):
                api.result_url(session, dispatch_id)
