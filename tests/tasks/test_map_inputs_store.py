"""A map's inputs through the object store (issue 29) end to end: real `celery worker|beat`
processes, PostgreSQL, Redis, SeaweedFS and localcluster in exec mode, where each Pod runs
`k8s_dispatch.container.runner` for real. The Job as created and its Pods carry a presigned URL
and the packed object's root, no item's input; each Pod reads its own item with ranged GETs and
its output is its own input's; an item whose bytes were changed in the store fails typed, the
others complete; a lost Job made again for its open items gets an object of its own and each
item still reads its own input.

The capability has a Kueue queue, so each Job is created suspended: the test looks at (and
changes the object of) a Job before any of its Pods can start, then admits it as Kueue would.
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from clusters import local_handle
from kubernetes import client
from objectstore import ObjectStoreServer

from k8s_dispatch import api, celeryconfig
from k8s_dispatch.artifacts import Artifacts
from k8s_dispatch.container.contract import INPUT_MISMATCH, ITEMS_FIELD, ITEMS_REF_ENV, ITEMS_URL_ENV
from k8s_dispatch.core.payloads import canonical_json
from k8s_dispatch.core.settings import load_settings
from k8s_dispatch.demo.functions import sha256
from k8s_dispatch.demo.localcluster import LocalCluster
from k8s_dispatch.store import maps
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import EventType
from k8s_dispatch.workers import indexed
from k8s_dispatch.workers.manifest import FINALIZER, job_name
from k8s_dispatch.workers.resolver import CapabilityResolver, demo_config

CAPABILITY = "held.sha256"
# Each item some 600 bytes: 12 of them are over the few KiB an env array may carry.
TEXTS = [f"item {i}: " + "lorem ipsum " * (40 + i) for i in range(12)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(mode="exec", tls=False) as lc:
        yield lc


@pytest.fixture
def store_env(object_store: ObjectStoreServer, unique_prefix: str) -> dict[str, str]:
    return {k.removeprefix("K8S_DISPATCH_").lower(): v for k, v in object_store.env(unique_prefix).items()}


def _deploy(deploy: Any, cluster: LocalCluster, store_env: dict[str, str], **overrides: str) -> Any:
    capabilities = demo_config(python=sys.executable)["capabilities"]
    held = {**capabilities["demo.sha256"], "queue": "held"}
    return deploy(cluster, capabilities={CAPABILITY: held}, **store_env, **overrides)


def _schedule(d: Any, texts: list[str], parallelism: int) -> str:
    with transaction(d.sessions) as session:
        case_id = f"case-{uuid.uuid4().hex[:10]}"
        api.create_case(session, case_id=case_id, tenancy_id="tenant-a")
        return api.schedule_map_in_session(
            session,
            case_id=case_id,
            tenancy_id="tenant-a",
            capability=CAPABILITY,
            items=[{"text": t} for t in texts],
            idempotency_key=f"map-{uuid.uuid4().hex}",
            parallelism=parallelism,
            router=CapabilityResolver.from_settings(d.settings),
            max_input_bytes=d.settings.max_input_bytes,
            via=d.producer,
        ).dispatch_id


def _job(d: Any, map_id: str, *, not_uid: str | None = None) -> dict[str, Any]:
    name = job_name(map_id)
    return d.wait(
        lambda: next((j for j in d.jobs() if j["metadata"]["name"] == name and j["metadata"]["uid"] != not_uid), None),
        timeout_s=60,
        what="the map's Job",
    )


def _env(body: dict[str, Any]) -> dict[str, str]:
    spec = body["spec"]["template"]["spec"] if "template" in body["spec"] else body["spec"]
    return {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}


def _reference(job: dict[str, Any]) -> dict[str, Any]:
    env = _env(job)
    assert indexed.ITEMS_ENV not in env and env[ITEMS_URL_ENV].startswith("http"), env.keys()
    body: dict[str, Any] = json.loads(env[ITEMS_REF_ENV])[ITEMS_FIELD]
    return body


def _no_inputs_in(body: dict[str, Any], texts: list[str]) -> None:
    text = json.dumps(body)
    assert not any(t[:30] in text for t in texts)
    assert len(text) < 8 * 1024


def _admit(d: Any, map_id: str) -> None:
    with local_handle(d.cluster).api_client() as api_client:  # as Kueue would
        client.BatchV1Api(api_client).patch_namespaced_job(job_name(map_id), d.namespace, {"spec": {"suspend": False}})


def _outcomes(d: Any, map_id: str) -> list[api.ItemOutcome]:
    with transaction(d.sessions) as session:
        return sorted(api.item_outcomes(session, map_id), key=lambda o: o.index)


def _artifacts(d: Any) -> Artifacts:
    built = Artifacts.from_settings(load_settings({k: v for k, v in d.env.items() if k.startswith("K8S_DISPATCH_")}))
    assert built is not None
    return built


def test_each_pod_reads_its_own_item_and_no_pod_carries_the_inputs(deploy, cluster, store_env):
    d = _deploy(deploy, cluster, store_env)
    d.start_worker("w1")
    d.start_beat()
    map_id = _schedule(d, TEXTS, parallelism=3)
    job = _job(d, map_id)
    reference = _reference(job)
    assert reference["items"] == len(TEXTS) and reference["key"].endswith("/items/" + reference["root"])
    _no_inputs_in(job, TEXTS)
    stored = _artifacts(d).store.size(reference["key"])
    assert stored == reference["size"] > sum(len(t) for t in TEXTS)

    _admit(d, map_id)
    pods = d.wait(
        lambda: d.kube.list_pods(d.namespace, label_selector=f"batch.kubernetes.io/job-name={job_name(map_id)}"),
        timeout_s=60,
        what="the map's Pods",
    )
    for pod in pods:
        _no_inputs_in(pod, TEXTS)
    [(event, payload)] = d.wait_terminal([map_id], timeout_s=120)[map_id]
    assert event == EventType.WORKER_COMPLETED.value, payload
    outcomes = _outcomes(d, map_id)
    assert [o.index for o in outcomes] == list(range(len(TEXTS)))
    assert [o.payload.get("output") for o in outcomes] == [sha256({"text": t}) for t in TEXTS]
    d.wait_no_jobs(timeout_s=30)
    d.stop()


def test_an_item_whose_stored_bytes_changed_fails_typed_and_the_others_complete(deploy, cluster, store_env):
    d = _deploy(deploy, cluster, store_env)
    d.start_worker("w1")
    d.start_beat()
    map_id = _schedule(d, TEXTS, parallelism=4)
    reference = _reference(_job(d, map_id))
    store = _artifacts(d).store
    data = b"".join(store.read(reference["key"]))
    own = canonical_json({"text": TEXTS[5]}).encode()
    assert data.count(own) == 1
    store.put(reference["key"], data.replace(own, own.replace(b"ipsum", b"IPSUM", 1)))  # same size

    _admit(d, map_id)
    [(event, payload)] = d.wait_terminal([map_id], timeout_s=120)[map_id]
    assert event == EventType.WORKER_FAILED.value and payload["detail"]["succeeded"] == len(TEXTS) - 1, payload
    outcomes = _outcomes(d, map_id)
    bad = outcomes[5]
    assert bad.event is api.ItemEventType.ITEM_FAILED and bad.payload["reason"] == "ContainerFailed", bad
    assert bad.payload["message"].startswith(f"{INPUT_MISMATCH}: "), bad
    assert "the function was not called" in bad.payload["message"]
    good = [o for o in outcomes if o.index != 5]
    assert [o.payload.get("output") for o in good] == [sha256({"text": t}) for i, t in enumerate(TEXTS) if i != 5]
    d.wait_no_jobs(timeout_s=30)
    d.stop()


def test_a_job_made_again_for_its_open_items_reads_the_right_items(deploy, cluster, store_env):
    d = _deploy(deploy, cluster, store_env, sweep_interval_s="1", sweep_grace_s="1")
    d.start_worker("w1")
    d.start_beat()
    map_id = _schedule(d, TEXTS, parallelism=1)
    name, namespace = job_name(map_id), d.namespace
    first = _job(d, map_id)
    before = _reference(first)
    _admit(d, map_id)
    d.wait(lambda: len(_outcomes(d, map_id)) >= 3, timeout_s=60, what="3 items ended")
    for pod in d.kube.list_pods(namespace, label_selector=f"batch.kubernetes.io/job-name={name}"):
        d.kube.release_pod(namespace, pod, finalizer=FINALIZER)
    d.kube.remove_finalizer(namespace, name, FINALIZER)
    d.kube.delete_job(namespace, name, uid=first["metadata"]["uid"])
    again = _job(d, map_id, not_uid=first["metadata"]["uid"])
    ended_before = {o.index for o in _outcomes(d, map_id)}

    runs = indexed.item_indexes(again)
    assert runs is not None and not set(runs) & ended_before, (runs, ended_before)
    after = _reference(again)
    assert after["items"] == len(runs) < len(TEXTS)
    assert after["root"] != before["root"] and after["key"] != before["key"]
    _no_inputs_in(again, TEXTS)
    _admit(d, map_id)

    [(event, payload)] = d.wait_terminal([map_id], timeout_s=120)[map_id]
    assert event == EventType.WORKER_COMPLETED.value, payload
    outcomes = _outcomes(d, map_id)
    assert [o.index for o in outcomes] == list(range(len(TEXTS)))  # one event each
    assert [o.payload.get("output") for o in outcomes] == [sha256({"text": t}) for t in TEXTS]
    d.wait_no_jobs(timeout_s=30)
    d.stop()


def test_a_map_four_times_the_env_cap_runs_each_item_on_its_own_input(deploy, cluster, store_env):
    """With a store a map may hold more than the env's 256 KiB: 1 MiB here (each item 32 KiB,
    the env's own limit for one input), scheduled with `max_stored_input_bytes`; the Job and its
    Pods stay a few KiB."""
    texts = [f"item {i}: " + chr(ord("a") + i % 26) * (32 * 1024 - 100) for i in range(34)]
    assert len(canonical_json([{"text": t} for t in texts])) > 4 * maps.MAX_MAP_INPUT_BYTES
    d = _deploy(deploy, cluster, store_env)
    d.start_worker("w1")
    d.start_beat()
    with transaction(d.sessions) as session:
        case_id = f"case-{uuid.uuid4().hex[:10]}"
        api.create_case(session, case_id=case_id, tenancy_id="tenant-a")
        request = maps.MapRequest(
            case_id=case_id, tenancy_id="tenant-a", capability=CAPABILITY, items=[{"text": t} for t in texts],
            idempotency_key=f"map-{uuid.uuid4().hex}", parallelism=4,
        )  # fmt: skip
        map_id = maps.schedule_map(
            session,
            request,
            router=CapabilityResolver.from_settings(d.settings),
            max_input_bytes=d.settings.max_input_bytes,
            max_stored_input_bytes=d.settings.max_stored_input_bytes,
        ).dispatch_id
    d.send(celeryconfig.CREATE_JOB_TASK, map_id)
    job = _job(d, map_id)
    assert _reference(job)["items"] == len(texts)
    _no_inputs_in(job, texts)
    _admit(d, map_id)
    [(event, payload)] = d.wait_terminal([map_id], timeout_s=120)[map_id]
    assert event == EventType.WORKER_COMPLETED.value, payload
    outcomes = _outcomes(d, map_id)
    assert [o.payload.get("output") for o in outcomes] == [sha256({"text": t}) for t in texts]
    d.wait_no_jobs(timeout_s=30)
    d.stop()
