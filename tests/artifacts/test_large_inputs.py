"""Inputs larger than a Job's env, through the delivery path on both clusters (exec mode, the
runner in a real process) with SeaweedFS: the Job carries only a presigned URL and the object's
reference, the function gets the input byte for byte, an object changed after the create fails
the run typed before the function is called, and the input object goes with the dispatch's
other objects once it has ended. Without an object store such an input is refused at schedule."""

from __future__ import annotations

import hashlib
import json
import random
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from clusters import LOCAL, REAL, ClusterHandle, local_handle, real_handle
from kubernetes import client
from objectstore import ObjectStoreServer

from k8s_dispatch import artifacts
from k8s_dispatch.artifacts import keys
from k8s_dispatch.artifacts.cleanup import clean
from k8s_dispatch.container.contract import INPUT_ENV, INPUT_MISMATCH, INPUT_REF_ENV, INPUT_URL_ENV
from k8s_dispatch.core.errors import InputTooLarge
from k8s_dispatch.core.payloads import canonical_json
from k8s_dispatch.core.settings import load_settings
from k8s_dispatch.delivery.complete import CompleteOutcome, complete_job
from k8s_dispatch.delivery.create import CreateOutcome, create_job_for
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.ops.processes import wait_until
from k8s_dispatch.store import dispatches, scheduling
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import CaseEvent, Dispatch, EventType
from k8s_dispatch.workers.job_status import job_state
from k8s_dispatch.workers.manifest import job_name

MIB = 1 << 20
RUNNER = {
    "worker": "inputs",
    "image": "k8s-dispatch:latest",
    "command": [sys.executable, "-m", "k8s_dispatch.container.runner"],
    "args": ["input_funcs:digest"],
    "env": {"PYTHONPATH": str(Path(__file__).parent)},
    "activeDeadlineSeconds": 120,
}
CAPABILITIES = {
    "capabilities": {
        "digest": RUNNER,
        # Created suspended (as for Kueue): the test changes the object before the Pod can read it.
        "held": {**RUNNER, "queue": "held"},
    }
}


@pytest.fixture(scope="module", params=[LOCAL, REAL])
def exec_cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    """Each cluster in exec mode: the container's command runs as a real process."""
    if request.param == LOCAL:
        from k8s_dispatch.demo.localcluster import LocalCluster

        with LocalCluster(mode="exec", max_running=2, tls=False) as cluster:
            yield local_handle(cluster)
    else:
        from k8s_dispatch.lab.realcluster.controlplane import ControlPlane

        plane = ControlPlane(directory=tmp_path_factory.mktemp("inputs-real"), mode="exec")
        plane.start()
        try:
            yield real_handle(plane)
        finally:
            plane.stop()


def _runtime(cluster: ClusterHandle, env: dict[str, str], tmp_path: Path) -> Runtime:
    caps = tmp_path / "capabilities.yaml"
    caps.write_text(yaml.safe_dump(CAPABILITIES))
    return Runtime.from_settings(
        load_settings(
            {
                **env,
                "K8S_DISPATCH_NAMESPACE": "default",
                "K8S_DISPATCH_KUBECONFIG": str(cluster.kubeconfig),
                "K8S_DISPATCH_CAPABILITIES": str(caps),
                "K8S_DISPATCH_OBJECT_STORE_ORPHAN_GRACE_S": "0",
            }
        )
    )


@pytest.fixture
def base_env(unique_prefix: str, pg_url: str, redis_url: str, key_prefix: str) -> dict[str, str]:
    return {
        "K8S_DISPATCH_DATABASE_URL": pg_url,
        "K8S_DISPATCH_REDIS_URL": redis_url,
        "K8S_DISPATCH_KEY_PREFIX": f"{key_prefix}-{unique_prefix}",
    }


@pytest.fixture
def rt(
    exec_cluster: ClusterHandle, object_store: ObjectStoreServer, unique_prefix: str, base_env: dict[str, str],
    tmp_path: Path,
) -> Iterator[Runtime]:  # fmt: skip
    runtime = _runtime(exec_cluster, {**base_env, **object_store.env(unique_prefix)}, tmp_path)
    yield runtime
    runtime.close()


def _big_input(seed: int, size: int = MIB) -> dict[str, Any]:
    """At least `size` bytes of canonical JSON, different for every seed."""
    blob = random.Random(seed).randbytes(size // 2).hex()
    return {"blob": blob, "seed": seed, "note": "$(HOME) and unicode \u00e9"}


def _schedule(rt: Runtime, capability: str, value: Any) -> str:
    case_id = f"case-{uuid.uuid4().hex[:8]}"
    with transaction(rt.sessions) as session:
        scheduling.create_case(session, case_id=case_id, tenancy_id="t")
        return scheduling.schedule(
            session, case_id=case_id, tenancy_id="t", capability=capability, input=value,
            idempotency_key=uuid.uuid4().hex, router=rt.resolver, max_input_bytes=rt.settings.max_input_bytes,
            max_stored_input_bytes=rt.settings.max_stored_input_bytes,
        ).dispatch_id  # fmt: skip


def _finished(rt: Runtime, dispatch_id: str) -> None:
    wait_until(
        lambda: job_state(rt.kube.get_job("default", job_name(dispatch_id))).terminal,
        what="the job finished",
        timeout=90.0,
    )


def _env(job: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}


def _terminal(rt: Runtime, dispatch_id: str) -> tuple[str, dict[str, Any]]:
    with transaction(rt.sessions) as session:
        event = dispatches.terminal_event(session, dispatch_id)
        assert event is not None
        return event.type, dict(event.payload)


def test_a_1_mib_input_reaches_the_function_intact_and_the_job_carries_only_its_reference(rt: Runtime) -> None:
    value = _big_input(1)
    text = canonical_json(value)
    assert len(text.encode()) >= MIB > rt.settings.max_input_bytes
    dispatch_id = _schedule(rt, "digest", value)
    assert create_job_for(rt, dispatch_id) is CreateOutcome.CREATED

    job = rt.kube.get_job("default", job_name(dispatch_id))
    env = _env(job)
    assert INPUT_ENV not in env and set(env) >= {INPUT_URL_ENV, INPUT_REF_ENV}
    key = keys.input_key(rt.settings.object_store_prefix, dispatch_id)
    sha256 = hashlib.sha256(text.encode()).hexdigest()
    assert json.loads(env[INPUT_REF_ENV]) == {
        "k8s-dispatch.io/object": {"v": 1, "key": key, "size": len(text.encode()), "sha256": sha256}
    }
    assert len(json.dumps(job)) < 16 * 1024  # the reference and a URL, not the megabyte
    assert value["blob"][:64] not in json.dumps(job)

    _finished(rt, dispatch_id)
    assert complete_job(rt, "default", job_name(dispatch_id)) is CompleteOutcome.COMPLETED
    kind, payload = _terminal(rt, dispatch_id)
    assert (kind, payload["output"]) == (EventType.WORKER_COMPLETED, {"sha256": sha256, "keys": sorted(value)})

    # Ended: its input object is an orphan now, deleted by the cleanup with the dispatch's others.
    store = artifacts.for_settings(rt.settings)
    assert store is not None and store.store.size(key) == len(text.encode())
    report = clean(store, rt.sessions)
    assert key in report.deleted_keys
    assert store.store.size(key) is None


def test_an_input_object_changed_after_the_create_fails_typed_and_the_function_never_runs(
    rt: Runtime, exec_cluster: ClusterHandle
) -> None:
    value = _big_input(2, size=64 * 1024)
    dispatch_id = _schedule(rt, "held", value)
    assert create_job_for(rt, dispatch_id) is CreateOutcome.CREATED
    store = artifacts.for_settings(rt.settings)
    assert store is not None
    key = keys.input_key(rt.settings.object_store_prefix, dispatch_id)
    # Same size, other bytes: only the SHA-256 tells them apart.
    original = canonical_json(value).encode()
    store.store.put(key, original.replace(b'"seed":2', b'"seed":3'))

    with exec_cluster.api_client() as api:  # admitted, as Kueue would
        client.BatchV1Api(api).patch_namespaced_job(job_name(dispatch_id), "default", {"spec": {"suspend": False}})
    _finished(rt, dispatch_id)
    assert complete_job(rt, "default", job_name(dispatch_id)) is CompleteOutcome.COMPLETED
    kind, payload = _terminal(rt, dispatch_id)
    assert kind == EventType.WORKER_FAILED
    assert INPUT_MISMATCH in json.dumps(payload), payload
    assert "the function was not called" in json.dumps(payload), payload
    assert "output" not in payload


def test_without_an_object_store_a_large_input_is_refused_and_nothing_is_written(
    exec_cluster: ClusterHandle, base_env: dict[str, str], tmp_path: Path
) -> None:
    runtime = _runtime(exec_cluster, base_env, tmp_path)
    try:
        assert runtime.settings.max_stored_input_bytes is None
        before = _counts(runtime)
        with pytest.raises(InputTooLarge):
            _schedule(runtime, "digest", _big_input(3, size=64 * 1024))
        assert _counts(runtime) == before
    finally:
        runtime.close()


def test_an_input_over_the_object_store_limit_is_refused_at_schedule(
    exec_cluster: ClusterHandle, object_store: ObjectStoreServer, unique_prefix: str, base_env: dict[str, str],
    tmp_path: Path,
) -> None:  # fmt: skip
    env = {**base_env, **object_store.env(unique_prefix), "K8S_DISPATCH_OBJECT_STORE_MAX_INPUT_BYTES": str(MIB)}
    runtime = _runtime(exec_cluster, env, tmp_path)
    try:
        before = _counts(runtime)
        with pytest.raises(InputTooLarge):
            _schedule(runtime, "digest", _big_input(4, size=2 * MIB))
        assert _counts(runtime) == before
    finally:
        runtime.close()


def _counts(rt: Runtime) -> tuple[int, int]:
    with transaction(rt.sessions) as session:
        return session.query(Dispatch).count(), session.query(CaseEvent).count()
