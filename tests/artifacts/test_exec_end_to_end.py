"""A 5 MiB result end to end on localcluster in exec mode (the runner a local process, as in a
Pod): the Job built with its attempt's presigned URL, the runner's upload to SeaweedFS, the
reference as its termination message, verification, and the bytes read back."""

from __future__ import annotations

import hashlib
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from funcs import random_bytes
from objectstore import ObjectStoreServer

from k8s_dispatch.artifacts import Artifacts, result_upload, verify_for_delivery
from k8s_dispatch.artifacts.reference import parse_reference
from k8s_dispatch.core.settings import load_settings
from k8s_dispatch.store.models import EventType
from k8s_dispatch.workers.manifest import build_job
from k8s_dispatch.workers.resolver import CapabilityResolver
from k8s_dispatch.workers.types import CapabilityName, DispatchId, DispatchRef, WorkerName

SIZE = 5 * (1 << 20)
DEADLINE_S = 60.0


def _terminated(core: Any, namespace: str, job: str) -> Any:
    """The Job's container's terminated state, polled under a deadline."""
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        for pod in core.list_namespaced_pod(namespace, label_selector=f"job-name={job}").items:
            for status in pod.status.container_statuses or []:
                if status.state and status.state.terminated:
                    return status.state.terminated
        time.sleep(0.05)  # a poll interval under a deadline
    raise AssertionError(f"job {job} did not finish in {DEADLINE_S} s")


def test_a_5_mib_result_from_a_job_in_exec_mode(object_store: ObjectStoreServer, unique_prefix: str) -> None:
    from kubernetes import client, config

    from k8s_dispatch.demo.localcluster import LocalCluster

    artifacts = Artifacts.from_settings(load_settings(object_store.env(unique_prefix)))
    assert artifacts is not None
    resolver = CapabilityResolver.from_mapping(
        {
            "capabilities": {
                "big": {
                    "worker": "w",
                    "image": "k8s-dispatch:latest",
                    "command": [sys.executable, "-m", "k8s_dispatch.container.runner"],
                    "args": ["funcs:random_bytes"],
                    "env": {"PYTHONPATH": str(Path(__file__).parent)},
                    "results": "objectStore",
                    "maxResultBytes": 8 * (1 << 20),
                    "activeDeadlineSeconds": 120,
                }
            }
        }
    )
    spec = resolver.spec("big")
    dispatch_id = str(uuid.uuid4())
    ref = DispatchRef(
        dispatch_id=DispatchId(dispatch_id),
        case_id="case-e2e",
        tenancy_id="t",
        capability=CapabilityName("big"),
        worker_name=WorkerName("w"),
        idempotency_key=dispatch_id,
    )
    value = {"seed": 5, "size": SIZE}
    upload = result_upload(artifacts, spec, dispatch_id=dispatch_id, attempt=0)
    body = build_job(ref, input=value, spec=spec, namespace="default", deployment="e2e", result_upload=upload)

    with LocalCluster(mode="exec", max_running=1, tls=False) as cluster:
        api_client = config.new_client_from_config(config_file=str(cluster.kubeconfig))
        try:
            client.BatchV1Api(api_client).create_namespaced_job("default", body)
            terminated = _terminated(client.CoreV1Api(api_client), "default", body["metadata"]["name"])
        finally:
            api_client.close()

    assert terminated.exit_code == 0, terminated.message
    assert len(terminated.message) < 300  # the reference, not the bytes
    event, payload = verify_for_delivery(
        artifacts, spec, dispatch_id=dispatch_id, attempt=0, output=json.loads(terminated.message)
    )
    assert event is EventType.WORKER_COMPLETED, payload
    reference = parse_reference(payload["output"])
    expected = random_bytes(value)
    assert (reference.size, reference.sha256) == (SIZE, hashlib.sha256(expected).hexdigest())
    assert hashlib.sha256(b"".join(artifacts.read(reference))).hexdigest() == reference.sha256
