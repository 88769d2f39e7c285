"""The Job's podFailurePolicy: built from the capability (pure), and accepted as built by both
kube-apiserver and localcluster, which read it back unchanged."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from clusters import ClusterHandle

from k8s_dispatch.workers.capability import CapabilitySpec
from k8s_dispatch.workers.failure_policy import pod_failure_policy, policy_problems
from k8s_dispatch.workers.kube import KubeClient
from k8s_dispatch.workers.manifest import FINALIZER, build_job
from k8s_dispatch.workers.types import CapabilityName, DispatchId, DispatchRef, WorkerName

SPEC = CapabilitySpec(name=CapabilityName("cap.one"), worker_name=WorkerName("w1"), image="img:1")
IGNORE = {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}


def _codes(action: str, values: list[int]) -> dict[str, Any]:
    return {"action": action, "onExitCodes": {"containerName": "worker", "operator": "In", "values": values}}


@pytest.mark.parametrize(
    ("change", "rules"),
    [
        ({}, [IGNORE]),
        ({"fail_on_exit_codes": (9, 3)}, [IGNORE, _codes("FailJob", [3, 9])]),
        ({"retry_on_exit_codes": (75,), "backoff_limit": 2}, [IGNORE, _codes("Count", [75])]),
        (
            {"fail_on_exit_codes": (3,), "retry_on_exit_codes": (75, 1), "backoff_limit": 2},
            [IGNORE, _codes("FailJob", [3]), _codes("Count", [1, 75])],
        ),
    ],
)
def test_the_policy_ignores_disruptions_then_applies_the_exit_codes(
    change: dict[str, Any], rules: list[dict[str, Any]]
) -> None:
    spec = replace(SPEC, **change)
    assert policy_problems(spec) == []
    assert pod_failure_policy(spec, container="worker") == {"rules": rules}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"fail_on_exit_codes": (0,)}, "failOnExitCodes"),
        ({"retry_on_exit_codes": (300,), "backoff_limit": 1}, "retryOnExitCodes"),
        ({"retry_on_exit_codes": (5,), "fail_on_exit_codes": (5,), "backoff_limit": 1}, "failOnExitCodes"),
        ({"retry_on_exit_codes": (5,)}, "retryOnExitCodes"),
        ({"max_disruptions": -1}, "maxDisruptions"),
    ],
)
def test_policy_problems_name_the_field(change: dict[str, Any], field: str) -> None:
    assert [f for f, _ in policy_problems(replace(SPEC, **change))] == [field]


def test_a_built_job_with_its_policy_is_accepted_by_the_api_server(cluster_under_test: ClusterHandle) -> None:
    namespace = cluster_under_test.ensure_namespace("failure-policy")
    ref = DispatchRef(
        dispatch_id=DispatchId("5e0d1c2b-3a49-4f8e-9d7c-6b5a4f3e2d1c"),
        case_id="case-1",
        tenancy_id="acme",
        capability=SPEC.name,
        worker_name=SPEC.worker_name,
        idempotency_key="k-1",
    )
    spec = replace(SPEC, backoff_limit=2, fail_on_exit_codes=(3, 4), retry_on_exit_codes=(75,))
    job = build_job(ref, input={}, spec=spec, namespace=namespace, deployment="test")
    with KubeClient(cluster_under_test.kubeconfig) as kube:
        name = job["metadata"]["name"]
        kube.create_job(namespace, job)
        try:
            stored = kube.get_job(namespace, name)
            assert stored["spec"]["podFailurePolicy"] == job["spec"]["podFailurePolicy"]
            assert stored["spec"]["podReplacementPolicy"] == "Failed"  # the default with a policy
        finally:
            kube.remove_finalizer(namespace, name, FINALIZER)
            kube.delete_job(namespace, name)
