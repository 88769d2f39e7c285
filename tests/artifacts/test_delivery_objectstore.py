"""Through the delivery path (create, run in exec mode, complete) with results in SeaweedFS:
the verified reference recorded once, or a typed failure and never a reference, when the
object is not what the Pod said; whatever is not recorded is an orphan the cleanup removes."""

from __future__ import annotations

import hashlib
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from objectstore import ObjectStoreServer
from sqlalchemy.engine import Engine

from k8s_dispatch import api, artifacts
from k8s_dispatch.artifacts.cleanup import clean
from k8s_dispatch.core.settings import load_settings
from k8s_dispatch.delivery.complete import CompleteOutcome, complete_job
from k8s_dispatch.delivery.create import CreateOutcome, create_job_for
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.demo.localcluster import LocalCluster
from k8s_dispatch.ops.processes import wait_until
from k8s_dispatch.store import dispatches, scheduling
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import EventType
from k8s_dispatch.workers.job_status import job_state
from k8s_dispatch.workers.manifest import job_name

MIB = 1 << 20
CAPABILITIES = {
    "capabilities": {
        "big": {
            "worker": "big",
            "image": "k8s-dispatch:latest",
            "command": [sys.executable, "-m", "k8s_dispatch.container.runner"],
            "args": ["funcs:random_bytes"],
            "env": {"PYTHONPATH": str(Path(__file__).parent)},
            "results": "objectStore",
            "maxResultBytes": 16 * MIB,
            "activeDeadlineSeconds": 120,
        }
    }
}


@pytest.fixture(scope="module")
def exec_cluster() -> Iterator[LocalCluster]:
    with LocalCluster(mode="exec", max_running=2, tls=False) as cluster:
        yield cluster


@pytest.fixture
def rt(
    exec_cluster: LocalCluster, object_store: ObjectStoreServer, unique_prefix: str, pg_url: str, redis_url: str,
    key_prefix: str, tmp_path: Path,
) -> Iterator[Runtime]:  # fmt: skip
    caps = tmp_path / "capabilities.yaml"
    caps.write_text(yaml.safe_dump(CAPABILITIES))
    env = {
        "K8S_DISPATCH_DATABASE_URL": pg_url,
        "K8S_DISPATCH_REDIS_URL": redis_url,
        "K8S_DISPATCH_KEY_PREFIX": f"{key_prefix}-{unique_prefix}",
        "K8S_DISPATCH_NAMESPACE": "default",
        "K8S_DISPATCH_KUBECONFIG": str(exec_cluster.kubeconfig),
        "K8S_DISPATCH_CAPABILITIES": str(caps),
        "K8S_DISPATCH_OBJECT_STORE_ORPHAN_GRACE_S": "0",
        **object_store.env(unique_prefix),
    }
    runtime = Runtime.from_settings(load_settings(env))
    yield runtime
    runtime.close()


def _schedule(rt: Runtime, value: dict[str, Any]) -> str:
    case_id = f"case-{uuid.uuid4().hex[:8]}"
    with transaction(rt.sessions) as session:
        scheduling.create_case(session, case_id=case_id, tenancy_id="t")
        return scheduling.schedule(
            session, case_id=case_id, tenancy_id="t", capability="big", input=value,
            idempotency_key=uuid.uuid4().hex, router=rt.resolver, max_input_bytes=rt.settings.max_input_bytes,
        ).dispatch_id  # fmt: skip


def _run(rt: Runtime, value: dict[str, Any]) -> str:
    dispatch_id = _schedule(rt, value)
    assert create_job_for(rt, dispatch_id) is CreateOutcome.CREATED
    wait_until(
        lambda: job_state(rt.kube.get_job("default", job_name(dispatch_id))).terminal,
        what="the job finished",
        timeout=60.0,
    )
    return dispatch_id


def _terminal(rt: Runtime, dispatch_id: str) -> tuple[str, dict[str, Any]]:
    with transaction(rt.sessions) as session:
        event = dispatches.terminal_event(session, dispatch_id)
        assert event is not None
        return event.type, dict(event.payload)


def test_a_5_mib_result_is_verified_then_recorded_once(rt: Runtime) -> None:
    from funcs import random_bytes

    value = {"seed": 7, "size": 5 * MIB}
    dispatch_id = _run(rt, value)
    assert complete_job(rt, "default", job_name(dispatch_id)) is CompleteOutcome.COMPLETED
    kind, _ = _terminal(rt, dispatch_id)
    assert kind == EventType.WORKER_COMPLETED
    with transaction(rt.sessions) as session:
        reference = api.stored_result(session, dispatch_id)
        assert reference is not None
        assert reference.sha256 == hashlib.sha256(random_bytes(value)).hexdigest()
        data = b"".join(api.read_result(session, dispatch_id, settings=rt.settings))
    assert hashlib.sha256(data).hexdigest() == reference.sha256
    assert complete_job(rt, "default", job_name(dispatch_id)) is CompleteOutcome.GONE


def test_an_object_changed_after_the_upload_fails_typed_and_becomes_an_orphan(
    rt: Runtime, engine_factory: Callable[..., Engine]
) -> None:
    dispatch_id = _run(rt, {"seed": 8, "size": MIB})
    store = artifacts.for_settings(rt.settings)
    assert store is not None
    store.store.put(store.key(dispatch_id, 0), b"not the bytes the Pod uploaded")

    assert complete_job(rt, "default", job_name(dispatch_id)) is CompleteOutcome.COMPLETED  # delivered: as a failure
    kind, payload = _terminal(rt, dispatch_id)
    assert (kind, payload["reason"]) == (EventType.WORKER_FAILED, "ResultObjectMismatch")
    assert "output" not in payload
    report = clean(store, rt.sessions)
    assert store.key(dispatch_id, 0) in report.deleted_keys
