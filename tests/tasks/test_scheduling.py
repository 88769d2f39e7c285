"""`schedule_in_session` / `schedule_many_in_session`: the dispatches are written in the caller's
transaction and `create_jobs` is sent only after that transaction commits, CREATE_BATCH
dispatches per message: never for a rollback, never before the rows are visible."""

from __future__ import annotations

import base64
import json
import math
import uuid

import pytest
import redis

from k8s_dispatch import celeryconfig
from k8s_dispatch.core.errors import UnknownCapability
from k8s_dispatch.store import dispatches, scheduling
from k8s_dispatch.store.db import transaction
from k8s_dispatch.tasks.scheduling import CREATE_BATCH, schedule_in_session, schedule_many_in_session
from k8s_dispatch.workers.resolver import demo_resolver


def batches(client: redis.Redis, queue: str) -> list[list[str]]:
    """The dispatch ids of each create_jobs message in the queue, oldest first."""
    messages = [json.loads(raw) for raw in reversed(client.lrange(queue, 0, -1))]  # LPUSHed
    assert all(m["headers"]["task"] == celeryconfig.CREATE_JOBS_TASK for m in messages)
    return [json.loads(base64.b64decode(m["body"]))[0][0] for m in messages]


def sent(client: redis.Redis, queue: str) -> list[str]:
    """The dispatch ids sent, in all the create_jobs messages in the queue."""
    return [dispatch_id for batch in batches(client, queue) for dispatch_id in batch]


def request(case_id: str, **overrides):
    return {
        "case_id": case_id,
        "tenancy_id": "tenant-a",
        "capability": "demo.wordcount",
        "input": {"text": "a b"},
        "idempotency_key": f"key-{uuid.uuid4()}",
        "router": demo_resolver(),
        "max_input_bytes": 1024,
        **overrides,
    }


def new_case(sessions) -> str:
    case_id = f"case-{uuid.uuid4().hex[:8]}"
    with transaction(sessions) as session:
        scheduling.create_case(session, case_id=case_id, tenancy_id="tenant-a")
    return case_id


def test_create_job_is_sent_once_the_transaction_commits(world):
    producer, _, sessions, client, queue = world
    case_id = new_case(sessions)
    with transaction(sessions) as session:
        first = schedule_in_session(session, via=producer, **request(case_id))
        second = schedule_in_session(session, via=producer, **request(case_id))
        assert sent(client, queue) == []  # nothing before the commit
    assert sorted(sent(client, queue)) == sorted([first.dispatch_id, second.dispatch_id])


def test_nothing_is_sent_when_the_transaction_rolls_back(world):
    producer, _, sessions, client, queue = world
    case_id = new_case(sessions)
    with pytest.raises(RuntimeError), transaction(sessions) as session:
        result = schedule_in_session(session, via=producer, **request(case_id))
        raise RuntimeError("the engine's own step failed")
    assert sent(client, queue) == []
    with transaction(sessions) as session:
        assert dispatches.get_dispatch(session, result.dispatch_id) is None
    # The same session factory, a later transaction: only its own dispatch is sent.
    with transaction(sessions) as session:
        later = schedule_in_session(session, via=producer, **request(case_id))
    assert sent(client, queue) == [later.dispatch_id]


def test_a_rolled_back_savepoint_takes_only_its_own_dispatches(world):
    producer, _, sessions, client, queue = world
    case_id = new_case(sessions)
    with transaction(sessions) as session:
        kept = schedule_in_session(session, via=producer, **request(case_id))
        savepoint = session.begin_nested()
        dropped = schedule_in_session(session, via=producer, **request(case_id))
        savepoint.rollback()
        with session.begin_nested():  # released: its dispatch belongs to the transaction
            also_kept = schedule_in_session(session, via=producer, **request(case_id))
        assert sent(client, queue) == []
    assert sorted(sent(client, queue)) == sorted([kept.dispatch_id, also_kept.dispatch_id])
    with transaction(sessions) as session:
        assert dispatches.get_dispatch(session, dropped.dispatch_id) is None


def test_a_repeated_request_is_one_dispatch_and_a_bad_one_writes_nothing(world):
    producer, _, sessions, client, queue = world
    case_id = new_case(sessions)
    same = request(case_id)
    with transaction(sessions) as session:
        first = schedule_in_session(session, via=producer, **same)
    with transaction(sessions) as session:
        again = schedule_in_session(session, via=producer, **same)
    assert (again.dispatch_id, again.created) == (first.dispatch_id, False)
    with pytest.raises(UnknownCapability), transaction(sessions) as session:
        schedule_in_session(session, via=producer, **request(case_id, capability="no.such"))
    # Sent again for the repeat (create_job is idempotent; a lost first message is covered).
    assert sent(client, queue) == [first.dispatch_id, first.dispatch_id]


def test_a_transaction_of_60_dispatches_is_sent_in_batches_after_its_commit(world):
    producer, _, sessions, client, queue = world
    case_id = new_case(sessions)
    router = demo_resolver()

    def requests(n: int) -> list[scheduling.ScheduleRequest]:
        return [
            scheduling.ScheduleRequest(case_id, "tenant-a", "demo.wordcount", {"i": i}, f"key-{uuid.uuid4()}")
            for i in range(n)
        ]

    with pytest.raises(RuntimeError), transaction(sessions) as session:
        schedule_many_in_session(session, requests(30), router=router, max_input_bytes=1024, via=producer)
        raise RuntimeError("the engine's own step failed")
    assert sent(client, queue) == []

    with transaction(sessions) as session:
        many = schedule_many_in_session(session, requests(49), router=router, max_input_bytes=1024, via=producer)
        savepoint = session.begin_nested()
        dropped = schedule_many_in_session(session, requests(5), router=router, max_input_bytes=1024, via=producer)
        savepoint.rollback()
        with session.begin_nested():
            nested = schedule_many_in_session(session, requests(10), router=router, max_input_bytes=1024, via=producer)
        one = schedule_in_session(session, via=producer, **request(case_id))
        assert sent(client, queue) == []
    expected = [r.dispatch_id for r in many + nested] + [one.dispatch_id]
    assert len(expected) == 60
    assert [len(b) for b in batches(client, queue)] == [CREATE_BATCH] * (60 // CREATE_BATCH) + [60 % CREATE_BATCH]
    assert len(batches(client, queue)) == math.ceil(60 / CREATE_BATCH) >= 2
    assert sent(client, queue) == expected
    with transaction(sessions) as session:
        assert dispatches.get_dispatches(session, [r.dispatch_id for r in dropped]) == {}
        assert len(dispatches.get_dispatches(session, expected)) == 60
