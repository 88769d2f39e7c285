"""The past-deadline count the sweep gives the gauge under the poll by watch, from the database:
created, unended dispatches whose Job is older than their capability's deadline plus the slack;
no deadline, or a queue (Kueue: its clock starts at admission), is never counted."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from runtimes import runtime_values

from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.recovery import deadlines
from k8s_dispatch.store import dispatches, scheduling
from k8s_dispatch.store.db import database_now, transaction
from k8s_dispatch.store.models import EventType

TAG = uuid.uuid4().hex[:8]  # the capabilities are this module's alone: the database is shared
TIMED, UNTIMED, QUEUED = f"dl{TAG}.timed", f"dl{TAG}.untimed", f"dl{TAG}.kueue"
CAPABILITIES = {
    "capabilities": {
        TIMED: {"worker": "w", "image": "i:1", "activeDeadlineSeconds": 60},
        UNTIMED: {"worker": "w", "image": "i:1", "activeDeadlineSeconds": None},
        QUEUED: {"worker": "w", "image": "i:1", "activeDeadlineSeconds": 60, "queue": "lq"},
    }
}


@pytest.fixture
def runtime_env(sim_cluster, pg_url, redis_url, key_prefix, tmp_path) -> dict[str, str]:
    return runtime_values(
        database_url=pg_url, redis_url=redis_url, prefix=f"{key_prefix}-deadlines", namespace="dl",
        kubeconfig=sim_cluster.kubeconfig, capabilities=CAPABILITIES, tmp=tmp_path,
    )  # fmt: skip


def created(rt: Runtime, capability: str, *, minutes_ago: float) -> str:
    case_id = f"case-{uuid.uuid4().hex[:8]}"
    with transaction(rt.sessions) as session:
        scheduling.create_case(session, case_id=case_id, tenancy_id="t")
        dispatch_id = scheduling.schedule(
            session, case_id=case_id, tenancy_id="t", capability=capability, input={}, idempotency_key=case_id,
            router=rt.resolver, max_input_bytes=1000,
        ).dispatch_id  # fmt: skip
        dispatches.mark_created(
            session, dispatch_id, job_name=f"kd-{dispatch_id}", namespace="dl", attempt=0,
            now=database_now(session) - timedelta(minutes=minutes_ago),
        )  # fmt: skip
    return dispatch_id


def test_only_created_dispatches_past_deadline_and_slack_are_counted(rt: Runtime) -> None:
    assert deadlines.past_deadline(rt) == 0
    late = created(rt, TIMED, minutes_ago=10)  # 60 s deadline + 120 s slack: long past
    created(rt, TIMED, minutes_ago=2)  # 120 s: within deadline + slack
    created(rt, UNTIMED, minutes_ago=600)
    created(rt, QUEUED, minutes_ago=600)
    assert deadlines.past_deadline(rt) == 1
    with transaction(rt.sessions) as session:
        dispatches.record_terminal(session, late, EventType.WORKER_FAILED, {"reason": "DeadlineExceeded"})
    assert deadlines.past_deadline(rt) == 0  # ended: the controller did its part
