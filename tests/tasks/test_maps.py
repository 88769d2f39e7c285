"""Map dispatches (fan-out, issue 29) end to end with real `celery -A k8s_dispatch.tasks worker|beat`
processes, PostgreSQL, Redis and each cluster (localcluster, and the real control plane with our
node agent): a map over 20 items, some failing by design, is one Indexed Job; every item ends in
exactly one item event with its own output or reason, recorded as its Pod finishes (before the
map ends), the map in one terminal event with its counts, and no Job or held Pod is left. A
worker and beat SIGKILLed mid-map, with the broker flushed, still leave each item delivered once. In localcluster's
exec mode the runner runs for real: each Pod's function sees its own item's input, also when a
lost map Job is made again for its open items only.
"""

from __future__ import annotations

from typing import Any

from map_runs import assert_nothing_left, check_items, items_of, map_capability, schedule_map

from k8s_dispatch import api
from k8s_dispatch.demo.functions import wordcount
from k8s_dispatch.demo.localcluster import LocalCluster
from k8s_dispatch.store import dispatches
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import DispatchState, EventType
from k8s_dispatch.workers import indexed
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.indexed import is_map_job
from k8s_dispatch.workers.manifest import FINALIZER, job_name

ITEMS = 20
FAILING = {3, 7, 11}
NUMBERS = [{"n": i} for i in range(ITEMS)]


def capability(duration_ms: int) -> dict[str, Any]:
    return map_capability(ITEMS, FAILING, duration_ms)


def test_a_map_ends_each_item_once_as_its_pod_finishes_and_the_map_once(deploy, any_cluster):
    d = deploy(any_cluster, capabilities={"sim.map": capability(400)})
    d.start_worker("w1")
    d.start_beat()
    map_id = schedule_map(d, "sim.map", NUMBERS, parallelism=4, min_succeeded=15)
    job = d.wait(
        lambda: next((j for j in d.jobs() if j["metadata"]["name"] == job_name(map_id)), None), what="the map's Job"
    )
    assert is_map_job(job) and job["spec"]["completionMode"] == "Indexed"
    assert (job["spec"]["completions"], job["spec"]["parallelism"]) == (ITEMS, 4)
    # Items are recorded while the map runs: the engine sees progress.
    d.wait(lambda: items_of(d, map_id) and not d.all_terminal([map_id]), what="an item ended before its map")

    [(event, payload)] = d.wait_terminal([map_id], timeout_s=90)[map_id]
    assert event == EventType.WORKER_COMPLETED.value, payload
    assert payload == {"output": {"items": ITEMS, "succeeded": ITEMS - 3, "failed": 3, "needed": 15}}
    check_items(items_of(d, map_id), ITEMS, FAILING)
    with transaction(d.sessions) as session:
        events = dispatches.events_for(session, map_id)
    ended_at = next(e.created_at for e in events if e.type == EventType.WORKER_COMPLETED.value)
    assert any(e.created_at < ended_at for e in events if e.type.startswith("WORKER_ITEM_")), "all at the end"
    d.wait(lambda: map_id in d.notifications(), what="the engine told of the map")
    assert_nothing_left(d)


def test_a_map_that_needs_every_item_fails_saying_how_many_did(deploy, any_cluster):
    d = deploy(any_cluster, capabilities={"sim.map": capability(50)})
    d.start_worker("w1")
    d.start_beat()
    map_id = schedule_map(d, "sim.map", NUMBERS, parallelism=5)
    [(event, payload)] = d.wait_terminal([map_id], timeout_s=90)[map_id]
    assert event == EventType.WORKER_FAILED.value, payload
    assert (
        payload["reason"] == "ItemsFailed"
        and payload["message"] == f"{ITEMS - 3} of {ITEMS} items succeeded, {ITEMS} needed"
    )
    assert payload["detail"] == {"items": ITEMS, "succeeded": ITEMS - 3, "failed": 3, "needed": ITEMS}
    check_items(items_of(d, map_id), ITEMS, FAILING)
    assert_nothing_left(d)


def test_a_worker_and_beat_killed_mid_map_and_the_broker_flushed_still_deliver_each_item_once(deploy, any_cluster):
    d = deploy(any_cluster, capabilities={"sim.map": capability(700)})
    w1 = d.start_worker("w1")
    beat = d.start_beat()
    map_id = schedule_map(d, "sim.map", NUMBERS, parallelism=2, min_succeeded=1)
    d.wait(lambda: len(items_of(d, map_id)) >= 3, timeout_s=60, what="3 items ended")
    for proc in (w1, beat):  # SIGKILL, mid-map: whatever they held is left half done
        proc.managed.kill()
        d.procs.remove(proc)
    # ... and the broker loses every key of the run: queued messages, poll's positions and
    # hand-off markers, the guard's claims.
    keys = list(d.redis.scan_iter(match=f"{d.prefix}:*", count=1000))
    assert keys and d.redis.delete(*keys)
    assert not d.all_terminal([map_id])
    d.start_worker("w2")
    d.start_beat("beat2")
    [(event, payload)] = d.wait_terminal([map_id], timeout_s=120)[map_id]
    assert event == EventType.WORKER_COMPLETED.value, payload
    assert payload["output"]["succeeded"] == ITEMS - 3
    check_items(items_of(d, map_id), ITEMS, FAILING)
    with transaction(d.sessions) as session:
        row = dispatches.get_dispatch(session, map_id)
    assert row is not None and row.state is DispatchState.COMPLETED
    assert_nothing_left(d)


def test_cancel_ends_every_unfinished_item_once(deploy, any_cluster):
    d = deploy(any_cluster, capabilities={"sim.map": capability(1500)})
    d.start_worker("w1")
    d.start_beat()
    map_id = schedule_map(d, "sim.map", NUMBERS, parallelism=2)
    d.wait(lambda: len(items_of(d, map_id)) >= 1, timeout_s=60, what="an item ended")
    with transaction(d.sessions) as session:
        assert api.cancel_in_session(session, map_id, via=d.producer)
    outcomes = items_of(d, map_id)
    assert sorted(o.index for o in outcomes) == list(range(ITEMS))
    cancelled = [o for o in outcomes if o.event is api.ItemEventType.ITEM_CANCELLED]
    assert cancelled and all(o.payload["reason"] == "Cancelled" for o in cancelled)
    assert_nothing_left(d)
    assert sorted(o.index for o in items_of(d, map_id)) == list(range(ITEMS))  # nothing after the cancel


def test_in_exec_mode_each_pod_runs_its_own_items_input(deploy):
    """localcluster's exec mode runs `k8s_dispatch.container.runner` for real: each Pod reads
    JOB_COMPLETION_INDEX and the function sees its own item's input only."""
    texts = [f"item {i} " + "word " * i for i in range(6)]
    with LocalCluster(mode="exec") as cluster:
        d = deploy(cluster)  # no capabilities file: the demo capabilities (backoffLimit 0)
        d.start_worker("w1")
        d.start_beat()
        map_id = schedule_map(d, "demo.wordcount", [{"text": t} for t in texts] + [{"no text": True}], parallelism=3)
        [(event, payload)] = d.wait_terminal([map_id], timeout_s=120)[map_id]
        assert event == EventType.WORKER_FAILED.value and payload["detail"]["succeeded"] == len(texts), payload
        outcomes = sorted(items_of(d, map_id), key=lambda o: o.index)
        assert [o.payload.get("output") for o in outcomes[:-1]] == [wordcount({"text": t}) for t in texts]
        bad = outcomes[-1]
        assert bad.event is api.ItemEventType.ITEM_FAILED and bad.payload["reason"] == "ContainerFailed", bad
        assert "'text' field" in bad.payload["message"], bad
        d.wait_no_jobs(timeout_s=30)
        d.stop()


def test_a_lost_map_job_is_made_again_for_its_open_items_only(deploy):
    """The map's Job deleted by hand mid-map, finalizers and all (its Pods' results gone with
    it): the sweep makes it again for the items still open only, by their own indexes, so no
    item that ended runs twice; in exec mode each item's output is its own input's."""
    texts = [f"item {i} " + "word " * i for i in range(12)]
    with LocalCluster(mode="exec") as cluster:
        d = deploy(cluster, sweep_interval_s="1", sweep_grace_s="1")
        d.start_worker("w1")
        d.start_beat()
        map_id = schedule_map(d, "demo.wordcount", [{"text": t} for t in texts], parallelism=2)
        name, namespace = job_name(map_id), d.namespace
        first = d.wait(lambda: next((j for j in d.jobs() if j["metadata"]["name"] == name), None), what="the Job")
        d.wait(lambda: len(items_of(d, map_id)) >= 3, timeout_s=60, what="3 items ended")
        for pod in d.kube.list_pods(namespace, label_selector=f"batch.kubernetes.io/job-name={name}"):
            d.kube.release_pod(namespace, pod, finalizer=FINALIZER)
        d.kube.remove_finalizer(namespace, name, FINALIZER)
        d.kube.delete_job(namespace, name, uid=first["metadata"]["uid"])
        d.wait(lambda: all(j["metadata"]["uid"] != first["metadata"]["uid"] for j in d.jobs()), what="the Job gone")
        ended_before = {o.index for o in items_of(d, map_id)}

        again = d.wait(lambda: next((j for j in d.jobs() if j["metadata"]["name"] == name), None), what="a new Job")
        runs = indexed.item_indexes(again)
        assert runs is not None and not set(runs) & ended_before, (runs, ended_before)
        assert again["spec"]["completions"] == len(runs) == len(texts) - len(ended_before)
        assert again["metadata"]["annotations"][job_labels.ATTEMPT_KEY] == "1"

        [(event, payload)] = d.wait_terminal([map_id], timeout_s=120)[map_id]
        assert event == EventType.WORKER_COMPLETED.value, payload
        outcomes = sorted(items_of(d, map_id), key=lambda o: o.index)
        assert [o.index for o in outcomes] == list(range(len(texts)))  # one event each
        assert [o.payload.get("output") for o in outcomes] == [wordcount({"text": t}) for t in texts]
        d.wait_no_jobs(timeout_s=30)
        d.stop()
