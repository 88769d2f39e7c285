"""One dispatch per transaction from many engine threads, on real PostgreSQL and Redis: their
commits share `create_jobs` messages (one producer for all), yet every committed dispatch is sent
exactly once, after its commit, and no rolled-back one ever is; and a one-dispatch transaction
writes its rows with two statements, the same rows as the general path's."""

from __future__ import annotations

import base64
import json
import threading
import uuid
from typing import Any

import redis
import sqlalchemy as sa
from sqlalchemy import event
from test_scheduling import new_case, request

from k8s_dispatch import celeryconfig
from k8s_dispatch.ops.processes import wait_until
from k8s_dispatch.store import dispatches, scheduling
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import CaseEvent, Dispatch
from k8s_dispatch.tasks.scheduling import CREATE_BATCH, schedule_in_session, schedule_many_in_session


def batches(client: redis.Redis, queue: str) -> list[list[str]]:
    messages = [json.loads(raw) for raw in reversed(client.lrange(queue, 0, -1))]
    assert all(m["headers"]["task"] == celeryconfig.CREATE_JOBS_TASK for m in messages)
    return [json.loads(base64.b64decode(m["body"]))[0][0] for m in messages]


class Rollback(Exception):
    pass


def test_eight_threads_committing_one_each_share_messages_and_send_each_commit_once(world):
    producer, _, sessions, client, queue = world
    case_id = new_case(sessions)
    committed: list[str] = []
    rolled_back: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def engine_thread(t: int) -> None:
        start.wait()
        for i in range(25):
            try:
                with transaction(sessions) as session:
                    result = schedule_in_session(session, via=producer, **request(case_id))
                    if (t + i) % 5 == 0:
                        raise Rollback  # the engine's own step failed
                with lock:
                    committed.append(result.dispatch_id)
            except Rollback:
                with lock:
                    rolled_back.append(result.dispatch_id)

    threads = [threading.Thread(target=engine_thread, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wait_until(
        lambda: sum(map(len, batches(client, queue))) >= len(committed), timeout=30, interval=0.05, what="all sent"
    )
    sent = [d for batch in batches(client, queue) for d in batch]
    assert sorted(sent) == sorted(committed), "every committed dispatch sent exactly once"
    assert not set(sent) & set(rolled_back) and rolled_back
    assert all(1 <= len(batch) <= CREATE_BATCH for batch in batches(client, queue))
    with transaction(sessions) as session:
        assert len(dispatches.get_dispatches(session, committed)) == len(committed)
        assert dispatches.get_dispatches(session, rolled_back) == {}


def test_a_one_dispatch_transaction_writes_the_general_paths_rows_with_two_statements(world):
    producer, engine, sessions, _, _ = world
    case_id = new_case(sessions)
    statements: list[str] = []

    def seen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement.split(None, 3)[:3][-1] if statement.startswith("INSERT") else statement[:20])

    with transaction(sessions) as session:  # the first measures the database's clock (once a minute)
        schedule_in_session(session, via=producer, **request(case_id))
    event.listen(engine, "before_cursor_execute", seen)
    try:
        with transaction(sessions) as session:
            one = schedule_in_session(session, via=producer, **request(case_id))
    finally:
        event.remove(engine, "before_cursor_execute", seen)
    assert statements == ["dispatches", "case_events"]  # BEGIN and COMMIT are not statements here
    two = request(case_id)
    router, limit = two.pop("router"), two.pop("max_input_bytes")
    with transaction(sessions) as session:  # two requests: the general path
        general, _ = schedule_many_in_session(
            session,
            [
                scheduling.ScheduleRequest(**two),
                scheduling.ScheduleRequest(**{**two, "idempotency_key": f"k-{uuid.uuid4()}"}),
            ],
            router=router,
            max_input_bytes=limit,
            via=producer,
        )

    def written(dispatch_id: str) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
        with transaction(sessions) as session:
            row = session.execute(sa.select(Dispatch.__table__).where(Dispatch.dispatch_id == dispatch_id)).one()
            events = session.execute(
                sa.select(CaseEvent.type, CaseEvent.payload).where(CaseEvent.dispatch_id == dispatch_id)
            ).all()
        different = {"dispatch_id", "idempotency_key", "created_at", "updated_at"}
        payloads = [(t, {k: v for k, v in p.items() if k != "idempotency_key"}) for t, p in events]
        return {k: v for k, v in row._mapping.items() if k not in different}, payloads

    assert written(one.dispatch_id) == written(general.dispatch_id)
