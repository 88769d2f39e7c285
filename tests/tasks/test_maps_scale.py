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
from collections import Counter

import pytest
from map_runs import SIM, assert_nothing_left, check_items, items_of, map_capability, schedule_map

from k8s_dispatch import api
from k8s_dispatch.store import dispatches
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import EventType
from k8s_dispatch.workers.manifest import FINALIZER

ITEMS = 1_000
FAILING = frozenset(range(13, ITEMS, 50))  # 20 items exit 2, spread over the whole map
PARALLELISM = 50


@pytest.mark.timeout(480)  # ~40 s on an idle machine; the shared one's load stretches it fourfold
def test_a_map_of_a_thousand_items_survives_a_worker_and_beat_killed_and_the_broker_flushed(deploy, sim_cluster):
    d = deploy(sim_cluster, capabilities={"sim.map": map_capability(ITEMS, FAILING, 1000)})
    w1 = d.start_worker("w1")
    beat = d.start_beat()
    numbers = [{"n": i} for i in range(ITEMS)]
    map_id = schedule_map(d, "sim.map", numbers, parallelism=PARALLELISM, min_succeeded=ITEMS - len(FAILING))
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
    check_items(outcomes, ITEMS, FAILING)
    with transaction(d.sessions) as session:
        events = dispatches.events_for(session, map_id)
    assert [e.type for e in events if e.type in (EventType.WORKER_COMPLETED.value, EventType.WORKER_FAILED.value)] == [
        EventType.WORKER_COMPLETED.value
    ]
    assert_nothing_left(d, timeout_s=60)


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
    map_id = schedule_map(d, "sim.map", [{"n": i} for i in range(items)], parallelism=2)

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
    assert_nothing_left(d, timeout_s=60)
