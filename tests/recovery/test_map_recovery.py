"""A map's Job lost after every item had ended (real PostgreSQL, Redis, localcluster; the sweep
in-process): the sweep ends the map with its one terminal event, counting its items, and makes
no Job (there is nothing left to run)."""

from __future__ import annotations

import uuid

import pytest
from runtimes import runtime_values

from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.recovery.plan import Category
from k8s_dispatch.recovery.sweep import run_sweep
from k8s_dispatch.store import dispatches, maps, migrate, scheduling
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import DispatchState, EventType, ItemEventType
from k8s_dispatch.workers.manifest import job_name

CAPABILITIES = {"capabilities": {"sim.map": {"worker": "sim", "image": "sim:1", "backoffLimit": 0}}}


@pytest.fixture
def runtime_env(sim_cluster, new_pg_database, redis_url, key_prefix, tmp_path) -> dict[str, str]:
    database_url = new_pg_database()
    migrate.upgrade(database_url)
    return runtime_values(
        database_url=database_url, redis_url=redis_url, prefix=f"{key_prefix}-{uuid.uuid4().hex[:8]}",
        namespace=f"mr-{uuid.uuid4().hex[:8]}", kubeconfig=sim_cluster.kubeconfig, capabilities=CAPABILITIES,
        tmp=tmp_path, sweep_grace_s="0",
    )  # fmt: skip


def map_with_every_item_ended(rt: Runtime, *, min_succeeded: int | None) -> str:
    """A map of 3 items marked created (its Job made once, then lost) with items 0 and 2
    succeeded and 1 failed."""
    case_id = f"case-{uuid.uuid4().hex[:8]}"
    with transaction(rt.sessions) as session:
        scheduling.create_case(session, case_id=case_id, tenancy_id="tenant-a")
        request = maps.MapRequest(
            case_id=case_id, tenancy_id="tenant-a", capability="sim.map", items=[{"n": i} for i in range(3)],
            idempotency_key=f"map-{uuid.uuid4().hex}", parallelism=2, min_succeeded=min_succeeded,
        )  # fmt: skip
        map_id = maps.schedule_map(
            session, request, router=rt.resolver, max_input_bytes=rt.settings.max_input_bytes
        ).dispatch_id
    ends = [
        maps.ItemEnd(map_id, 0, ItemEventType.ITEM_COMPLETED, {"output": 0}),
        maps.ItemEnd(map_id, 1, ItemEventType.ITEM_FAILED, {"reason": "ContainerFailed"}),
        maps.ItemEnd(map_id, 2, ItemEventType.ITEM_COMPLETED, {"output": 2}),
    ]
    with transaction(rt.sessions) as session:
        dispatches.mark_created_many(
            session, [dispatches.CreatedJob(map_id, job_name(map_id), rt.settings.namespace, 0)]
        )
        maps.record_item_ends(session, ends)
    return map_id


@pytest.mark.parametrize(("min_succeeded", "event"), [(2, EventType.WORKER_COMPLETED), (None, EventType.WORKER_FAILED)])
def test_a_lost_map_job_whose_items_all_ended_ends_the_map_without_a_job(rt: Runtime, min_succeeded, event) -> None:
    map_id = map_with_every_item_ended(rt, min_succeeded=min_succeeded)
    report = run_sweep(rt)
    assert report.categories[Category.JOB_LOST].acted == 1 and report.errors == 0
    with transaction(rt.sessions) as session:
        row = dispatches.get_dispatch(session, map_id)
        ended = [e for e in dispatches.events_for(session, map_id) if e.type == event.value]
    assert row is not None and row.state is not DispatchState.CREATED and len(ended) == 1
    summary = {"items": 3, "succeeded": 2, "failed": 1, "needed": min_succeeded or 3}
    assert ended[0].payload.get("output", ended[0].payload.get("detail")) == summary
    assert not [page for page in rt.kube.iter_jobs(rt.settings.namespace, label_selector="") if page]  # no Job made
    run_sweep(rt)  # and nothing more
    with transaction(rt.sessions) as session:
        assert len([e for e in dispatches.events_for(session, map_id) if e.type == event.value]) == 1
