"""What a running map costs the reads that come back to it (real PostgreSQL, Redis, localcluster;
hand-offs and the sweep in-process): a hand-off of k newly finished indexes asks the database
about those k items, whether the Job counts them yet or not, not every item the map has ended
(`store.maps.ended_items(among=...)`, the items noted ended in Redis), and the sweep's LIST of finished Pods leaves out a running map's,
which only its hand-offs read; every item still ends once, and an ended dispatch's Pods are
still freed by the sweep. A look frees its Pods several PATCHes at a time, after it let the claim
go; an ended map's hand-off leaves the Pods of such frees in flight to them (and those a look
that died mid-way left, to the sweep), so no Pod is PATCHed twice."""

from __future__ import annotations

import itertools
import json
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from runtimes import own_database_values

from k8s_dispatch.delivery import cleanup, create, handoff, items, terminal
from k8s_dispatch.delivery.guard import Guard
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.demo.localcluster import LocalCluster
from k8s_dispatch.ops.processes import wait_until
from k8s_dispatch.recovery.sweep import run_sweep
from k8s_dispatch.store import dispatches, maps, scheduling
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import EventType
from k8s_dispatch.workers import indexed
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.job_status import job_state
from k8s_dispatch.workers.manifest import FINALIZER, job_name

SIM = "localcluster.k8s-dispatch.io/"
QUICK, HANGING = 25, 5  # a running map: 25 items finish at once, 5 never do


def map_capability(by_index: dict[str, Any], *, retries: int = 0) -> dict[str, Any]:
    return {
        "worker": "sim",
        "image": "sim:1",
        "backoffLimit": retries,
        "annotations": {SIM + "duration-ms": "20", SIM + "by-index": json.dumps(by_index)},
    }


CAPABILITIES = {
    "capabilities": {
        "sim.running": map_capability({str(i): {"outcome": "hang"} for i in range(QUICK, QUICK + HANGING)}),
        "sim.quick": map_capability({}),
        # Index 0 fails once and its retry succeeds; 1 and 2 never end.
        "sim.retried": map_capability(
            {"0": {"outcome": "fail", "attempts": 1}, "1": {"outcome": "hang"}, "2": {"outcome": "hang"}}, retries=1
        ),
    }
}


@pytest.fixture
def runtime_env(sim_cluster, new_pg_database, redis_url, key_prefix, tmp_path) -> dict[str, str]:
    return own_database_values(
        cluster=sim_cluster, new_pg_database=new_pg_database, redis_url=redis_url, key_prefix=key_prefix,
        tmp=tmp_path, namespace="reads", capabilities=CAPABILITIES, sweep_grace_s="0",
    )  # fmt: skip


def start_map(rt: Runtime, capability: str, count: int) -> str:
    """A map of `count` items at parallelism `count`, its Job made; its id."""
    with transaction(rt.sessions) as session:
        case_id = f"case-{capability}"
        scheduling.create_case(session, case_id=case_id, tenancy_id="tenant-a")
        request = maps.MapRequest(
            case_id=case_id, tenancy_id="tenant-a", capability=capability, items=[{"n": i} for i in range(count)],
            idempotency_key=f"map-{capability}", parallelism=count,
        )  # fmt: skip
        map_id = maps.schedule_map(session, request, router=rt.resolver, max_input_bytes=rt.settings.max_input_bytes)
    create.create_job_for(rt, map_id.dispatch_id)
    return map_id.dispatch_id


def job_when(rt: Runtime, map_id: str, ready: Any, what: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = []

    def check() -> bool:
        found[:] = [rt.kube.get_job(rt.settings.namespace, job_name(map_id))]
        return bool(ready(found[0]))

    wait_until(check, timeout=60, what=what)
    return found[0]


@contextmanager
def item_end_reads(rt: Runtime) -> Iterator[list[tuple[int, int]]]:
    """(indexes asked about, rows returned) of each SELECT on map_item_ends while the block runs."""
    engine = rt.sessions.kw["bind"]
    seen: list[tuple[int, int]] = []

    def after(conn: Any, cursor: Any, statement: str, parameters: Any, *rest: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT") and "FROM map_item_ends" in statement:
            values = parameters.values() if isinstance(parameters, dict) else parameters
            seen.append((sum(1 for v in values if isinstance(v, int)), cursor.rowcount))

    sa.event.listen(engine, "after_cursor_execute", after)
    try:
        yield seen
    finally:
        sa.event.remove(engine, "after_cursor_execute", after)


def pods_listed(cluster: LocalCluster) -> int:
    """Pod objects every LIST so far returned."""
    listed, _ = cluster.call(lambda core: core.audit.objects_read())
    return listed.get(("", "pods"), 0)


def held(rt: Runtime, map_id: str) -> list[int]:
    """The completion indexes of the map's Pods that hold our finalizer."""
    pods = rt.kube.list_pods(rt.settings.namespace, label_selector=f"batch.kubernetes.io/job-name={job_name(map_id)}")
    return sorted(indexed.pod_index(p) or 0 for p in pods if FINALIZER in (p["metadata"].get("finalizers") or []))


def test_a_hand_off_asks_about_the_items_whose_pods_finished_once_and_the_sweep_leaves_a_running_maps_pods(
    rt: Runtime, sim_cluster: LocalCluster
) -> None:
    map_id = start_map(rt, "sim.running", QUICK + HANGING)
    everything = f"0-{QUICK - 1}"
    job = job_when(rt, map_id, lambda j: j["status"].get("completedIndexes") == everything, "25 items finished")
    earlier = {**job, "status": {**job["status"], "completedIndexes": "0-19"}}  # as a watch saw it before

    with item_end_reads(rt) as reads:
        assert items.deliver_maps(rt, rt.settings.namespace, [earlier]).outcomes == [items.RUNNING]
    # The 25 whose Pods succeeded, the 5 the Job does not count yet among them; none ended yet.
    assert reads == [(QUICK, 0)]
    with transaction(rt.sessions) as session:
        assert sorted(e.payload["item"] for e in maps.item_events(session, map_id)) == list(range(QUICK))
    with item_end_reads(rt) as reads:
        items.deliver_maps(rt, rt.settings.namespace, [job])
    assert reads == []  # the 5 counted since are noted ended, and their Pods are freed: no statement

    # The notes lost (a Redis flush): the counted items are asked about again, and end no second time.
    rt.redis.delete(*rt.redis.keys(f"{rt.settings.key_prefix}:map-*"))
    with item_end_reads(rt) as reads:
        items.deliver_maps(rt, rt.settings.namespace, [job])
    assert reads == [(QUICK, QUICK)]
    with transaction(rt.sessions) as session:
        ends = Counter(e.payload["item"] for e in maps.item_events(session, map_id))
    assert sorted(ends) == list(range(QUICK)) and set(ends.values()) == {1}
    assert held(rt, map_id) == list(range(QUICK, QUICK + HANGING))  # the finished Pods are freed

    # An ended map whose Pods its end left held (the Job released first, then the worker died).
    ended_id = start_map(rt, "sim.quick", 3)
    ended_job = job_when(rt, ended_id, lambda j: job_state(j).terminal, "the quick map's Job finished")
    with transaction(rt.sessions) as session:
        summary = {"items": 3, "succeeded": 0, "failed": 3, "needed": 3}
        event = dispatches.TerminalEvent(ended_id, EventType.WORKER_FAILED, {"reason": "X", "detail": summary})
        assert terminal.record(session, [event]) == {ended_id}
    cleanup.release_job(rt, rt.settings.namespace, job_name(ended_id), snapshot=ended_job)
    assert held(rt, ended_id) == [0, 1, 2]

    before = pods_listed(sim_cluster)
    report = run_sweep(rt)
    assert report.errors == 0, report.problems
    assert held(rt, ended_id) == []  # the ended map's Pods are freed by the sweep's Pod pass
    # ...which read those 3, not the running map's 25 finished Pods.
    assert pods_listed(sim_cluster) - before == 3


def test_a_retry_that_succeeded_frees_its_items_failed_pod_with_its_own(rt: Runtime) -> None:
    """The look that records an item from its retry's succeeded Pod frees the item's failed Pod
    too, though that look reads the index's Pods from the succeeded ones, not by its label."""
    map_id = start_map(rt, "sim.retried", 3)
    job = job_when(rt, map_id, lambda j: j["status"].get("completedIndexes") == "0", "item 0's retry succeeded")
    assert items.retried_count(job) == 1
    assert items.deliver_maps(rt, rt.settings.namespace, [job]).outcomes == [items.RUNNING]
    with transaction(rt.sessions) as session:
        assert [e.payload["item"] for e in maps.item_events(session, map_id)] == [0]
    assert held(rt, map_id) == [1, 2]  # both of item 0's Pods are freed, while the map runs


def pod_patches(cluster: LocalCluster) -> Counter[int]:
    """Pod PATCHes the API server answered so far, by response code."""
    counts: Counter[int] = Counter()
    for c in cluster.request_counts():
        if c.labels.verb == "PATCH" and c.labels.resource == "pods":
            counts[c.code] += c.count
    return counts


def test_an_ended_maps_pods_are_freed_once_by_whoever_holds_its_claim(rt: Runtime, sim_cluster: LocalCluster) -> None:
    """A map's end may free thousands of Pods, one PATCH each: a second hand-off of its Job (poll
    hands a finished Job off again every marker TTL) or the sweep would list the same Pods and
    PATCH each again, in vain (422). Only the holder of the dispatch's claim frees them."""
    map_id = start_map(rt, "sim.quick", 20)
    job = job_when(rt, map_id, lambda j: job_state(j).terminal, "the map's Job finished")
    with transaction(rt.sessions) as session:
        event = dispatches.TerminalEvent(map_id, EventType.WORKER_FAILED, {"reason": "X"})
        assert terminal.record(session, [event]) == {map_id}
    assert held(rt, map_id) == list(range(20))

    claim = rt.guard.claim_many([map_id])[map_id]  # another hand-off, freeing them now
    assert claim is not None
    before = pod_patches(sim_cluster)
    prefix, namespace = rt.settings.key_prefix, rt.settings.namespace
    assert handoff.mark(rt.redis, prefix, namespace, [job], 600) == [True]  # poll handed it off
    assert items.deliver_maps(rt, rt.settings.namespace, [job]).outcomes == [items.CLAIMED_ELSEWHERE]
    # ...and it is handed off again at the next poll, not once the marker's TTL is over
    assert handoff.pending(rt.redis, prefix, namespace, [job]) == [False]
    report = run_sweep(rt)
    assert report.errors == 0, report.problems
    assert pod_patches(sim_cluster) == before and held(rt, map_id) == list(range(20))

    rt.guard.release_many([claim])
    run_sweep(rt)
    assert held(rt, map_id) == []
    patched = pod_patches(sim_cluster)
    patched.subtract(before)
    assert +patched == Counter({200: 20})  # each Pod once, none in vain


def seen_later(rt: Runtime, map_id: str, indexes: range) -> None:
    """Leave these finished Pods out of a look's LIST of succeeded Pods not yet freed (they carry
    the label our release puts on, and still hold our finalizer): as if they ended after it."""
    core = k8s.CoreV1Api(k8s_config.new_client_from_config(config_file=str(rt.settings.kubeconfig)))
    selector = f"batch.kubernetes.io/job-name={job_name(map_id)}"
    for pod in rt.kube.list_pods(rt.settings.namespace, label_selector=selector):
        if indexed.pod_index(pod) in indexes:
            labels = {job_labels.RELEASED_LABEL: job_labels.RELEASED}
            core.patch_namespaced_pod(pod["metadata"]["name"], rt.settings.namespace, {"metadata": {"labels": labels}})


def as_running(job: dict[str, Any], completed: str) -> dict[str, Any]:
    """An ended map's Job as a watch saw it while it ran, `completed` indexes counted."""
    status = {k: v for k, v in job["status"].items() if k not in ("conditions", "completionTime")}
    running = {**job, "status": {**status, "completedIndexes": completed}}
    assert not job_state(running).terminal
    return running


def test_a_running_maps_look_frees_its_pods_several_at_a_time(rt: Runtime, sim_cluster: LocalCluster, monkeypatch):
    """Each release is a write the API server commits: one after the other, they held every look
    of a busy machine back behind the last one's."""
    map_id = start_map(rt, "sim.running", QUICK + HANGING)
    job = job_when(rt, map_id, lambda j: j["status"].get("completedIndexes") == f"0-{QUICK - 1}", "25 finished")
    together, calls, release_pod = threading.Barrier(2, timeout=30), itertools.count(), rt.kube.release_pod

    def met(namespace: str, pod: Any, **kwargs: Any) -> bool:
        if next(calls) < 2:
            together.wait()  # the first two PATCHes are in flight at once, or this breaks
        return release_pod(namespace, pod, **kwargs)

    monkeypatch.setattr(rt.kube, "release_pod", met)
    before = pod_patches(sim_cluster)
    assert items.deliver_maps(rt, rt.settings.namespace, [job]).outcomes == [items.RUNNING]
    assert held(rt, map_id) == list(range(QUICK, QUICK + HANGING))
    patched = pod_patches(sim_cluster)
    patched.subtract(before)
    assert +patched == Counter({200: QUICK})


def job_released(rt: Runtime, map_id: str) -> bool:
    return FINALIZER not in (
        rt.kube.get_job(rt.settings.namespace, job_name(map_id))["metadata"].get("finalizers") or []
    )


def test_an_ended_maps_hand_off_frees_no_pod_a_running_look_is_freeing(
    rt: Runtime, sim_cluster: LocalCluster, monkeypatch
) -> None:
    """A running look frees its items' Pods after it let the map's claim go. If the Job ends
    meanwhile, the end's hand-off takes the claim and lists every Pod: those still being freed
    must not be PATCHed a second time (each answered 422). It records the map's end, frees the
    other Pods and releases the Job at once, and leaves those to the look freeing them."""
    map_id = start_map(rt, "sim.quick", 20)
    job = job_when(rt, map_id, lambda j: job_state(j).terminal, "the map's Job finished")
    in_flight, go, release_pod = threading.Event(), threading.Event(), rt.kube.release_pod
    seen_later(rt, map_id, range(10, 20))  # the running look sees 0-9 ended

    def slow(namespace: str, pod: Any, **kwargs: Any) -> bool:
        if (indexed.pod_index(pod) or 0) < 10:  # the running look's
            in_flight.set()
            assert go.wait(timeout=60)
        return release_pod(namespace, pod, **kwargs)

    monkeypatch.setattr(rt.kube, "release_pod", slow)
    running: list[str] = []
    look = threading.Thread(
        target=lambda: running.extend(items.deliver_maps(rt, rt.settings.namespace, [as_running(job, "0-9")]).outcomes)
    )
    before = pod_patches(sim_cluster)
    look.start()
    assert in_flight.wait(timeout=60)  # items 0-9 recorded, their Pods being freed
    assert items.deliver_maps(rt, rt.settings.namespace, [job]).outcomes == [items.COMPLETED]
    with transaction(rt.sessions) as session:
        ends = Counter(e.payload["item"] for e in maps.item_events(session, map_id))
        ended = [e for e in dispatches.events_for(session, map_id) if e.type == EventType.WORKER_COMPLETED.value]
    assert sorted(ends) == list(range(20)) and set(ends.values()) == {1} and len(ended) == 1
    assert held(rt, map_id) == list(range(10)) and job_released(rt, map_id)

    go.set()
    look.join(timeout=60)
    assert running == [items.RUNNING] and held(rt, map_id) == []
    patched = pod_patches(sim_cluster)
    patched.subtract(before)
    assert +patched == Counter({200: 20})  # each Pod once, none in vain


class Killed(BaseException):
    """The worker killed while a look freed its Pods."""


def test_the_pods_a_look_that_died_while_freeing_left_are_freed_by_the_sweep_once_the_map_ended(
    rt: Runtime, sim_cluster: LocalCluster, monkeypatch
) -> None:
    map_id = start_map(rt, "sim.quick", 10)
    job = job_when(rt, map_id, lambda j: job_state(j).terminal, "the map's Job finished")
    seen_later(rt, map_id, range(5, 10))  # the first look sees 0-4 ended, the second the rest
    assert items.deliver_maps(rt, rt.settings.namespace, [as_running(job, "0-4")]).outcomes == [items.RUNNING]

    def killed(*args: Any, **kwargs: Any) -> bool:
        raise Killed

    with monkeypatch.context() as m:
        m.setattr(rt.kube, "release_pod", killed)
        m.setattr(items._Freeing, "end", lambda self: None)  # a killed process ends nothing
        with pytest.raises(Killed):
            items.deliver_maps(rt, rt.settings.namespace, [as_running(job, "0-9")])
    assert held(rt, map_id) == list(range(5, 10))  # recorded, still held, registered as in flight
    before = pod_patches(sim_cluster)
    assert items.deliver_maps(rt, rt.settings.namespace, [job]).outcomes == [items.COMPLETED]
    assert held(rt, map_id) == list(range(5, 10)) and job_released(rt, map_id)
    report = run_sweep(rt)
    assert report.errors == 0, report.problems
    assert held(rt, map_id) == []
    patched = pod_patches(sim_cluster)
    patched.subtract(before)
    assert +patched == Counter({200: 5})
    with transaction(rt.sessions) as session:
        assert sorted(Counter(e.payload["item"] for e in maps.item_events(session, map_id)).values()) == [1] * 10


def test_a_claim_renewed_is_never_let_go_and_only_its_holder_renews_it(rt: Runtime) -> None:
    guard = rt.guard
    claim = guard.claim("map-renew")
    assert claim is not None and guard.renew(claim)
    assert guard.holder("map-renew") == claim.owner and guard.claim("map-renew") is None
    assert rt.redis.pttl(guard.key("map-renew")) > rt.settings.guard_lease_ms - 5_000  # a whole lease again
    assert guard.release(claim)
    other = Guard(rt.redis, prefix=rt.settings.key_prefix, lease_ms=rt.settings.guard_lease_ms).claim("map-renew")
    assert other is not None
    assert not guard.renew(claim) and guard.holder("map-renew") == other.owner
