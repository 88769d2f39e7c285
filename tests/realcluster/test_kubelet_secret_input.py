"""A secret input on a real node: the kubelet resolves the container's `secretKeyRef` from the
Job's own Secret, so the function gets the input that no Job, Pod or log of ours holds; and a Pod
whose Secret does not exist yet waits (`CreateContainerConfigError`) and starts once it is made,
the order the create step relies on (the Job first: the Secret's ownerReference needs its uid)."""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Any

from clusters import ClusterHandle
from cryptography.fernet import Fernet

from k8s_dispatch.core.payloads import canonical_json
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import EventType
from k8s_dispatch.tasks.scheduling import schedule_in_session
from k8s_dispatch.workers.manifest import build_job, input_secret, job_name
from k8s_dispatch.workers.resolver import CapabilityResolver
from k8s_dispatch.workers.types import (
    CapabilityName,
    CaseId,
    DispatchId,
    DispatchRef,
    IdempotencyKey,
    TenancyId,
    WorkerName,
)
from tests.realcluster.test_kubelet_work_path import busybox

KEY = Fernet.generate_key().decode()
# The SHA-256 of what the container finds in K8S_DISPATCH_INPUT: the test knows the input's.
SHA = busybox(
    """printf '{"sha256":"%s"}' "$(printf %s "$K8S_DISPATCH_INPUT" | sha256sum | cut -d' ' -f1)" > /dev/termination-log"""
)


def test_the_kubelet_gives_the_container_the_secret_input_that_no_job_pod_or_log_holds(
    deploy: Any, kubelet_cluster: ClusterHandle
) -> None:
    d = deploy(kubelet_cluster, capabilities={"sha": SHA}, input_key=KEY, sweep_interval_s="5", sweep_grace_s="1")
    d.start_worker("w1")
    d.start_beat()
    value = {"password": f"pw-{uuid.uuid4().hex}"}
    with transaction(d.sessions) as session:
        dispatch_id = schedule_in_session(
            session, case_id=d.new_case("t"), tenancy_id="t", capability="sha", input=value, secret=True,
            input_key=d.settings.input_key, idempotency_key=f"k-{uuid.uuid4().hex}",
            router=CapabilityResolver.from_settings(d.settings), max_input_bytes=d.settings.max_input_bytes,
            via=d.producer,
        ).dispatch_id  # fmt: skip
    job = d.wait(lambda: _job(d, dispatch_id), timeout_s=60, what="the Job")
    events = d.wait_terminal([dispatch_id], timeout_s=120)
    expected = hashlib.sha256(canonical_json(value).encode()).hexdigest()
    assert events[dispatch_id] == [(EventType.WORKER_COMPLETED, {"output": {"sha256": expected}})], events
    for where, text in (("the Job", json.dumps(job)), ("a log", "\n".join(p.log() for p in d.procs))):
        assert value["password"] not in text, f"the secret input is in {where}"


def _job(d: Any, dispatch_id: str) -> dict[str, Any] | None:
    from k8s_dispatch.core.errors import NotFound

    try:
        return d.kube.get_job(d.namespace, job_name(dispatch_id))  # type: ignore[no-any-return]
    except NotFound:
        return None


def test_a_pod_waits_for_its_secret_and_starts_once_it_exists(deploy: Any, kubelet_cluster: ClusterHandle) -> None:
    d = deploy(kubelet_cluster, capabilities={"sha": SHA})
    kubelet_cluster.ensure_namespace(d.namespace)
    dispatch_id = str(uuid.uuid4())
    ref = DispatchRef(
        dispatch_id=DispatchId(dispatch_id), case_id=CaseId("c"), tenancy_id=TenancyId("t"),
        capability=CapabilityName("sha"), worker_name=WorkerName("shell"), idempotency_key=IdempotencyKey("k"),
    )  # fmt: skip
    spec = CapabilityResolver.from_settings(d.settings).spec("sha")
    body = build_job(ref, input=None, spec=spec, namespace=d.namespace, deployment="secret-order", secret_input=True)
    body["metadata"]["finalizers"] = []  # nothing of ours delivers this Job
    body["spec"]["template"]["metadata"]["finalizers"] = []
    created = d.kube.create_job(d.namespace, body)

    def waiting() -> bool:
        pods = d.kube.list_pods(d.namespace, label_selector=f"job-name={job_name(dispatch_id)}")
        states = [s.get("state") or {} for p in pods for s in (p.get("status") or {}).get("containerStatuses") or []]
        return any((s.get("waiting") or {}).get("reason") == "CreateContainerConfigError" for s in states)

    d.wait(waiting, timeout_s=60, what="the container held back for its Secret")
    text = canonical_json({"late": True})
    d.kube.create_secret(d.namespace, input_secret(created, text=text))
    job = d.wait(
        lambda: (j := d.kube.get_job(d.namespace, job_name(dispatch_id))).get("status", {}).get("succeeded") and j,
        timeout_s=90,
        what="the Job succeeded once its Secret existed",
    )
    assert job["status"]["succeeded"] == 1
    [pod] = d.kube.list_pods(d.namespace, label_selector=f"job-name={job_name(dispatch_id)}")
    message = pod["status"]["containerStatuses"][0]["state"]["terminated"]["message"]
    assert json.loads(message) == {"sha256": hashlib.sha256(text.encode()).hexdigest()}
    d.kube.delete_job(d.namespace, job_name(dispatch_id), propagation="Background")
