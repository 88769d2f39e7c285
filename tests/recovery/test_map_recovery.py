"""A map's Job lost after every item had ended (real PostgreSQL, Redis, localcluster; the sweep
in-process): the sweep ends the map with its one terminal event, counting its items, and makes
no Job (there is nothing left to run)."""

from __future__ import annotations

import json
import uuid

import pytest
from runtimes import own_database_values

from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.recovery.plan import Category
from k8s_dispatch.recovery.sweep import run_sweep
from k8s_dispatch.store import dispatches, maps, scheduling
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import DispatchState, EventType, ItemEventType
from k8s_dispatch.workers import indexed
from k8s_dispatch.workers.manifest import job_name

CAPABILITIES = {"capabilities": {"sim.map": {"worker": "sim", "image": "sim:1", "backoffLimit": 0}}}


@pytest.fixture
def runtime_env(sim_cluster, new_pg_database, redis_url, key_prefix, tmp_path) -> dict[str, str]:
    return own_database_values(
        cluster=sim_cluster, new_pg_database=new_pg_database, redis_url=redis_url, key_prefix=key_prefix,
        tmp=tmp_path, namespace="mr", capabilities=CAPABILITIES, sweep_grace_s="0",
    )  # fmt: skip


def lost_map(rt: Runtime, items: int, ends: list[tuple[int, ItemEventType]], **shape: int | None) -> str:
    """A map of `items` marked created (its Job made once, then lost) with `ends` recorded."""
    case_id = f"case-{uuid.uuid4().hex[:8]}"
    with transaction(rt.sessions) as session:
        scheduling.create_case(session, case_id=case_id, tenancy_id="tenant-a")
        request = maps.MapRequest(
            case_id=case_id, tenancy_id="tenant-a", capability="sim.map", items=[{"n": i} for i in range(items)],
            idempotency_key=f"map-{uuid.uuid4().hex}", parallelism=2, **shape,
        )  # fmt: skip
        map_id = maps.schedule_map(
            session, request, router=rt.resolver, max_input_bytes=rt.settings.max_input_bytes
        ).dispatch_id
    item_ends = [
        maps.ItemEnd(map_id, i, kind, {"output": i} if kind is ItemEventType.ITEM_COMPLETED else {"reason": "X"})
        for i, kind in ends
    ]
    with transaction(rt.sessions) as session:
        dispatches.mark_created_many(
            session, [dispatches.CreatedJob(map_id, job_name(map_id), rt.settings.namespace, 0)]
        )
        maps.record_item_ends(session, item_ends)
    return map_id


def map_with_every_item_ended(rt: Runtime, *, min_succeeded: int | None) -> str:
    """Items 0 and 2 of 3 succeeded, 1 failed."""
    ok, failed = ItemEventType.ITEM_COMPLETED, ItemEventType.ITEM_FAILED
    return lost_map(rt, 3, [(0, ok), (1, failed), (2, ok)], min_succeeded=min_succeeded)


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


def test_a_lost_map_job_is_made_again_for_its_open_items_within_the_failures_left(rt: Runtime) -> None:
    ok, failed = ItemEventType.ITEM_COMPLETED, ItemEventType.ITEM_FAILED
    map_id = lost_map(rt, 6, [(0, ok), (1, failed), (2, ok), (4, ok)], max_failed_items=4)
    report = run_sweep(rt)
    assert report.categories[Category.JOB_LOST].acted == 1 and report.errors == 0
    job = rt.kube.get_job(rt.settings.namespace, job_name(map_id))
    assert indexed.item_indexes(job) == [3, 5] and job["spec"]["completions"] == 2
    assert job["spec"]["maxFailedIndexes"] == 2  # 3 failures left, no more than the Job's items
    assert json.loads(job["spec"]["template"]["spec"]["containers"][0]["env"][-1]["value"]) == [{"n": 3}, {"n": 5}]
