"""The Jobs `build_job` makes meet the `restricted` Pod Security profile, as the real
kube-apiserver's PodSecurity admission judges it in a namespace labelled
`pod-security.kubernetes.io/enforce: restricted`.

What admission really does there: a Job is admitted either way, with a warning when its Pod
template violates the profile; the Pods are what is enforced, so the Job controller's create of a
violating Pod is refused (a FailedCreate event) and the Job never gets one. The test checks all of
it: the warning header on the Job's create, a server dry run of the template's Pod, and whether
the real Job controller's Pods appear.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from clusters import ClusterHandle
from deploy_files import run
from kubernetes import client

from k8s_dispatch.ops.processes import wait_until
from k8s_dispatch.workers.capability import CapabilitySpec
from k8s_dispatch.workers.manifest import SECURITY_DEFAULTS, build_job
from k8s_dispatch.workers.resolver import CapabilityResolver
from k8s_dispatch.workers.types import DispatchRef

# How kube-apiserver words it: `violates PodSecurity "restricted:latest": ...` refusing a Pod,
# `would violate PodSecurity \"restricted:latest\": ...` in the warning header on a Job.
REFUSED = 'is forbidden: violates PodSecurity "restricted:latest"'
WARNED = 'would violate PodSecurity \\"restricted:latest\\"'


def _spec(**fields: Any) -> CapabilitySpec:
    config = {
        "worker": "w",
        "image": "busybox:1.36",
        "command": ["sh", "-c", "true"],
        "runAsUser": 65534,
        "runAsGroup": 65534,
        **fields,
    }
    return CapabilityResolver.from_mapping({"capabilities": {"cap": config}}).spec("cap")


DEFAULT = _spec()
# Every default switched off, each with its reason.
OVERRIDDEN = _spec(runAsUser=0, securityOverrides={name: f"test: {name} off" for name in SECURITY_DEFAULTS})


def _job(spec: CapabilitySpec, namespace: str) -> dict[str, Any]:
    ref = DispatchRef(str(uuid.uuid4()), str(uuid.uuid4()), "acme", "cap", "w", f"key-{uuid.uuid4().hex[:8]}")
    return build_job(ref, input={"n": 1}, spec=spec, namespace=namespace, deployment="pss-test")


def _template_pod(job: dict[str, Any]) -> dict[str, Any]:
    template = job["spec"]["template"]
    metadata = {**template["metadata"], "name": job["metadata"]["name"], "namespace": job["metadata"]["namespace"]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"]}


@pytest.fixture(scope="module")
def restricted_namespace(real_cluster: ClusterHandle) -> str:
    name = f"kd-restricted-{uuid.uuid4().hex[:6]}"
    labels = {
        "pod-security.kubernetes.io/enforce": "restricted",
        "pod-security.kubernetes.io/enforce-version": "latest",
    }
    with real_cluster.api_client() as api:
        client.CoreV1Api(api).create_namespace({"metadata": {"name": name, "labels": labels}})
    real_cluster.ensure_namespace(name)  # and waits for its default ServiceAccount
    return name


def _dry_run_pod(cluster: ClusterHandle, pod: dict[str, Any], tmp_path: Path) -> tuple[int, str]:
    path = tmp_path / f"{pod['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(pod))
    done = run(
        [
            "kubectl",
            "--kubeconfig",
            str(cluster.kubeconfig),
            "apply",
            "--server-side",
            "--dry-run=server",
            "-f",
            str(path),
        ]
    )
    return done.returncode, done.stderr


def test_a_built_jobs_pod_is_admitted_and_one_with_the_defaults_overridden_is_not(
    real_cluster: ClusterHandle, restricted_namespace: str, tmp_path: Path
) -> None:
    code, stderr = _dry_run_pod(real_cluster, _template_pod(_job(DEFAULT, restricted_namespace)), tmp_path)
    assert code == 0, stderr
    assert "PodSecurity" not in stderr

    code, stderr = _dry_run_pod(real_cluster, _template_pod(_job(OVERRIDDEN, restricted_namespace)), tmp_path)
    assert code != 0
    assert REFUSED in stderr, stderr
    # Each default the capability turned off is named by the admission controller.
    for field in ("allowPrivilegeEscalation", "capabilities", "runAsNonRoot", "seccompProfile", "runAsUser=0"):
        assert field in stderr, (field, stderr)


def _create_job(cluster: ClusterHandle, job: dict[str, Any]) -> str:
    """POST the Job as sent: (the warning header, if any). A Job is never refused for its template."""
    namespace = job["metadata"]["namespace"]
    status, headers, body = cluster.raw("POST", f"/apis/batch/v1/namespaces/{namespace}/jobs", job)
    assert status == 201, body
    return headers.get("warning", "")


def _pods_and_events(cluster: ClusterHandle, job: dict[str, Any]) -> tuple[list[Any], list[str]]:
    namespace, name = job["metadata"]["namespace"], job["metadata"]["name"]
    with cluster.api_client() as api:
        core = client.CoreV1Api(api)
        pods = core.list_namespaced_pod(namespace, label_selector=f"batch.kubernetes.io/job-name={name}").items
        events = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
    return pods, [f"{e.reason}: {e.message}" for e in events]


def test_the_job_controller_creates_pods_only_for_the_restricted_job(
    real_cluster: ClusterHandle, restricted_namespace: str
) -> None:
    good, bad = _job(DEFAULT, restricted_namespace), _job(OVERRIDDEN, restricted_namespace)
    assert _create_job(real_cluster, good) == ""
    warning = _create_job(real_cluster, bad)
    assert WARNED in warning, warning  # admitted, with a warning: Pods are what is enforced

    wait_until(lambda: _pods_and_events(real_cluster, good)[0], timeout=60, interval=0.2, what="the good Job's Pod")
    wait_until(
        lambda: any("FailedCreate" in e and 'violates PodSecurity "restricted:latest"' in e
                    for e in _pods_and_events(real_cluster, bad)[1]),
        timeout=60, interval=0.2, what="the bad Job's FailedCreate event",
    )  # fmt: skip
    assert _pods_and_events(real_cluster, bad)[0] == []
    # Why the bad Job runs outside the profile is on it, for whoever finds it.
    reasons = json.loads(bad["metadata"]["annotations"]["k8s-dispatch.io/security-overrides"])
    assert set(reasons) == set(SECURITY_DEFAULTS)
