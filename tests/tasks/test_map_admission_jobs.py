"""A map admitted by a pass (`tasks.admission.run_pass`) gets an Indexed Job whose parallelism is
the room it was granted, not what it asked: on real PostgreSQL and localcluster, the limit holds
in Pods, and the pass's counts (`status`, the tenancy gauges) show the slots the map holds."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any, cast

import pytest
from celery import Celery

from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.demo.localcluster import LocalCluster
from k8s_dispatch.store import admission, maps, scheduling
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import DispatchState
from k8s_dispatch.tasks.admission import run_pass
from k8s_dispatch.workers.manifest import job_name
from tests.tasks.test_admission_creates import Broker, admission_runtime

SIM = "localcluster.k8s-dispatch.io/"
CAPABILITIES = {
    "capabilities": {"sim.hang": {"worker": "sim", "image": "sim:1", "annotations": {SIM + "outcome": "hang"}}},
    "limits": {"tenancies": {"tenant-l": {"maxRunning": 3}}},
}


@pytest.fixture
def rt(sim_cluster: LocalCluster, new_pg_database: Any, redis_url: str, key_prefix: str) -> Iterator[Runtime]:
    with admission_runtime(sim_cluster, new_pg_database, redis_url, key_prefix, CAPABILITIES) as runtime:
        yield runtime


def test_a_map_admitted_into_the_room_left_runs_its_job_at_that_parallelism(rt: Runtime) -> None:
    case_id = f"case-{uuid.uuid4().hex[:8]}"
    with transaction(rt.sessions) as session:
        scheduling.create_case(session, case_id=case_id, tenancy_id="tenant-l")
        single = scheduling.schedule(
            session, case_id=case_id, tenancy_id="tenant-l", capability="sim.hang", input={"i": 0},
            idempotency_key=f"key-{uuid.uuid4()}", router=rt.resolver, max_input_bytes=rt.settings.max_input_bytes,
        ).dispatch_id  # fmt: skip
    broker = Broker()
    assert [a.dispatch_id for a in run_pass(rt, cast(Celery, broker))] == [single]
    with transaction(rt.sessions) as session:
        request = maps.MapRequest(
            case_id, "tenant-l", "sim.hang", [{"n": i} for i in range(6)], f"map-{uuid.uuid4()}", parallelism=5
        )
        scheduled = maps.schedule_map(session, request, router=rt.resolver, max_input_bytes=rt.settings.max_input_bytes)
    assert scheduled.state is DispatchState.QUEUED
    wide = scheduled.dispatch_id

    (admitted,) = run_pass(rt, cast(Celery, broker))

    assert (admitted.dispatch_id, admitted.parallelism) == (wide, 2)
    job = rt.kube.get_job(rt.settings.namespace, job_name(wide))
    assert (job["spec"]["completions"], job["spec"]["parallelism"]) == (6, 2)  # 1 + 2 Pods: the limit of 3
    with transaction(rt.sessions) as session:
        assert admission.by_tenancy(admission.summary(session)) == {"tenant-l": (3, 0)}
    assert broker.sent == []
