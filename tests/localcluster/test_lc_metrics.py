"""`apiserver_request_total` on GET /metrics: each call the official client makes is counted once,
with the verb, scope and code a real kube-apiserver reports, and kubectl reads it with --raw."""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from conftest import Api, job_manifest, raw_request
from kubernetes import client, watch
from prometheus_client.parser import text_string_to_metric_families

from k8s_dispatch.demo.localcluster import LocalCluster
from k8s_dispatch.demo.localcluster.audit import METRIC, RequestCount
from k8s_dispatch.ops.processes import wait_until

Key = tuple[str, str, str, str, int]  # verb, resource, subresource, scope, code
SIM = {"localcluster.k8s-dispatch.io/duration-ms": "60000"}  # still running while the test looks


@pytest.fixture
def sim(lsim: Api) -> Api:
    """localcluster alone: these tests read its own request counters and fault switch."""
    return lsim


def counts(rows: list[RequestCount]) -> Counter[Key]:
    return Counter(
        {(r.labels.verb, r.labels.resource, r.labels.subresource, r.labels.scope, r.code): r.count for r in rows}
    )


def made(cluster: LocalCluster, before: Counter[Key]) -> Counter[Key]:
    """The requests counted since `before` (zeros dropped)."""
    after = counts(cluster.request_counts())
    after.subtract(before)
    return +after


def test_each_client_call_is_counted_with_the_servers_verb_scope_and_code(sim: Api) -> None:
    before = counts(sim.cluster.backend.request_counts())
    sim.create_job(job_manifest("m1", annotations=SIM))
    sim.create_job(job_manifest("m2", annotations=SIM))
    created = made(sim.cluster.backend, before)
    # m1 read and replaced below: first wait (uncounted) until the controller is done writing
    # its status (its Pod ready), or the replace races the controller's update (409).
    wait_until(lambda: (sim.job("m1").status.ready or 0) == 1, what="m1's Pod ready", timeout=10.0)
    before = counts(sim.cluster.backend.request_counts())
    job = sim.job("m1")
    with pytest.raises(client.ApiException):
        sim.job("missing")
    first = sim.batch.list_namespaced_job(sim.namespace, limit=1)
    sim.batch.list_namespaced_job(sim.namespace, limit=1, _continue=first.metadata._continue)
    sim.batch.list_job_for_all_namespaces(limit=1)
    sim.batch.patch_namespaced_job("m1", sim.namespace, {"metadata": {"labels": {"a": "b"}}})
    sim.batch.patch_namespaced_job_status("m1", sim.namespace, {"metadata": {"annotations": {"x": "y"}}})
    job = sim.job("m1")
    sim.batch.replace_namespaced_job("m1", sim.namespace, job)
    list(watch.Watch().stream(sim.batch.list_namespaced_job, sim.namespace, timeout_seconds=1))
    sim.batch.delete_namespaced_job("m1", sim.namespace, propagation_policy="Background")
    sim.batch.delete_collection_namespaced_job(sim.namespace, propagation_policy="Background")

    assert created + made(sim.cluster.backend, before) == Counter(
        {
            ("POST", "jobs", "", "resource", 201): 2,
            ("GET", "jobs", "", "resource", 200): 2,
            ("GET", "jobs", "", "resource", 404): 1,
            ("LIST", "jobs", "", "namespace", 200): 2,
            ("LIST", "jobs", "", "cluster", 200): 1,
            ("PATCH", "jobs", "", "resource", 200): 1,
            ("PATCH", "jobs", "status", "resource", 200): 1,
            ("PUT", "jobs", "", "resource", 200): 1,
            ("WATCH", "jobs", "", "namespace", 200): 1,
            ("DELETE", "jobs", "", "resource", 200): 1,
            ("DELETE", "jobs", "", "namespace", 200): 1,  # a collection's delete, as kube-apiserver counts it
        }
    )
    # the RBAC record, kept alongside
    assert {("batch", "jobs", "deletecollection"), ("batch", "jobs/status", "patch"), ("batch", "jobs", "watch"),
            ("batch", "jobs", "list"), ("batch", "jobs", "update")} <= sim.cluster.backend.audit()  # fmt: skip


def test_injected_faults_are_counted_with_their_code(sim: Api) -> None:
    before = counts(sim.cluster.backend.request_counts())
    sim.cluster.backend.set_faults(1.0, 0)
    try:
        status, _, _ = raw_request(sim.cluster, "GET", f"/apis/batch/v1/namespaces/{sim.namespace}/jobs")
    finally:
        sim.cluster.backend.set_faults(0.0, 0)
    assert status in (429, 500, 503)
    assert made(sim.cluster.backend, before) == Counter({("LIST", "jobs", "", "namespace", status): 1})


def test_metrics_endpoint_serves_the_counters_as_prometheus_text_behind_the_token(sim: Api) -> None:
    sim.create_job(job_manifest("m3", annotations=SIM))
    assert raw_request(sim.cluster, "GET", "/metrics", token="")[0] == 401
    status, headers, body = raw_request(sim.cluster, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    expected = counts(sim.cluster.backend.request_counts())  # the scrape itself is no resource request
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    # the parser names a counter without its _total suffix
    samples = families[METRIC.removesuffix("_total")].samples
    served = Counter(
        {
            (
                s.labels["verb"],
                s.labels["resource"],
                s.labels["subresource"],
                s.labels["scope"],
                int(s.labels["code"]),
            ): int(s.value)
            for s in samples
        }
    )
    assert served == expected
    assert {s.labels["component"] for s in samples} == {"apiserver"}
    assert ("POST", "jobs", "", "resource", 201) in served


def test_kubectl_get_raw_metrics(sim: Api, tmp_path: Path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not on PATH: this test checks kubectl 1.32 against localcluster")
    sim.create_job(job_manifest("m4", annotations=SIM))
    result = subprocess.run(
        [kubectl, "--kubeconfig", str(sim.cluster.kubeconfig), "get", "--raw", "/metrics"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    assert f"# TYPE {METRIC} counter" in result.stdout
    assert 'verb="POST"' in result.stdout and 'resource="jobs"' in result.stdout


def objects_read(cluster: LocalCluster) -> Counter[str]:
    """The jobs objects LISTs returned and the jobs watch events sent, from /metrics' text."""
    _, _, body = raw_request(cluster, "GET", "/metrics")
    out: Counter[str] = Counter()
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if s.labels.get("resource") == "jobs" and s.labels.get("group") == "batch":
                out[s.name] += int(s.value)
    return out


def test_the_objects_lists_return_and_the_watch_events_sent_are_counted_as_kube_apiserver_names_them(
    sim: Api,
) -> None:
    for name in ("o1", "o2", "o3"):
        sim.create_job(job_manifest(name, annotations=SIM))
    before = objects_read(sim.cluster)
    first = sim.batch.list_namespaced_job(sim.namespace, limit=2)
    sim.batch.list_namespaced_job(sim.namespace, limit=2, _continue=first.metadata._continue)
    total = len(sim.batch.list_namespaced_job(sim.namespace).items)
    rv = first.metadata.resource_version
    events = list(
        watch.Watch().stream(sim.batch.list_namespaced_job, sim.namespace, resource_version=rv, timeout_seconds=1)
    )
    after = objects_read(sim.cluster)
    after.subtract(before)
    assert after["apiserver_storage_list_returned_objects_total"] == 2 + (total - 2) + total
    assert after["apiserver_watch_events_total"] == len(events)
