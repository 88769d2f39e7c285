"""podFailurePolicy, evictions, OOM kills, container logs and Warning Events, on localcluster and on
the real control plane (`sim`: kube-apiserver's Eviction API, the real Job controller, our node
agent): what k8s-dispatch's disruption handling and failure detail stand on."""

from __future__ import annotations

import json
from typing import Any

import pytest
from conftest import Api, condition_types, job_manifest, raw_request, wait_for
from kubernetes import client

SIM = "localcluster.k8s-dispatch.io/"
IGNORE_DISRUPTIONS = {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}


def _policy(*rules: dict[str, Any]) -> dict[str, Any]:
    return {"rules": [IGNORE_DISRUPTIONS, *rules]}


HOLD = "k8s-dispatch.io/test-hold"  # keeps the evicted Pods to be looked at, as our finalizer does


def _held(manifest: dict[str, Any]) -> dict[str, Any]:
    manifest["spec"]["template"].setdefault("metadata", {})["finalizers"] = [HOLD]
    return manifest


def _release(sim: Api, job: str) -> None:
    for pod in sim.pods_of(job):
        sim.core.patch_namespaced_pod(pod.metadata.name, sim.namespace, {"metadata": {"finalizers": None}})


def _disruption(pod: Any) -> Any:
    return next((c for c in pod.status.conditions or [] if c.type == "DisruptionTarget"), None)


def _terminated(pod: Any) -> Any:
    return pod.status.container_statuses[0].state.terminated


def test_evicted_pods_are_replaced_without_counting_against_the_backoff_limit(sim: Api) -> None:
    ann = {SIM + "duration-ms": "400", SIM + "evict-attempts": "2", SIM + "evict-after-ms": "100"}
    sim.create_job(_held(job_manifest("evicted", annotations=ann, backoffLimit=0, podFailurePolicy=_policy())))
    job = sim.wait_job("evicted", "Complete", timeout=60 if sim.cluster.is_real else 10)
    assert job.status.succeeded == 1 and not job.status.failed
    pods = sim.pods_of("evicted")
    disrupted = [p for p in pods if _disruption(p) is not None]
    assert len(pods) == 3 and len(disrupted) == 2
    for pod in disrupted:
        assert pod.status.phase == "Failed"
        assert pod.metadata.deletion_timestamp is not None  # an eviction is a delete
        assert (_disruption(pod).status, _disruption(pod).reason) == ("True", "EvictionByEvictionAPI")
    assert [p.status.phase for p in pods if _disruption(p) is None] == ["Succeeded"]
    _release(sim, "evicted")


def test_without_a_policy_an_eviction_counts_as_a_failure(sim: Api) -> None:
    ann = {SIM + "duration-ms": "400", SIM + "evict-attempts": "1", SIM + "evict-after-ms": "100"}
    sim.create_job(job_manifest("counted", annotations=ann, backoffLimit=0))
    job = sim.wait_job("counted", timeout=60 if sim.cluster.is_real else 10)
    assert condition_types(job)[-1] == "Failed" and job.status.conditions[-1].reason == "BackoffLimitExceeded"


def test_an_exit_code_in_a_failjob_rule_fails_the_job_at_once(sim: Api) -> None:
    ann = {SIM + "outcome": "fail", SIM + "exit-code": "3", SIM + "duration-ms": "5"}
    rule = {"action": "FailJob", "onExitCodes": {"containerName": "main", "operator": "In", "values": [3]}}
    sim.create_job(job_manifest("fatal", annotations=ann, backoffLimit=5, podFailurePolicy=_policy(rule)))
    job = sim.wait_job("fatal", "Failed", timeout=30 if sim.cluster.is_real else 10)
    failed = job.status.conditions[-1]
    assert failed.reason == "PodFailurePolicy"
    pod = sim.pods_of("fatal")[0]
    assert failed.message == (
        f"Container main for pod {sim.namespace}/{pod.metadata.name} failed with exit code 3 matching FailJob rule at index 1"
    )
    assert job.status.failed == 1 and len(sim.pods_of("fatal")) == 1


def test_an_oom_kill_ends_with_exit_137_and_a_warning_event(sim: Api) -> None:
    log = "".join(f"line {i}\n" for i in range(300)) + "allocating 4 GiB\n"
    ann = {SIM + "oom": "true", SIM + "duration-ms": "5", SIM + "log": log}
    sim.create_job(job_manifest("oom", annotations=ann, backoffLimit=0, podFailurePolicy=_policy()))
    job = sim.wait_job("oom", "Failed", timeout=30 if sim.cluster.is_real else 10)
    assert job.status.conditions[-1].reason == "BackoffLimitExceeded"
    pod = sim.pods_of("oom")[0]
    term = _terminated(pod)
    assert (term.exit_code, term.reason) == (137, "OOMKilled")
    assert term.message.endswith("line 299\nallocating 4 GiB\n") and len(term.message.encode()) <= 2048
    tail = sim.core.read_namespaced_pod_log(
        pod.metadata.name, sim.namespace, container="main", tail_lines=2, limit_bytes=100
    )
    assert tail == "line 299\nallocating 4 GiB\n"
    events = wait_for(
        lambda: (
            sim.core.list_namespaced_event(
                sim.namespace, field_selector="involvedObject.name=oom,involvedObject.kind=Job,type=Warning"
            ).items
        ),
        timeout=10,
        what="the Job controller's Warning event",
    )
    assert [(e.reason, e.message, e.involved_object.uid) for e in events] == [
        ("BackoffLimitExceeded", "Job has reached the specified backoff limit", job.metadata.uid)
    ]


def test_a_failure_policy_needs_restart_policy_never(sim: Api) -> None:
    manifest = job_manifest("onfailure", podFailurePolicy=_policy())
    manifest["spec"]["template"]["spec"]["restartPolicy"] = "OnFailure"
    with pytest.raises(client.ApiException) as raised:
        sim.create_job(manifest)
    assert raised.value.status == 422
    causes = json.loads(raised.value.body)["details"]["causes"]
    assert causes == [
        {
            "reason": "FieldValueInvalid",
            "message": 'Invalid value: "OnFailure": only "Never" is supported when podFailurePolicy is specified',
            "field": "spec.template.spec.restartPolicy",
        }
    ]


def test_a_policy_defaults_pod_replacement_to_failed(sim: Api) -> None:
    sim.create_job(job_manifest("defaults", annotations={SIM + "outcome": "hang"}, podFailurePolicy=_policy()))
    job = sim.job("defaults")
    assert job.spec.pod_replacement_policy == "Failed"
    assert job.spec.pod_failure_policy.rules[0].on_pod_conditions[0].status == "True"
    sim.batch.delete_namespaced_job("defaults", sim.namespace, propagation_policy="Background")


def test_events_are_created_listed_and_selected_by_field(sim: Api) -> None:
    involved = {"kind": "Pod", "name": "somepod", "namespace": sim.namespace, "uid": "u-1", "apiVersion": "v1"}
    for name, kind in (("a", "Warning"), ("b", "Normal")):
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"somepod.{name}", "namespace": sim.namespace},
            "involvedObject": involved,
            "reason": "Tested",
            "message": f"a {kind} one",
            "type": kind,
            "source": {"component": "test"},
            "firstTimestamp": "2026-01-01T00:00:00Z",
            "lastTimestamp": "2026-01-01T00:00:00Z",
            "count": 1,
        }
        sim.core.create_namespaced_event(sim.namespace, body)
    warnings = sim.core.list_namespaced_event(sim.namespace, field_selector="involvedObject.name=somepod,type=Warning")
    assert [e.message for e in warnings.items] == ["a Warning one"]
    both = sim.core.list_namespaced_event(sim.namespace, field_selector="involvedObject.uid=u-1")
    assert sorted(e.type for e in both.items) == ["Normal", "Warning"]


def test_the_eviction_of_a_pod_that_is_gone_is_404(sim: Api) -> None:
    body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "nothere", "namespace": sim.namespace}}
    status, _, _ = raw_request(sim.cluster, "POST", f"/api/v1/namespaces/{sim.namespace}/pods/nothere/eviction", body)
    assert status == 404
