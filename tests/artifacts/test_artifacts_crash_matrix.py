"""Issue 28's crash matrix: a worker SIGKILLed between the upload and the record, between the
record and the release, and during an orphan deletion. Real `celery worker` and `beat`
processes, PostgreSQL, Redis, SeaweedFS, and localcluster in exec mode, where each Job is the
runner as a local process that uploads its own result through its attempt's presigned URL.

The Pod uploads, the worker records: the first crash is the worker's, after it has read the
uploaded object back to verify it and before the terminal event commits (`before_complete_write`
comes after verification); the second after the commit and before any release, so the failed
Pod's log (`archiveLogs: onFailure`) is not archived yet (`after_complete_write`); the third
kills the worker running the object store's cleanup while one of its DELETEs is in flight (held
by a relay in front of the store: the cleanup lives in `artifacts`, below the layer the
crash points live in, and the relay puts the kill inside the deletion itself, not beside it).

After a fresh worker, beat and the cleanup: each dispatch has exactly one terminal event, every
recorded reference verifies against the bytes the test expects, no Job is left, and every object
under the prefix is a recorded result or an archived log of an ended dispatch (no orphan).
"""

from __future__ import annotations

import hashlib
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from funcs import random_bytes
from objectstore import ObjectStoreServer
from store_relay import StoreRelay

from k8s_dispatch import celeryconfig
from k8s_dispatch.artifacts import Artifacts, keys
from k8s_dispatch.artifacts.reference import parse_reference
from k8s_dispatch.core.settings import load_settings
from k8s_dispatch.delivery.crashpoints import ENV_VAR as CRASH_AT
from k8s_dispatch.delivery.crashpoints import Point
from k8s_dispatch.demo.localcluster import LocalCluster
from k8s_dispatch.store import scheduling
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import EventType
from k8s_dispatch.tasks import supersede
from k8s_dispatch.tasks.scheduling import schedule_many_in_session
from k8s_dispatch.workers.job_status import job_state
from k8s_dispatch.workers.manifest import FINALIZER, job_name
from k8s_dispatch.workers.resolver import CapabilityResolver
from tests.tasks.conftest import Deployment, Proc, wait_until

HERE = Path(__file__).resolve().parent
RESULT_BYTES = 1 << 20
RUNNER = [sys.executable, "-m", "k8s_dispatch.container.runner"]
CAPABILITIES: dict[str, Any] = {
    "big": {  # a result of RESULT_BYTES, uploaded by the runner, verified and recorded
        "worker": "exec", "image": "k8s-dispatch:latest", "command": RUNNER, "args": ["funcs:random_bytes"],
        "env": {"PYTHONPATH": str(HERE)}, "results": "objectStore", "maxResultBytes": 4 * RESULT_BYTES,
        "activeDeadlineSeconds": 120,
    },
    "toolarge": {  # uploaded, then refused by delivery (ResultTooLarge): its object an orphan
        "worker": "exec", "image": "k8s-dispatch:latest", "command": RUNNER, "args": ["funcs:random_bytes"],
        "env": {"PYTHONPATH": str(HERE)}, "results": "objectStore", "maxResultBytes": 1024,
        "activeDeadlineSeconds": 120,
    },
    "fails": {  # exits 3: its log archived before its Pod is freed (archiveLogs: onFailure, the default)
        "worker": "exec", "image": "k8s-dispatch:latest",
        "command": [sys.executable, "-c", "import sys; print('boom: the work failed', flush=True); sys.exit(3)"],
        "activeDeadlineSeconds": 120,
    },
}  # fmt: skip
MIX = ["big", "big", "big", "toolarge", "toolarge", "fails"]
CONVERGE_S = 120.0


@pytest.fixture(scope="module")
def exec_cluster() -> Iterator[LocalCluster]:
    with LocalCluster(mode="exec", max_running=4) as cluster:
        yield cluster


@pytest.fixture
def relay(object_store: ObjectStoreServer) -> Iterator[StoreRelay]:
    relayed = StoreRelay(object_store.endpoint)
    yield relayed
    relayed.close()


class World:
    """The deployment under test (its object store the relay), and the test's own direct view of the store."""

    def __init__(self, d: Deployment, store: Artifacts, relay: StoreRelay) -> None:
        self.d, self.store, self.relay = d, store, relay
        self.inputs: dict[str, tuple[str, dict[str, int]]] = {}  # dispatch id -> (capability, input)

    def schedule(self, capabilities: list[str]) -> list[str]:
        case_id = self.d.new_case()
        seed = len(self.inputs)
        requests = []
        for i, capability in enumerate(capabilities):
            value = {"seed": seed + i, "size": RESULT_BYTES if capability != "toolarge" else 64 * 1024}
            requests.append(scheduling.ScheduleRequest(case_id, "tenant-a", capability, value, f"k-{seed + i}"))
        with transaction(self.d.sessions) as session:
            results = schedule_many_in_session(
                session, requests, router=CapabilityResolver.from_settings(self.d.settings),
                max_input_bytes=self.d.settings.max_input_bytes, via=self.d.producer,
            )  # fmt: skip
        ids = [r.dispatch_id for r in results]
        for dispatch_id, request in zip(ids, requests, strict=True):
            self.inputs[dispatch_id] = (request.capability, request.input)
        return ids

    def keys(self) -> set[str]:
        return {item.key for item in self.store.store.list(self.store.prefix + "/")}

    def killed(self, proc: Proc) -> None:
        """`proc` died by SIGKILL (its crash point, or the test's); off the list of processes to stop."""
        wait_until(lambda: not proc.managed.alive, timeout_s=90, what=f"{proc.name} to die", on_fail=proc.tail)
        assert proc.managed.returncode == -signal.SIGKILL, proc.tail()
        self.d.procs.remove(proc)

    def clean_up(self) -> None:
        """Send the object store's cleanup now. A run holds off the next ones for half of beat's
        interval (five minutes at least): its Redis window is expired first, as that time passing would."""
        self.d.redis.delete(supersede.key(self.d.prefix, celeryconfig.ARTIFACTS_CLEANUP_TASK))
        self.d.send(celeryconfig.ARTIFACTS_CLEANUP_TASK)

    def assert_converged(self) -> None:
        """One terminal event each, the right one; references that verify; no Job; no orphan."""
        ids = list(self.inputs)
        events = self.d.wait_terminal(ids, timeout_s=CONVERGE_S)
        recorded, logs = set(), set()
        for dispatch_id, (capability, value) in self.inputs.items():
            assert len(events[dispatch_id]) == 1, (dispatch_id, events[dispatch_id])
            [(event, payload)] = events[dispatch_id]
            if capability == "big":
                assert event == EventType.WORKER_COMPLETED, payload
                reference = parse_reference(payload["output"])
                parsed = keys.parse_key(self.store.prefix, reference.key)
                assert parsed is not None and parsed[0] == dispatch_id
                expected = random_bytes(value)
                assert (reference.size, reference.sha256) == (len(expected), hashlib.sha256(expected).hexdigest())
                assert b"".join(self.store.read(reference)) == expected
                recorded.add(reference.key)
            elif capability == "toolarge":
                assert (event, payload["reason"]) == (EventType.WORKER_FAILED, "ResultTooLarge"), payload
            else:
                assert event == EventType.WORKER_FAILED and payload["detail"]["exit_code"] == 3, payload
                logs.add(payload["detail"]["log_key"])
        self.d.wait_no_jobs(timeout_s=60)

        self.clean_up()

        def no_orphan() -> bool:
            left = self.keys()
            ours = {k for k in left if keys.parse_log_key(self.store.prefix, k) is not None}
            return left == recorded | ours and logs <= ours

        wait_until(no_orphan, timeout_s=60, what="only recorded results and logs left", on_fail=self.d.logs)
        for key in logs:
            assert b"boom: the work failed" in b"".join(self.store.store.read(key))


@pytest.fixture
def world(deploy, exec_cluster, object_store, relay, unique_prefix) -> World:
    d = deploy(
        exec_cluster,
        capabilities=CAPABILITIES,
        object_store_endpoint=relay.endpoint,
        object_store_bucket=object_store.bucket,
        object_store_prefix=unique_prefix,
        object_store_access_key=object_store.access_key,
        object_store_secret_key=object_store.secret_key,
        object_store_orphan_grace_s="0",
        # Fast recovery, as tests/recovery's crash matrix: sweeps every second on rows a second
        # old, a dead holder's claim expiring after 5 s.
        sweep_grace_s="1",
        sweep_interval_s="1",
        poll_interval_s="0.25",
        guard_lease_ms="5000",
    )
    store = Artifacts.from_settings(load_settings(object_store.env(unique_prefix)))
    assert store is not None
    return World(d, store, relay)


def test_a_worker_killed_between_the_upload_and_the_record(world: World) -> None:
    d = world.d
    doomed = d.start_worker("doomed", env={CRASH_AT: Point.BEFORE_COMPLETE_WRITE.value})
    d.start_beat()
    first = world.schedule(["big", "big"])
    world.killed(doomed)

    # Died after the Pod's upload and the worker's check of it (a HEAD: the store's SHA-256), before the record.
    rows = {r: d.terminal_events([r])[r] for r in first}
    uploaded = [
        dispatch_id
        for dispatch_id in first
        if world.store.store.size(keys.result_key(world.store.prefix, dispatch_id, 0)) == RESULT_BYTES
    ]
    read = {s.path for s in world.relay.seen("HEAD") + world.relay.seen("GET")}
    verified = [r for r in uploaded if any(path.endswith(keys.result_key(world.store.prefix, r, 0)) for path in read)]
    assert verified and all(rows[r] == [] for r in verified), (rows, read)

    world.schedule(MIX)
    d.start_worker("fresh")
    world.assert_converged()


def test_a_worker_killed_between_the_record_and_the_release(world: World) -> None:
    d = world.d
    doomed = d.start_worker("doomed", env={CRASH_AT: Point.AFTER_COMPLETE_WRITE.value})
    d.start_beat()
    [failing] = world.schedule(["fails"])
    world.killed(doomed)

    # Recorded, naming where its log will be; the Job and its Pod still held; the log not archived.
    [(event, payload)] = d.terminal_events([failing])[failing]
    assert event == EventType.WORKER_FAILED
    log_key = payload["detail"]["log_key"]
    [job] = [j for j in d.jobs() if j["metadata"]["name"] == job_name(failing)]
    assert FINALIZER in job["metadata"]["finalizers"] and job_state(job).terminal
    pods = d.kube.list_pods(d.namespace, label_selector=f"batch.kubernetes.io/job-name={job_name(failing)}")
    assert pods and all(FINALIZER in p["metadata"]["finalizers"] for p in pods)
    assert world.store.store.size(log_key) is None

    world.schedule(MIX)
    d.start_worker("fresh")
    world.assert_converged()


def test_a_worker_killed_during_an_orphan_deletion(world: World) -> None:
    d = world.d
    first = d.start_worker("first")
    d.start_beat()
    world.schedule(MIX)
    d.wait_terminal(list(world.inputs), timeout_s=CONVERGE_S)
    orphans = {keys.result_key(world.store.prefix, r, 0) for r, (c, _) in world.inputs.items() if c == "toolarge"}
    assert orphans <= world.keys()
    first.stop()
    d.procs.remove(first)

    doomed = d.start_worker("doomed")
    world.relay.hold("DELETE", 2)  # the first deletion goes through, the second is in flight
    world.clean_up()
    wait_until(world.relay.holding.is_set, timeout_s=60, what="the cleanup's second DELETE", on_fail=d.logs)
    doomed.managed.kill(signal.SIGKILL)
    world.killed(doomed)
    world.relay.release()
    assert len(orphans & world.keys()) == len(orphans) - 1  # one deleted, the other's DELETE never arrived

    d.start_worker("fresh")
    world.assert_converged()
