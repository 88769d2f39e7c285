"""Restarts, hand deletions and forgeries on a real node, end to end with `celery worker|beat`
processes, PostgreSQL and Redis: tests/recovery's crash-point matrix (the points where a Job, a
real Pod or our finalizer on it is left behind), a finished Pod deleted or a Job deleted in the
foreground before any worker saw it (our finalizer holds the Pod and its termination message), a
result really lost (the Pod gone: the Job runs again), and Jobs made by someone else (never
delivered). Each on the session's kubelet cluster with its own site, reusing
tests/recovery/test_crash_matrix.py's deployment (`make_site`) and its proofs."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from clusters import ClusterHandle

from k8s_dispatch.delivery import cleanup, create, records
from k8s_dispatch.delivery.crashpoints import Point
from k8s_dispatch.recovery.executor import ORPHANS_REPORTED
from k8s_dispatch.store.models import DispatchState, EventType
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.job_status import job_state
from k8s_dispatch.workers.manifest import FINALIZER, job_name
from k8s_dispatch.workers.types import DispatchRef
from tests.realcluster.test_kubelet_work_path import busybox
from tests.recovery.test_crash_matrix import MATRIX, N, Site, expected_output

# tests/recovery's `sim.ok` as a real container: its input back, as localcluster's simulate mode answers
SIM_OK = busybox("""printf '{"simulated": true, "input": %s}' "$K8S_DISPATCH_INPUT" > /dev/termination-log""")
# Where the node is in play: a Job made and not marked, a finished Pod not yet recorded, a recorded
# one still held by our finalizer (the matrix's other points never reach the node).
KUBELET_POINTS = (Point.AFTER_JOB_CREATE, Point.BEFORE_COMPLETE_WRITE, Point.AFTER_COMPLETE_WRITE)


@pytest.fixture
def kubelet_site(kubelet_cluster: ClusterHandle, make_site: Any, tmp_path: Path) -> Any:
    """`make_site` on the kubelet cluster with `sim.ok` a busybox container: `kubelet_site(**settings)`."""
    caps = tmp_path / "kubelet-capabilities.yaml"
    caps.write_text(yaml.safe_dump({"capabilities": {"sim.ok": SIM_OK}}))
    return lambda **overrides: make_site(kubelet_cluster, capabilities=str(caps), **overrides)


@pytest.mark.parametrize("point", KUBELET_POINTS, ids=[p.value for p in KUBELET_POINTS])
def test_a_worker_killed_at_a_crash_point_on_a_real_node_loses_nothing_and_doubles_nothing(point, kubelet_site):
    # as tests/recovery's matrix: the work sent through the session, one worker with the point armed
    arrives, concurrency, proof = MATRIX[point]
    assert arrives == "session"
    values = [{"point": point.value, "i": i} for i in range(N)]
    site = kubelet_site()
    doomed = site.worker("doomed", crash_at=point.value, concurrency=concurrency)
    site.beat()
    ids = site.schedule(values)
    site.wait_killed(doomed, timeout_s=120)
    proof(site, ids)
    site.worker("fresh")
    site.assert_delivered_once(ids, values)
    assert_no_pod_left(site)


def pods_of(site: Site, dispatch_id: str) -> list[dict[str, Any]]:
    return site.rt.kube.list_pods(site.namespace, label_selector=f"{cleanup.JOB_NAME_LABEL}={job_name(dispatch_id)}")


def assert_no_pod_left(site: Site) -> None:
    """No Pod of ours left at all: our finalizer released from each, the kubelet's last DELETE done."""
    site.wait(
        lambda: not site.rt.kube.list_pods(site.namespace, label_selector=job_labels.selector()),
        timeout_s=60,
        what="no Pod of ours left",
    )


def finished(site: Site, ids: list[str]) -> dict[str, dict[str, Any]]:
    """Each dispatch's one Pod once its Job has finished (the test's own creates: no worker runs)."""

    def done() -> bool:
        jobs = {j["metadata"]["name"]: j for j in site.jobs()}
        return all(job_name(d) in jobs and job_state(jobs[job_name(d)]).terminal for d in ids)

    site.wait(done, timeout_s=120, what=f"{len(ids)} Jobs finished on the node")
    pods = {}
    for dispatch_id in ids:
        [pod] = pods_of(site, dispatch_id)
        assert FINALIZER in pod["metadata"]["finalizers"]  # copied from the Job's template
        pods[dispatch_id] = pod
    return pods


def test_results_held_by_our_finalizer_and_a_result_really_lost_are_each_delivered_once(kubelet_site):
    """Jobs that finished while no worker ran: one's Pod deleted at once (grace 0, as PodGC or a
    person would), one's Job deleted in the foreground (its Pods first), one's Pod stripped of our
    finalizer and deleted (its result gone). The first two are delivered from the Pods our finalizer
    kept; the third runs again and completes on its second attempt; each exactly once."""
    site = kubelet_site(sweep_grace_s="0")
    values = [{"held": "grace 0"}, {"held": "foreground"}, {"held": "lost"}]
    pod_deleted, job_deleted, lost = ids = site.schedule(values, send=False)
    for dispatch_id in ids:
        create.create_job_for(site.rt, dispatch_id)
    pods = finished(site, ids)

    with kubernetes.config.new_client_from_config(config_file=str(site.settings.kubeconfig)) as api:
        core, batch = kubernetes.client.CoreV1Api(api), kubernetes.client.BatchV1Api(api)
        core.delete_namespaced_pod(pods[pod_deleted]["metadata"]["name"], site.namespace, grace_period_seconds=0)
        batch.delete_namespaced_job(job_name(job_deleted), site.namespace, propagation_policy="Foreground")
        gone = pods[lost]["metadata"]
        core.patch_namespaced_pod(
            gone["name"], site.namespace,
            [{"op": "remove", "path": f"/metadata/finalizers/{gone['finalizers'].index(FINALIZER)}"}],
        )  # fmt: skip
        core.delete_namespaced_pod(gone["name"], site.namespace)
    site.wait(lambda: not pods_of(site, lost), timeout_s=60, what="the lost result's Pod gone")
    for dispatch_id in (pod_deleted, job_deleted):
        site.wait(
            lambda d=dispatch_id: all(p["metadata"].get("deletionTimestamp") for p in pods_of(site, d)),
            timeout_s=30,
            what="the Pod marked deleted and kept",
        )
        [kept] = pods_of(site, dispatch_id)
        assert kept["status"]["containerStatuses"][0]["state"]["terminated"]["reason"] == "Completed"

    site.worker("w1")
    site.beat()
    site.assert_delivered_once(ids, values)
    record = records.load_record(site.rt, lost)
    assert record.attempts == 1  # run again, once
    assert [records.load_record(site.rt, d).attempts for d in (pod_deleted, job_deleted)] == [0, 0]
    assert_no_pod_left(site)


def forge_job(site: Site, ref: DispatchRef) -> str:
    """A Job with `ref`'s labels and our finalizer, made by someone else: a busybox that succeeds."""
    labels, annotations = job_labels.encode(ref, deployment=site.settings.effective_deployment)
    name = job_name(ref.dispatch_id)
    container = {"name": "worker", "image": "busybox:1.36", "command": ["sh", "-c"],
                 "args": ["""printf '{"forged": true}' > /dev/termination-log"""]}  # fmt: skip
    site.rt.kube.create_job(site.namespace, {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "labels": labels, "annotations": annotations, "finalizers": [FINALIZER]},
        "spec": {"backoffLimit": 0, "template": {"spec": {"restartPolicy": "Never", "containers": [container]}}},
    })  # fmt: skip
    return name


def test_a_forged_job_and_a_tenancy_mismatched_job_that_ran_on_the_node_are_never_delivered(kubelet_site):
    site = kubelet_site()
    forged_ref = DispatchRef(
        dispatch_id=str(uuid.uuid4()), case_id="case-x", tenancy_id="tenant-a", capability="sim.ok",  # type: ignore[arg-type]
        worker_name="shell", idempotency_key="forged",  # type: ignore[arg-type]
    )  # fmt: skip
    forged = forge_job(site, forged_ref)
    [victim] = site.schedule([{"victim": 1}], send=False)
    forge_job(site, DispatchRef(**{**records.load_record(site.rt, victim).ref.__dict__, "tenancy_id": "tenant-b"}))
    values = [{"honest": i} for i in range(3)]
    honest = site.schedule(values)

    site.worker("w1")
    site.beat()
    site.wait(lambda: site.all_terminal(honest), timeout_s=120, what="the honest dispatches terminal")
    site.wait(lambda: site.rt.stats.get(ORPHANS_REPORTED) >= 1, what="the forged Job reported")
    site.wait(
        lambda: all(job_state(j).terminal for j in site.jobs() if j["metadata"]["name"] in (forged, job_name(victim))),
        timeout_s=60,
        what="the forged Jobs ran on the node",
    )
    ended = site.terminal_events([victim, forged_ref.dispatch_id])
    assert ended[forged_ref.dispatch_id] == [] and forged_ref.dispatch_id not in site.notifications()
    # as on the other clusters (tests/recovery): never delivered from the squatter; ended
    # LabelMismatch if a create met it first, else left scheduled within the grace
    if ended[victim]:
        [(event, payload)] = ended[victim]
        assert (event, payload["reason"]) == (EventType.WORKER_FAILED.value, "LabelMismatch"), payload
    else:
        assert site.rows([victim])[victim].state is DispatchState.SCHEDULED
    assert victim not in site.notifications() or ended[victim]
    assert forged in {j["metadata"]["name"] for j in site.jobs()}  # left alone: report policy
    events = site.terminal_events(honest)
    assert all(
        events[d] == [(EventType.WORKER_COMPLETED, {"output": expected_output(v)})]
        for d, v in zip(honest, values, strict=True)
    )
