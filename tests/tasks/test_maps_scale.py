"""Fan-out at scale (issue 29's proof), with real `celery -A k8s_dispatch.tasks worker|beat`
processes, PostgreSQL, Redis and localcluster: a map over 1,000 items of 1 s, some failing by design, at parallelism 50; the
worker and beat are SIGKILLed mid-map and the broker loses every key of the run. Every item still
ends in exactly one item event with its own output or its failure's reason, the map in one
terminal event with its counts, and no Job or Pod holding our finalizer is left. The same
checks on 20 items run on both clusters (tests/tasks/test_maps.py); at 1,000 the real control
plane with our node agent took over 300 s here (2 shared cores), so this proof is localcluster's.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from typing import Any

import pytest

from k8s_dispatch import api
from k8s_dispatch.store import dispatches
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import EventType
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.manifest import FINALIZER
from k8s_dispatch.workers.resolver import CapabilityResolver

SIM = "localcluster.k8s-dispatch.io/"
ITEMS = 1_000
FAILING = frozenset(range(13, ITEMS, 50))  # 20 items exit 2, spread over the whole map
PARALLELISM = 50


def capability() -> dict[str, Any]:
    """Each index's Pod returns {"i": index} after 1 s; the FAILING ones exit 2, saying why."""
    by_index = {
        str(i): {"outcome": "fail", "exit-code": "2", "log": f"bad item {i}\n"}
        if i in FAILING
        else {"result": {"i": i}}
        for i in range(ITEMS)
    }
    return {
        "worker": "sim",
        "image": "sim:1",
        "backoffLimit": 0,
        "annotations": {SIM + "duration-ms": "1000", SIM + "by-index": json.dumps(by_index, separators=(",", ":"))},
    }


def schedule_map(d: Any) -> str:
    with transaction(d.sessions) as session:
        case_id = f"case-{uuid.uuid4().hex[:10]}"
        api.create_case(session, case_id=case_id, tenancy_id="tenant-a")
        return api.schedule_map_in_session(
            session,
            case_id=case_id,
            tenancy_id="tenant-a",
            capability="sim.map",
            items=[{"n": i} for i in range(ITEMS)],
            idempotency_key=f"map-{uuid.uuid4().hex}",
            parallelism=PARALLELISM,
            min_succeeded=ITEMS - len(FAILING),
            router=CapabilityResolver.from_settings(d.settings),
            max_input_bytes=d.settings.max_input_bytes,
            via=d.producer,
        ).dispatch_id


def items_of(d: Any, map_id: str) -> list[api.ItemOutcome]:
    with transaction(d.sessions) as session:
        return api.item_outcomes(session, map_id)


def held_pods(d: Any) -> list[str]:
    pods = d.kube.list_pods(d.namespace, label_selector=job_labels.selector())
    return [p["metadata"]["name"] for p in pods if FINALIZER in (p["metadata"].get("finalizers") or [])]


@pytest.mark.timeout(480)  # ~40 s on an idle machine; the shared one's load stretches it fourfold
def test_a_map_of_a_thousand_items_survives_a_worker_and_beat_killed_and_the_broker_flushed(deploy, sim_cluster):
    d = deploy(sim_cluster, capabilities={"sim.map": capability()})
    w1 = d.start_worker("w1")
    beat = d.start_beat()
    map_id = schedule_map(d)
    d.wait(lambda: len(items_of(d, map_id)) >= ITEMS // 5, timeout_s=150, what="a fifth of the items ended")
    for proc in (w1, beat):  # SIGKILL, mid-map: whatever they held is left half done
        proc.managed.kill()
        d.procs.remove(proc)
    keys = list(d.redis.scan_iter(match=f"{d.prefix}:*", count=1000))
    assert keys and d.redis.delete(*keys)  # queued messages, positions, markers, claims: all gone
    assert not d.all_terminal([map_id])
    d.start_worker("w2")
    d.start_beat("beat2")

    [(event, payload)] = d.wait_terminal([map_id], timeout_s=300)[map_id]
    assert event == EventType.WORKER_COMPLETED.value, payload
    assert payload == {
        "output": {
            "items": ITEMS,
            "succeeded": ITEMS - len(FAILING),
            "failed": len(FAILING),
            "needed": ITEMS - len(FAILING),
        }
    }
    outcomes = items_of(d, map_id)
    counts = Counter(o.index for o in outcomes)
    assert sorted(counts) == list(range(ITEMS)) and set(counts.values()) == {1}, counts.most_common(3)
    for o in outcomes:
        if o.index in FAILING:
            assert o.event is api.ItemEventType.ITEM_FAILED, o
            assert (o.payload["reason"], o.payload["exit_code"]) == ("ContainerFailed", 2), o
            assert f"bad item {o.index}" in o.payload["message"], o
        else:
            assert o.event is api.ItemEventType.ITEM_COMPLETED and o.payload == {
                "item": o.index,
                "output": {"i": o.index},
            }, o
    with transaction(d.sessions) as session:
        events = dispatches.events_for(session, map_id)
    assert [e.type for e in events if e.type in (EventType.WORKER_COMPLETED.value, EventType.WORKER_FAILED.value)] == [
        EventType.WORKER_COMPLETED.value
    ]
    d.wait_no_jobs(timeout_s=60)
    d.wait(lambda: not held_pods(d), timeout_s=60, what="no Pod holding our finalizer")


def test_a_retried_items_failed_pod_is_freed_while_the_map_runs(deploy, sim_cluster):
    """Item 0 fails its first attempt and succeeds on its second (backoffLimit 1): its failed Pod
    is freed of our finalizer once its index runs again, before its item ends (a hand-off reads
    the failed Pods when the Job's failure counter grows), and the item ends once."""
    items = 10
    by_index = {"0": {"outcome": "fail", "exit-code": "3", "attempts": 1}}
    spec = {"worker": "sim", "image": "sim:1", "backoffLimit": 1,
            "annotations": {SIM + "duration-ms": "2000", SIM + "by-index": json.dumps(by_index)}}  # fmt: skip
    d = deploy(sim_cluster, capabilities={"sim.map": spec})
    d.start_worker("w1")
    d.start_beat()
    with transaction(d.sessions) as session:
        case_id = f"case-{uuid.uuid4().hex[:10]}"
        api.create_case(session, case_id=case_id, tenancy_id="tenant-a")
        map_id = api.schedule_map_in_session(
            session, case_id=case_id, tenancy_id="tenant-a", capability="sim.map",
            items=[{"n": i} for i in range(items)], idempotency_key=f"map-{uuid.uuid4().hex}", parallelism=2,
            router=CapabilityResolver.from_settings(d.settings), max_input_bytes=d.settings.max_input_bytes,
            via=d.producer,
        ).dispatch_id  # fmt: skip

    def failed_pod_freed() -> bool:
        if any(o.index == 0 for o in items_of(d, map_id)):
            raise AssertionError("item 0 ended before its failed Pod was freed")
        pods = d.kube.list_pods(d.namespace, label_selector="batch.kubernetes.io/job-completion-index=0")
        failed = [p for p in pods if p["status"].get("phase") == "Failed"]
        return bool(failed) and all(FINALIZER not in (p["metadata"].get("finalizers") or []) for p in failed)

    d.wait(failed_pod_freed, timeout_s=120, what="the failed Pod freed while its item runs again")
    [(event, payload)] = d.wait_terminal([map_id], timeout_s=120)[map_id]
    assert event == EventType.WORKER_COMPLETED.value and payload["output"]["succeeded"] == items, payload
    outcomes = items_of(d, map_id)
    assert sorted(o.index for o in outcomes) == list(range(items))
    assert all(o.event is api.ItemEventType.ITEM_COMPLETED for o in outcomes)
    d.wait_no_jobs(timeout_s=60)
    d.wait(lambda: not held_pods(d), timeout_s=60, what="no Pod holding our finalizer")
