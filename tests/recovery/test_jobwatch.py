"""Poll's watch (`delivery.jobwatch`): what each event means (a table), and the slices against both
clusters: resumed from the stored version, a LIST on 410 Gone, two overlapping polls, and the
stream kept between polls (read without a new request; replaced when it ended; never read from
another version than the one stored)."""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from clusters import LOCAL, ClusterHandle, local_handle, real_handle

from k8s_dispatch.delivery import handoff, jobwatch
from k8s_dispatch.delivery.jobwatch import Position, Step, apply, decide
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.indexed import MAP_LABEL
from k8s_dispatch.workers.job_status import job_state
from k8s_dispatch.workers.kube import KubeClient
from k8s_dispatch.workers.manifest import FINALIZER

SIM = "localcluster.k8s-dispatch.io/"
POLL_INTERVAL_S = 2.0


def job(name: str, *, rv: str = "1", uid: str = "u1", labels: dict[str, str] | None = None, **status: Any) -> dict:
    return {"metadata": {"name": name, "uid": uid, "resourceVersion": rv, "labels": labels or {}}, "status": status}


DONE = {"conditions": [{"type": "Complete", "status": "True"}], "succeeded": 1}
FAILED = {"conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}], "failed": 1}
DELIVERED = {job_labels.DELIVERED_LABEL: job_labels.DELIVERED}


@pytest.mark.parametrize(
    ("event", "step"),
    [
        ({"type": "ADDED", "object": job("a", active=1)}, Step.FORGET),
        ({"type": "MODIFIED", "object": job("a", active=1)}, Step.FORGET),
        ({"type": "MODIFIED", "object": job("a", **DONE)}, Step.KEEP),
        ({"type": "MODIFIED", "object": job("a", **FAILED)}, Step.KEEP),
        ({"type": "ADDED", "object": job("a", **DONE)}, Step.KEEP),  # finished before the watch began
        # a delete while our finalizer holds it is a MODIFIED with deletionTimestamp: terminal (JobDeleted)
        (
            {"type": "MODIFIED", "object": {**job("a", active=1), "metadata": {"name": "a", "deletionTimestamp": "t"}}},
            Step.KEEP,
        ),
        ({"type": "DELETED", "object": job("a", labels=DELIVERED, **DONE)}, Step.DELIVERED),  # released
        ({"type": "DELETED", "object": job("a", **DONE)}, Step.GONE),  # finalizer stripped by hand, deleted
        # labelled delivered by hand: our release takes the finalizer off in the same patch
        (
            {
                "type": "DELETED",
                "object": {
                    **job("a", labels=DELIVERED, **DONE),
                    "metadata": {"name": "a", "labels": DELIVERED, "finalizers": [FINALIZER]},
                },
            },
            Step.GONE,
        ),
        ({"type": "DELETED", "object": job("a", active=1)}, Step.GONE),  # relabelled, or deleted, running
        ({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "9"}}}, Step.ADVANCE),
    ],
)
def test_each_event_means_one_step(event: dict, step: Step) -> None:
    assert decide(event) is step


MAP = {MAP_LABEL: "true"}


@pytest.mark.parametrize(
    ("event", "rung"),
    [
        ({"type": "MODIFIED", "object": job("a", **DONE)}, True),  # finished: a poll hands it off
        ({"type": "MODIFIED", "object": job("a", **FAILED)}, True),
        ({"type": "ADDED", "object": job("a", active=1)}, False),  # running: nothing to hand off
        ({"type": "MODIFIED", "object": job("a", active=1)}, False),
        ({"type": "MODIFIED", "object": job("m", labels=MAP, active=3, succeeded=2)}, True),  # a map's item ended
        ({"type": "DELETED", "object": job("m", labels=MAP, active=3)}, False),  # the sweep's to look at
        ({"type": "DELETED", "object": job("a", labels=DELIVERED, **DONE)}, False),  # delivered
        ({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "9"}}}, False),
    ],
)
def test_a_kept_stream_rings_for_what_a_poll_would_hand_off(event: dict, rung: bool) -> None:
    assert jobwatch.rings(event) is rung
    namespaces: list[str] = []
    keep = jobwatch.hold(30, 2.0, "ns", ring=namespaces.append)
    assert keep is not None and keep.on_event is not None
    keep.on_event(event)
    assert namespaces == (["ns"] if rung else [])


@pytest.mark.parametrize(
    ("stored", "listed", "expected"),
    [
        ("900", "120", True),  # the cluster's store restored: the position from before it
        ("120", "120", False),
        ("119", "120", False),  # behind: a poll resumes and reads up to it
        (None, "120", False),  # nothing stored
        ("900", "", False),  # a LIST that said no version
        ("abc", "120", False),  # versions that are not numbers are never compared
        ("900", "x9", False),
    ],
)
def test_a_position_is_ahead_only_of_a_smaller_numbered_list(stored: str | None, listed: str, expected: bool) -> None:
    assert jobwatch.ahead(stored, listed) is expected


def test_apply_keeps_finished_until_delivered_and_follows_the_last_version() -> None:
    start = Position("10", {"old": job("old", **DONE)})
    events = [
        {"type": "MODIFIED", "object": job("a", rv="11", **DONE)},
        {"type": "MODIFIED", "object": job("b", rv="12", active=1)},
        {"type": "DELETED", "object": job("old", rv="13", labels=DELIVERED, **DONE)},
        {"type": "DELETED", "object": job("c", rv="14", active=1)},
        {"type": "ADDED", "object": job("a", rv="15", uid="u2", active=1)},  # a re-created under its name
        {"type": "MODIFIED", "object": job("d", rv="16", **FAILED)},
        {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "20"}}},
    ]
    applied = apply(start, events)
    assert applied.position.version == "20"
    assert sorted(applied.position.finished) == ["d"]
    assert [j["metadata"]["name"] for j in applied.gone] == ["c"]
    assert applied.events == len(events)
    assert start.finished.keys() == {"old"}  # pure: the input is left as it was


def test_apply_holds_the_running_jobs_with_no_container_started_for_the_sweeps_start_checks() -> None:
    events = [
        {"type": "ADDED", "object": job("p", rv="2")},  # created: no Pod ready yet
        {"type": "ADDED", "object": job("r", rv="3")},
        {"type": "MODIFIED", "object": job("r", rv="4", active=1, ready=1)},  # its container started
        {"type": "ADDED", "object": job("d", rv="5")},
        {"type": "DELETED", "object": job("d", rv="6")},
        {"type": "ADDED", "object": job("f", rv="7")},
        {"type": "MODIFIED", "object": job("f", rv="8", **FAILED)},
    ]
    assert sorted(apply(Position("1"), events).position.unstarted) == ["p"]


def test_apply_keeps_the_running_maps_until_they_finish_or_leave() -> None:
    events = [
        {"type": "ADDED", "object": job("m", rv="2", labels=MAP, active=3)},
        {"type": "ADDED", "object": job("n", rv="3", labels=MAP, active=3)},
        {"type": "MODIFIED", "object": job("m", rv="4", labels=MAP, active=2, succeeded=1)},
        {"type": "ADDED", "object": job("s", rv="5", active=1)},  # a single dispatch's: not a map
        {"type": "ADDED", "object": job("f", rv="6", labels=MAP, active=1)},
        {"type": "MODIFIED", "object": job("f", rv="7", labels=MAP, **DONE)},  # finished: among the finished
        {"type": "ADDED", "object": job("g", rv="8", labels=MAP, active=1)},
        {"type": "DELETED", "object": job("g", rv="9", labels=MAP, active=1)},  # left
    ]
    position = apply(Position("1"), events).position
    assert sorted(position.maps) == ["m", "n"] and sorted(position.finished) == ["f"]
    assert position.maps["m"]["status"]["succeeded"] == 1  # as last read
    assert apply(position, []).position.maps == position.maps  # kept while nothing happens


def test_apply_of_nothing_keeps_the_position() -> None:
    start = Position("10", {"a": job("a", **DONE)})
    assert apply(start, []).position == start


@pytest.mark.parametrize(("interval", "bound"), [(2.0, 0.3), (1.0, 0.15), (0.5, 0.075), (30.0, 0.3)])
def test_a_slice_reads_well_under_the_interval(interval: float, bound: float) -> None:
    assert jobwatch.bound_s(interval) == pytest.approx(bound)


def test_kept_streams_of_many_namespaces_live_spread_out_and_one_lives_its_hold() -> None:
    assert jobwatch.hold(0, 2.0, "ns") is None
    assert jobwatch.hold(30, 2.0) == jobwatch.Hold(lifetime_s=30, idle_s=4.0)  # one namespace: all of it

    def lives() -> list[float]:
        holds = [jobwatch.hold(30, 2.0, f"idle-{i:03d}") for i in range(300)]
        return [h.lifetime_s for h in holds if h is not None]

    assert all(15 <= life <= 30 for life in lives()) and len(lives()) == 300
    assert max(lives()) - min(lives()) > 12  # they end spread over the hold's last half, not in one poll
    assert lives() == lives()  # pure: a namespace's stream always lives as long


# --- against the clusters -------------------------------------------------------------------


@pytest.fixture
def kube(cluster_under_test: ClusterHandle) -> Iterator[KubeClient]:
    with KubeClient(cluster_under_test.kubeconfig) as client:
        yield client


@pytest.fixture
def deployment() -> str:
    return f"w{uuid.uuid4().hex[:10]}"


def make_job(kube: KubeClient, namespace: str, deployment: str, *, ms: int, map_items: int = 0) -> str:
    """One of our Jobs whose Pod runs `ms`; with `map_items`, a map's Indexed Job of that many."""
    name = f"kd-{uuid.uuid4()}"
    labels = {job_labels.MANAGED_BY_LABEL: job_labels.MANAGED_BY, job_labels.DEPLOYMENT_LABEL: deployment}
    spec: dict[str, Any] = {"backoffLimit": 0}
    if map_items:
        labels |= MAP
        spec = {"completionMode": "Indexed", "completions": map_items, "parallelism": map_items,
                "backoffLimitPerIndex": 0}  # fmt: skip
    kube.create_job(
        namespace,
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": name, "labels": labels, "finalizers": [FINALIZER]},
            "spec": {
                **spec,
                "template": {
                    "metadata": {
                        "labels": MAP if map_items else {},
                        "annotations": {SIM + "duration-ms": str(ms), SIM + "result": "{}"},
                    },
                    "spec": {"restartPolicy": "Never", "containers": [{"name": "w", "image": "sim:1"}]},
                },
            },
        },
    )
    return name


class Recorder:
    """The hand-off seam: marks each Job as poll's does (`delivery.handoff`) and records the ones
    handed off now; `during` runs inside the hand-off (an overlapping poll)."""

    def __init__(self, client: redis.Redis, prefix: str, namespace: str) -> None:
        self.client, self.prefix, self.namespace = client, prefix, namespace
        self.handed: list[str] = []
        self.during: Callable[[], None] | None = None

    def __call__(self, jobs: list[dict]) -> int:
        marked = handoff.mark(self.client, self.prefix, self.namespace, jobs, 30.0)
        fresh = [j["metadata"]["name"] for j, new in zip(jobs, marked, strict=True) if new]
        self.handed += fresh
        if self.during is not None:
            during, self.during = self.during, None
            during()
        return len(fresh)


def poll(
    kube: KubeClient, client: redis.Redis, prefix: str, deployment: str, namespace: str, rec: Recorder,
    *, hold_s: float = 0.0, ring: jobwatch.Ring | None = None,
):  # fmt: skip
    return jobwatch.poll_namespace(
        kube, client, prefix=prefix, deployment=deployment, namespace=namespace, page_size=2,
        poll_interval_s=POLL_INTERVAL_S, hand_off=rec, hold_s=hold_s, ring=ring,
    )  # fmt: skip


def wait_finished(kube: KubeClient, namespace: str, names: list[str], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = {
            j["metadata"]["name"]
            for page in kube.iter_jobs(namespace, label_selector=job_labels.selector())
            for j in page
            if any(c.get("type") == "Complete" for c in (j.get("status") or {}).get("conditions") or [])
        }
        if set(names) <= done:
            return
        time.sleep(0.2)
    raise AssertionError(f"jobs not finished within {timeout}s")


def release(kube: KubeClient, namespace: str, name: str) -> None:
    """What a completion does last: our finalizer off, the delivered label on (the Job leaves the selector)."""
    assert kube.release_job(namespace, name, finalizer=FINALIZER, label=(job_labels.DELIVERED_LABEL, "true"))


def poll_until(check: Callable[[], bool], *, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.1)


def test_a_poll_resumes_from_the_version_the_last_one_stored(
    cluster_under_test: ClusterHandle, kube: KubeClient, client: redis.Redis, key_prefix: str, deployment: str
) -> None:
    namespace = cluster_under_test.ensure_namespace("watch-resume")
    prefix = f"{key_prefix}-{deployment}"
    rec = Recorder(client, prefix, namespace)
    quick = [make_job(kube, namespace, deployment, ms=10) for _ in range(3)]
    slow = make_job(kube, namespace, deployment, ms=3_000)
    wait_finished(kube, namespace, quick)

    listed = jobwatch.listed_key(jobwatch.key(prefix, deployment, namespace))
    client.set(listed, 1, ex=600)  # a sweep's LIST stands for the namespace's Jobs
    first = poll(kube, client, prefix, deployment, namespace, rec)  # no version yet: the LIST
    assert first.listed and first.stored and first.seen == 4
    assert sorted(rec.handed) == sorted(quick)
    assert not client.exists(listed)  # a gap in the watch: the sweep's next pass LISTs too
    client.set(listed, 1, ex=600)

    release(kube, namespace, quick[0])  # delivered: leaves the finished set through a DELETED event
    wait_finished(kube, namespace, [slow])
    found: list[jobwatch.NamespacePoll] = []

    def slow_handed_off() -> bool:
        found.append(poll(kube, client, prefix, deployment, namespace, rec))
        assert not found[-1].listed  # resumed, never listed again
        return slow in rec.handed

    poll_until(slow_handed_off)
    assert sorted(rec.handed) == sorted([*quick, slow])  # each once: the markers are live
    stored = jobwatch.load(client, jobwatch.key(prefix, deployment, namespace))
    assert sorted(stored.finished) == sorted([*quick[1:], slow])  # the delivered one is forgotten
    assert jobwatch.is_healthy(client, prefix, deployment, namespace)
    # Nothing changed since: a poll reads no event and keeps the version.
    quiet = poll(kube, client, prefix, deployment, namespace, rec)
    assert (quiet.listed, quiet.seen) == (False, 0)
    assert jobwatch.load(client, jobwatch.key(prefix, deployment, namespace)).version == stored.version
    assert client.exists(listed)  # resumed polls leave the sweep's LIST standing


def test_every_poll_hands_a_running_map_off_whether_its_job_changed_or_not(
    cluster_under_test: ClusterHandle, kube: KubeClient, client: redis.Redis, key_prefix: str, deployment: str
) -> None:
    """A map's item ends with its Pod, which changes no Job: the Job controller counts it at its
    next sync, seconds later on a busy control plane. Poll keeps the running maps in its position
    and hands each off at every poll, so that its hand-off reads the Pods that ended."""
    namespace = cluster_under_test.ensure_namespace("watch-maps")
    prefix = f"{key_prefix}-{deployment}"
    rec = Recorder(client, prefix, namespace)
    name = make_job(kube, namespace, deployment, ms=60_000, map_items=2)
    first = poll(kube, client, prefix, deployment, namespace, rec)  # no version yet: the LIST
    assert first.listed and rec.handed == [name]
    stored = jobwatch.load(client, jobwatch.key(prefix, deployment, namespace))
    assert list(stored.maps) == [name]

    for _ in range(3):  # each poll after the last hand-off began (it takes its marker away)
        client.delete(handoff.key(prefix, namespace, stored.maps[name]))
        done = poll(kube, client, prefix, deployment, namespace, rec)
        assert (done.listed, done.handed_off) == (False, 1)
    assert rec.handed == [name] * 4
    # Handed off, not yet begun (its marker is live): no second message behind the first.
    assert poll(kube, client, prefix, deployment, namespace, rec).handed_off == 0


def test_an_expired_version_falls_back_to_the_list_and_resumes_from_it(
    cluster_under_test: ClusterHandle, kube: KubeClient, client: redis.Redis, key_prefix: str, deployment: str,
    small_window: ClusterHandle,
) -> None:  # fmt: skip
    handle = small_window
    with KubeClient(handle.kubeconfig) as kube:
        namespace = handle.ensure_namespace("watch-gone")
        prefix = f"{key_prefix}-{deployment}"
        rec = Recorder(client, prefix, namespace)
        name = make_job(kube, namespace, deployment, ms=10)
        wait_finished(kube, namespace, [name])
        assert poll(kube, client, prefix, deployment, namespace, rec).listed
        key = jobwatch.key(prefix, deployment, namespace)
        if handle.kind == LOCAL:  # push the stored version out of a 50-event window
            for _ in range(30):
                make_job(kube, "watch-churn", "someone-else", ms=10)
            stale = jobwatch.load(client, key).version
        else:  # kube-apiserver: more changes, then etcd compacted past the stored version
            stale = jobwatch.load(client, key).version
            for _ in range(3):
                make_job(kube, "default", "someone-else", ms=10)
            compact_etcd(handle)
        assert stale is not None
        client.hset(key, "rv", stale)
        client.hdel(key, f"j:{name}")  # forgotten by the stale position: only the LIST finds it again
        client.delete(handoff.key(prefix, namespace, kube.get_job(namespace, name)))
        again = poll_until_listed(kube, client, prefix, deployment, namespace, rec)
        assert again.stored
        assert rec.handed == [name, name]  # handed off again, from the LIST
        fresh = jobwatch.load(client, key)
        assert fresh.version != stale and sorted(fresh.finished) == [name]
        assert not poll(kube, client, prefix, deployment, namespace, rec).listed  # the watch resumed from it


def poll_until_listed(
    kube: KubeClient, client: redis.Redis, prefix: str, deployment: str, namespace: str, rec: Recorder,
    timeout: float = 20.0,
) -> jobwatch.NamespacePoll:  # fmt: skip
    """Poll until a poll LISTs. Without its watch cache kube-apiserver sends etcd's "compacted"
    as an ERROR event once its etcd watch starts, which on a loaded machine can come after a
    slice's quiet window: that slice reads nothing, stores the same stale version, and the next
    poll meets the 410. A poll that did not LIST must have read and handed off nothing."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        handed = list(rec.handed)
        result = poll(kube, client, prefix, deployment, namespace, rec)
        if result.listed:
            return result
        assert result.seen == 0 and rec.handed == handed, result
    raise AssertionError(f"no poll met the 410 and listed within {timeout}s")


def compact_etcd(handle: ClusterHandle) -> None:
    """Compact the real control plane's etcd up to its current revision (what kube-apiserver
    asks of it every 5 minutes), through etcd's JSON gateway."""
    base = f"http://127.0.0.1:{handle.backend._ports['etcd']}"  # the plane's etcd, on loopback
    key = base64.b64encode(b"/").decode()
    with urllib.request.urlopen(urllib.request.Request(f"{base}/v3/kv/range", json.dumps({"key": key}).encode())) as r:
        revision = int(json.load(r)["header"]["revision"])
    body = json.dumps({"revision": revision, "physical": True}).encode()
    with urllib.request.urlopen(urllib.request.Request(f"{base}/v3/kv/compaction", body)) as r:
        assert r.status == 200


@pytest.fixture
def small_window(cluster_under_test: ClusterHandle, tmp_path: Path) -> Iterator[ClusterHandle]:
    """A cluster whose history is short within the test: localcluster with a watch cache of 50
    events; kube-apiserver with its watch cache off (`--watch-cache=false`), so that how far back
    a watch may start is etcd's compaction, which the test runs (kube-apiserver's own cache keeps
    every event until it has been full for minutes, then answers the same 410)."""
    if cluster_under_test.kind == LOCAL:
        from k8s_dispatch.demo.localcluster import LocalCluster

        with LocalCluster(mode="simulate", event_log_size=50) as cluster:
            yield local_handle(cluster)
        return
    from k8s_dispatch.lab.realcluster.controlplane import ControlPlane

    plane = ControlPlane(directory=tmp_path / "plane", mode="simulate", apiserver_args=("--watch-cache=false",))
    plane.start()
    try:
        yield real_handle(plane)
    finally:
        plane.stop()


def test_two_overlapping_polls_hand_each_job_off_once_and_one_stores(
    cluster_under_test: ClusterHandle, kube: KubeClient, client: redis.Redis, key_prefix: str, deployment: str
) -> None:
    namespace = cluster_under_test.ensure_namespace("watch-overlap")
    prefix = f"{key_prefix}-{deployment}"
    rec = Recorder(client, prefix, namespace)
    assert poll(kube, client, prefix, deployment, namespace, rec).listed  # the version to resume from
    names = [make_job(kube, namespace, deployment, ms=10) for _ in range(3)]
    wait_finished(kube, namespace, names)
    inner: list[jobwatch.NamespacePoll] = []
    # A slow poll: while it hands off, a second one (the next beat) runs from the same version.
    rec.during = lambda: inner.append(poll(kube, client, prefix, deployment, namespace, rec))

    outer = poll(kube, client, prefix, deployment, namespace, rec)
    assert inner[0].stored and not outer.stored  # the second stored first: the slow one's write is dropped
    assert inner[0].seen == outer.seen  # both read from the same version
    poll_until(
        lambda: not poll(kube, client, prefix, deployment, namespace, rec).listed and set(names) <= set(rec.handed)
    )
    assert sorted(rec.handed) == sorted(names)  # each Job handed off once, by whichever came first
    late = make_job(kube, namespace, deployment, ms=10)  # nothing is lost past the dropped write
    wait_finished(kube, namespace, [late])
    poll_until(lambda: not poll(kube, client, prefix, deployment, namespace, rec).listed and late in rec.handed)
    assert sorted(jobwatch.load(client, jobwatch.key(prefix, deployment, namespace)).finished) == sorted([*names, late])


# --- the stream kept between polls ------------------------------------------------------------


class Watches:
    """Counts the watch requests a client sends (its `on_request` observer)."""

    def __init__(self) -> None:
        self.sent = 0

    def __call__(self, verb: str, code: str) -> None:
        self.sent += verb == "watch"


def kept_streams() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("watch jobs in ") and t.is_alive())


def poll_until_handed(
    kube: KubeClient, client: redis.Redis, prefix: str, deployment: str, namespace: str, rec: Recorder,
    names: list[str], *, hold_s: float,
) -> int:  # fmt: skip
    """Poll (never through a LIST) until each of `names` has been handed off; how many polls it took."""
    polls = 0

    def handed() -> bool:
        nonlocal polls
        polls += 1
        assert not poll(kube, client, prefix, deployment, namespace, rec, hold_s=hold_s).listed
        return set(names) <= set(rec.handed)

    poll_until(handed)
    return polls


def watched_namespace(
    cluster: ClusterHandle, client: redis.Redis, key_prefix: str, deployment: str, name: str
) -> tuple[str, str, Recorder]:
    """A namespace of the cluster, the deployment's key prefix, and a recorder of its hand-offs."""
    namespace, prefix = cluster.ensure_namespace(name), f"{key_prefix}-{deployment}"
    return namespace, prefix, Recorder(client, prefix, namespace)


def test_polls_that_follow_each_other_read_one_kept_stream_without_a_new_request(
    cluster_under_test: ClusterHandle, client: redis.Redis, key_prefix: str, deployment: str
) -> None:
    namespace, prefix, rec = watched_namespace(cluster_under_test, client, key_prefix, deployment, "watch-kept")
    watches = Watches()
    with KubeClient(cluster_under_test.kubeconfig, on_request=watches) as kube:
        assert poll(kube, client, prefix, deployment, namespace, rec, hold_s=30).listed
        for _ in range(2):  # the first watch is closed after its slice; the second follows it and is kept
            assert not poll(kube, client, prefix, deployment, namespace, rec, hold_s=30).listed
        assert watches.sent == 2
        names: list[str] = []
        for _ in range(3):  # Jobs made between polls are read from the kept stream
            names += [make_job(kube, namespace, deployment, ms=10) for _ in range(2)]
            wait_finished(kube, namespace, names)
            poll_until_handed(kube, client, prefix, deployment, namespace, rec, names, hold_s=30)
        assert watches.sent == 2  # not one request more
        assert sorted(rec.handed) == sorted(names)  # each handed off once
        release(kube, namespace, names[0])  # its DELETED event comes through the kept stream too
        key = jobwatch.key(prefix, deployment, namespace)

        def forgotten() -> bool:
            assert not poll(kube, client, prefix, deployment, namespace, rec, hold_s=30).listed
            return names[0] not in jobwatch.load(client, key).finished

        poll_until(forgotten)
        assert watches.sent == 2 and kept_streams() >= 1
    assert kept_streams() == 0  # closing the client closes its streams


def test_a_kept_stream_rings_when_a_job_finishes_before_any_poll_reads_it(
    cluster_under_test: ClusterHandle, client: redis.Redis, key_prefix: str, deployment: str
) -> None:
    """The doorbell of prompt polls: the kept stream's reader rings the namespace as soon as it
    receives a finished Job (not its creation, nor its start), and the poll that follows hands it off
    from that stream."""
    namespace, prefix, rec = watched_namespace(cluster_under_test, client, key_prefix, deployment, "watch-rings")
    rung = threading.Event()
    at_ring: list[dict[str, Any]] = []

    def ring(ns: str) -> None:
        assert ns == namespace
        if not rung.is_set():
            at_ring.append(
                {
                    j["metadata"]["name"]: j
                    for page in kube.iter_jobs(namespace, label_selector=job_labels.selector())
                    for j in page
                }
            )
            rung.set()

    watches = Watches()
    with KubeClient(cluster_under_test.kubeconfig, on_request=watches) as kube:
        assert poll(kube, client, prefix, deployment, namespace, rec, hold_s=30, ring=ring).listed
        for _ in range(2):  # the second watch follows the first and is kept
            assert not poll(kube, client, prefix, deployment, namespace, rec, hold_s=30, ring=ring).listed
        sent = watches.sent
        name = make_job(kube, namespace, deployment, ms=1500)
        assert rung.wait(60), "the kept stream never rang"
        jobs = at_ring[0]
        assert name in jobs and job_state(jobs[name]).terminal, "rang before the Job finished"
        assert rec.handed == []  # no poll has read it yet
        assert not poll(kube, client, prefix, deployment, namespace, rec, hold_s=30, ring=ring).listed
        assert rec.handed == [name]  # read from the kept stream, at once
        assert watches.sent == sent


def test_a_kept_stream_is_not_read_when_another_poll_stored_a_version(
    cluster_under_test: ClusterHandle, client: redis.Redis, key_prefix: str, deployment: str
) -> None:
    """Two replicas taking turns: each poll resumes from the version the other stored, so neither
    reads a stream it kept at an older one, and neither keeps one after a poll that followed the other's."""
    namespace, prefix, rec = watched_namespace(cluster_under_test, client, key_prefix, deployment, "watch-turns")
    watches = [Watches(), Watches()]
    with (
        KubeClient(cluster_under_test.kubeconfig, on_request=watches[0]) as a,
        KubeClient(cluster_under_test.kubeconfig, on_request=watches[1]) as b,
    ):
        assert poll(a, client, prefix, deployment, namespace, rec, hold_s=30).listed
        for _ in range(2):  # a keeps its stream: it made the poll before
            assert not poll(a, client, prefix, deployment, namespace, rec, hold_s=30).listed
        names = [make_job(b, namespace, deployment, ms=10) for _ in range(2)]
        wait_finished(b, namespace, names)
        poll_until_handed(b, client, prefix, deployment, namespace, rec, names, hold_s=30)
        sent = [w.sent for w in watches]
        late = make_job(b, namespace, deployment, ms=10)
        wait_finished(b, namespace, [late])
        # a's kept stream stands at the version a stored, b has stored a later one: a opens a new watch
        poll_until_handed(a, client, prefix, deployment, namespace, rec, [late], hold_s=30)
        assert watches[0].sent == sent[0] + 1
        assert sorted(rec.handed) == sorted([*names, late])  # each once, whichever read it
        for turn in range(4):  # taking turns, each after a change: every turn's first poll is a new watch
            polling, watched = (b, a)[turn % 2], watches[(1, 0)[turn % 2]]
            names.append(make_job(polling, namespace, deployment, ms=10))
            wait_finished(polling, namespace, names[-1:])
            before = watched.sent
            assert not poll(polling, client, prefix, deployment, namespace, rec, hold_s=30).listed
            assert watched.sent == before + 1
            poll_until_handed(polling, client, prefix, deployment, namespace, rec, names, hold_s=30)
        assert sorted(rec.handed) == sorted([*names, late])


def test_a_kept_stream_the_server_ended_is_replaced_in_the_same_poll_and_loses_nothing(
    cluster_under_test: ClusterHandle, client: redis.Redis, key_prefix: str, deployment: str
) -> None:
    namespace, prefix, rec = watched_namespace(cluster_under_test, client, key_prefix, deployment, "watch-ended")
    watches = Watches()
    with KubeClient(cluster_under_test.kubeconfig, on_request=watches) as kube:
        assert poll(kube, client, prefix, deployment, namespace, rec, hold_s=1).listed
        names: list[str] = []
        polls = 0
        deadline = time.monotonic() + 8  # several of the streams' 1 s lives
        while time.monotonic() < deadline:
            names.append(make_job(kube, namespace, deployment, ms=10))
            # a poll every 0.1 s, never a LIST
            polls += poll_until_handed(kube, client, prefix, deployment, namespace, rec, names[-1:], hold_s=1)
        assert sorted(rec.handed) == sorted(names)
        assert 3 <= watches.sent <= polls // 2, (watches.sent, polls)  # replaced as they ended, not for every poll


def test_a_poll_reads_past_the_end_of_its_kept_stream_in_the_same_slice(
    cluster_under_test: ClusterHandle, client: redis.Redis, key_prefix: str, deployment: str
) -> None:
    """A kept stream that ended between polls, holding events it had received: the poll reads
    them and what came after its end (from a new stream) in one slice, not a poll later."""
    namespace, prefix, rec = watched_namespace(cluster_under_test, client, key_prefix, deployment, "watch-past-end")
    watches = Watches()
    with KubeClient(cluster_under_test.kubeconfig, on_request=watches) as kube:
        assert poll(kube, client, prefix, deployment, namespace, rec, hold_s=2).listed
        for _ in range(2):  # the second poll follows the first: its stream (2 s to live) is kept
            assert not poll(kube, client, prefix, deployment, namespace, rec, hold_s=2).listed
        sent = watches.sent
        before_end = make_job(kube, namespace, deployment, ms=10)  # received by the kept stream
        poll_until(lambda: kept_streams() == 0)  # the server ended it; what it received is still queued
        after_end = make_job(kube, namespace, deployment, ms=10)  # only a new stream can read it
        wait_finished(kube, namespace, [before_end, after_end])
        assert not poll(kube, client, prefix, deployment, namespace, rec, hold_s=2).listed
        assert sorted(rec.handed) == sorted([before_end, after_end])  # both, in this one poll
        assert watches.sent == sent + 1


def test_a_kept_stream_that_breaks_off_with_an_error_after_events_loses_none_of_them(
    local_sim_cluster: ClusterHandle, client: redis.Redis, key_prefix: str, deployment: str
) -> None:
    """A kept stream received events, then the server broke it off with an ERROR (not 410): the
    poll hands those events' Jobs off and goes on from a new stream, without a LIST."""
    cluster = local_sim_cluster
    namespace, prefix, rec = watched_namespace(cluster, client, key_prefix, deployment, "watch-broken")
    watches = Watches()
    with KubeClient(cluster.kubeconfig, on_request=watches) as kube:
        assert poll(kube, client, prefix, deployment, namespace, rec, hold_s=30).listed
        for _ in range(2):  # the second poll follows the first: its stream is kept
            assert not poll(kube, client, prefix, deployment, namespace, rec, hold_s=30).listed
        sent = watches.sent
        names = [make_job(kube, namespace, deployment, ms=10) for _ in range(2)]
        wait_finished(kube, namespace, names)
        # The kept stream has the Jobs' events queued; an ERROR follows them.
        assert cluster.backend.break_watches(500) >= 1
        poll_until(lambda: kept_streams() == 0)  # the reader read the ERROR and the end
        after = poll(kube, client, prefix, deployment, namespace, rec, hold_s=30)
        assert not after.listed and sorted(rec.handed) == sorted(names)  # in this one poll
        assert watches.sent == sent + 1  # the broken stream replaced by one new watch
        late = make_job(kube, namespace, deployment, ms=10)
        wait_finished(kube, namespace, [late])
        poll_until_handed(kube, client, prefix, deployment, namespace, rec, [late], hold_s=30)
        assert sorted(rec.handed) == sorted([*names, late])
