"""The chaos run's convergence waits on the fair-share slots: a dispatch that holds one is named
with what decides when it frees it (`slot_dispatches`), on a real PostgreSQL database: not
ended and admitted, or ended FAILED or CANCELLED with its Job not yet seen stopped."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest

from k8s_dispatch.lab.chaos.convergence import open_slots, slot_dispatches
from k8s_dispatch.store import dispatches, migrate, scheduling
from k8s_dispatch.store.db import make_sessionmaker, transaction
from k8s_dispatch.store.models import EventType


class _Router:
    def worker_for(self, capability: str) -> str:
        return "echo-worker"


@pytest.fixture
def sessions(new_pg_database: Callable[[], str], engine_factory: Callable[..., Any]) -> Any:
    url = new_pg_database()  # its own: every slot in it is this test's
    migrate.upgrade(url)
    return make_sessionmaker(engine_factory(url))


def _schedule(sessions: Any) -> str:
    case_id, tenancy_id = f"case-{uuid.uuid4().hex}", f"tenancy-{uuid.uuid4().hex[:12]}"
    with transaction(sessions) as session:
        scheduling.create_case(session, case_id=case_id, tenancy_id=tenancy_id)
        result = scheduling.schedule(
            session, case_id=case_id, tenancy_id=tenancy_id, capability="echo", input={"n": 1},
            idempotency_key=f"key-{uuid.uuid4().hex}", router=_Router(), max_input_bytes=1000,
        )  # fmt: skip
    return result.dispatch_id


def test_a_failed_dispatch_holds_its_slot_and_is_named_until_its_job_is_seen_stopped(sessions):
    failed, completed = _schedule(sessions), _schedule(sessions)
    with transaction(sessions) as session:
        for dispatch_id in (failed, completed):
            assert dispatches.mark_created(
                session, dispatch_id, job_name=f"kd-{dispatch_id}", namespace="ns", attempt=1
            )
    assert [h.dispatch_id for h in slot_dispatches(sessions)] == sorted([failed, completed])
    assert {h.state for h in slot_dispatches(sessions)} == {"CREATED"}

    with transaction(sessions) as session:
        assert dispatches.record_terminal(session, failed, EventType.WORKER_FAILED, {"reason": "BackoffLimitExceeded"})
        assert dispatches.record_terminal(session, completed, EventType.WORKER_COMPLETED, {"output": {}})
    (held,) = slot_dispatches(sessions)  # a completion's slot is free at once
    assert (held.dispatch_id, held.state, held.reason) == (failed, "FAILED", "BackoffLimitExceeded")
    assert held.job_created_at is not None and held.finished_at is not None
    assert failed in held.describe() and "FAILED BackoffLimitExceeded" in held.describe()
    assert open_slots(sessions) == (1, 0)

    with transaction(sessions) as session:
        assert dispatches.mark_jobs_stopped(session, [failed]) == {failed}
    assert slot_dispatches(sessions) == [] and open_slots(sessions) == (0, 0)
