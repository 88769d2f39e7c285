"""Watch through `watch.Watch().stream` (ADDED/MODIFIED/DELETED, selectors, timeoutSeconds, rv
"0" replay, 410 on a too-old resourceVersion) and deletion: finalizers, propagation policies,
gracePeriodSeconds, preconditions."""

from __future__ import annotations

import json
import threading
import time

import pytest
from conftest import Api, job_manifest, raw_request, wait_for
from kubernetes import client, watch
from kubernetes.client import ApiException

from k8s_dispatch.demo.localcluster import LocalCluster

HANG = {"localcluster.k8s-dispatch.io/outcome": "hang"}
FINALIZER = "k8s-dispatch.io/result-protection"


def test_watch_from_a_list_sees_changes_in_order(sim: Api) -> None:
    sim.create_job(job_manifest("w1", labels={"w": "yes"}, annotations=HANG))
    listed = sim.batch.list_namespaced_job(sim.namespace, label_selector="w=yes")
    events: list[tuple[str, str, dict]] = []
    w = watch.Watch()

    def consume() -> None:
        for ev in w.stream(
            sim.batch.list_namespaced_job,
            sim.namespace,
            label_selector="w=yes",
            resource_version=listed.metadata.resource_version,
            timeout_seconds=5,
        ):
            events.append((ev["type"], ev["object"].metadata.name, ev["object"].metadata.labels or {}))
            if ev["type"] == "DELETED" and ev["object"].metadata.name == "w2":
                w.stop()

    t = threading.Thread(target=consume)
    t.start()
    sim.create_job(job_manifest("w2", labels={"w": "yes"}, annotations=HANG))
    sim.create_job(job_manifest("other", labels={"w": "no"}, annotations=HANG))
    sim.batch.patch_namespaced_job("w1", sim.namespace, {"metadata": {"labels": {"w": "no"}}})  # leaves the selection
    sim.batch.delete_namespaced_job("w2", sim.namespace, propagation_policy="Background")
    t.join(10)
    assert not t.is_alive()
    kinds = [(k, n) for k, n, _ in events]
    assert ("ADDED", "w2") in kinds and ("DELETED", "w2") in kinds
    assert ("DELETED", "w1") in kinds  # a label change out of the selector reads as DELETED
    # ... carrying the object as it matched (kube-apiserver's watch cache sends the previous content)
    assert [labels.get("w") for k, n, labels in events if (k, n) == ("DELETED", "w1")] == ["yes"]
    assert all(n != "other" for _, n in kinds)
    assert kinds.index(("ADDED", "w2")) < kinds.index(("DELETED", "w2"))


def test_watch_from_zero_replays_current_objects_and_honours_timeout(sim: Api) -> None:
    sim.create_job(job_manifest("z1", annotations=HANG))
    sim.create_job(job_manifest("z2", annotations=HANG))
    w = watch.Watch()
    names = [
        (e["type"], e["object"].metadata.name)
        for e in w.stream(sim.batch.list_namespaced_job, sim.namespace, resource_version="0", timeout_seconds=1)
    ]
    # each Job is replayed as ADDED; the controller's later status writes may follow as MODIFIED
    assert names[:2] == [("ADDED", "z1"), ("ADDED", "z2")]
    assert {t for t, _ in names[2:]} <= {"MODIFIED"}


def test_watch_by_name_on_the_watch_path(sim: Api) -> None:
    sim.create_job(job_manifest("solo", annotations=HANG))
    sim.create_job(job_manifest("noise", annotations=HANG))
    code, _, body = raw_request(
        sim.cluster, "GET", f"/apis/batch/v1/watch/namespaces/{sim.namespace}/jobs/solo?timeoutSeconds=1"
    )
    lines = [json.loads(line) for line in body.splitlines()]
    assert code == 200 and lines
    assert {ln["object"]["metadata"]["name"] for ln in lines} == {"solo"}
    assert lines[0]["type"] == "ADDED"


def test_bookmarks_carry_a_resource_version(sim: Api) -> None:
    rv = sim.batch.list_namespaced_job(sim.namespace).metadata.resource_version
    _code, _, body = raw_request(
        sim.cluster,
        "GET",
        f"/apis/batch/v1/namespaces/{sim.namespace}/jobs?watch=true&allowWatchBookmarks=true&sendInitialEvents=true"
        f"&resourceVersionMatch=NotOlderThan&resourceVersion={rv}&timeoutSeconds=1",
    )
    events = [json.loads(line) for line in body.splitlines()]
    bookmark = next(e for e in events if e["type"] == "BOOKMARK")
    assert bookmark["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}
    assert int(bookmark["object"]["metadata"]["resourceVersion"]) >= int(rv)


def test_a_watch_gets_a_bookmark_about_two_seconds_before_its_timeout(sim: Api) -> None:
    """As kube-apiserver's watch cache does while things change: a client resuming after the
    timeout starts close to now, and the events after the bookmark still come on this watch."""
    rv = sim.batch.list_namespaced_job(sim.namespace).metadata.resource_version
    stop = threading.Event()

    def churn() -> None:  # changes all along (kube-apiserver sends no bookmark while nothing changes)
        for i in range(40):
            if stop.wait(0.25):
                return
            sim.create_job(job_manifest(f"b{i}", annotations=HANG))

    changer = threading.Thread(target=churn)
    changer.start()
    try:
        opened = time.monotonic()
        response = sim.batch.list_namespaced_job(
            sim.namespace, watch=True, allow_watch_bookmarks=True, resource_version=rv, timeout_seconds=4,
            _preload_content=False,
        )  # fmt: skip
        got = [(time.monotonic() - opened, json.loads(line)) for line in response if line.strip()]
        ended = time.monotonic() - opened
    finally:
        stop.set()
        changer.join()
    types = [e["type"] for _, e in got]
    assert "BOOKMARK" in types, types
    at, bookmark = got[types.index("BOOKMARK")]
    assert 1.0 <= at <= 3.5 and ended - at >= 0.5, (at, ended)  # before the end, not at it
    assert int(bookmark["object"]["metadata"]["resourceVersion"]) >= int(rv)
    assert "ADDED" in types[types.index("BOOKMARK") :], types  # the watch goes on after it


def test_a_too_old_resource_version_is_a_410_error_event() -> None:
    with LocalCluster(mode="simulate", event_log_size=20, tls=False) as cluster:
        from kubernetes import config

        api_client = config.new_client_from_config(config_file=str(cluster.kubeconfig))
        try:
            batch = client.BatchV1Api(api_client)
            old_rv = batch.list_namespaced_job("default").metadata.resource_version
            for i in range(15):  # each Job makes several events: the log forgets old_rv
                batch.create_namespaced_job("default", job_manifest(f"o{i}", annotations=HANG))
            wait_for(lambda: len(client.CoreV1Api(api_client).list_namespaced_pod("default").items) == 15, what="pods")
            code, _, body = raw_request(
                cluster, "GET", f"/apis/batch/v1/namespaces/default/jobs?watch=1&resourceVersion={old_rv}"
            )
            event = json.loads(body.splitlines()[0])
            assert code == 200 and event["type"] == "ERROR"
            assert event["object"]["code"] == 410 and event["object"]["reason"] == "Expired"
            assert event["object"]["message"].startswith(f"too old resource version: {old_rv}")
            # the Python client turns it into an ApiException (it retries once only without timeout_seconds)
            w = watch.Watch()
            with pytest.raises(ApiException) as e:
                for _ in w.stream(batch.list_namespaced_job, "default", resource_version=old_rv, timeout_seconds=2):
                    pass
            assert e.value.status == 410
        finally:
            api_client.close()


def test_a_job_with_a_finalizer_stays_until_it_is_removed(sim: Api) -> None:
    manifest = job_manifest("kept", annotations={"localcluster.k8s-dispatch.io/duration-ms": "1"})
    manifest["metadata"]["finalizers"] = [FINALIZER]
    sim.create_job(manifest)
    sim.wait_job("kept", "Complete")
    sim.batch.delete_namespaced_job("kept", sim.namespace, propagation_policy="Background")
    job = sim.job("kept")
    assert job.metadata.deletion_timestamp is not None and job.metadata.finalizers == [FINALIZER]
    with pytest.raises(ApiException) as e:  # no new finalizers on a deleting object
        sim.batch.patch_namespaced_job("kept", sim.namespace, {"metadata": {"finalizers": [FINALIZER, "x.io/more"]}})
    assert e.value.status == 422
    rv = job.metadata.resource_version
    deleted: list[str] = []
    w = watch.Watch()

    def consume() -> None:
        for ev in w.stream(sim.batch.list_namespaced_job, sim.namespace, resource_version=rv, timeout_seconds=5):
            if ev["type"] == "DELETED":
                deleted.append(ev["object"].metadata.name)
                w.stop()

    t = threading.Thread(target=consume)
    t.start()
    sim.batch.patch_namespaced_job("kept", sim.namespace, [{"op": "remove", "path": "/metadata/finalizers"}])
    t.join(10)
    assert deleted == ["kept"]
    assert sim.gone(lambda: sim.job("kept"))
    wait_for(lambda: not sim.pods_of("kept"), what="pods deleted with the job (Background)")


def test_background_deletes_pods_orphan_keeps_them(sim: Api) -> None:
    for name in ("bg", "orph", "dflt"):
        sim.create_job(job_manifest(name, annotations=HANG))
        wait_for(lambda n=name: sim.pods_of(n), what=f"{name} pod")
    sim.batch.delete_namespaced_job("bg", sim.namespace, propagation_policy="Background")
    wait_for(lambda: not sim.pods_of("bg"), what="background pods deleted")
    sim.batch.delete_namespaced_job("orph", sim.namespace, propagation_policy="Orphan")
    wait_for(lambda: sim.gone(lambda: sim.job("orph")), what="orphaning job gone")
    pod = sim.pods_of("orph")[0]
    assert not pod.metadata.owner_references and pod.status.phase == "Running"
    # no policy: Jobs orphan by default, with a warning
    code, headers, _ = raw_request(sim.cluster, "DELETE", f"/apis/batch/v1/namespaces/{sim.namespace}/jobs/dflt")
    assert code == 200 and "child pods are preserved by default" in headers["warning"]
    wait_for(lambda: sim.gone(lambda: sim.job("dflt")), what="default-policy job gone")
    assert sim.pods_of("dflt")[0].metadata.owner_references is None


def test_foreground_deletion_waits_for_the_pods(sim: Api) -> None:
    sim.create_job(job_manifest("fg", annotations=HANG))
    wait_for(lambda: sim.pods_of("fg"), what="pod")
    sim.batch.delete_namespaced_job("fg", sim.namespace, propagation_policy="Foreground")
    wait_for(lambda: sim.gone(lambda: sim.job("fg")), what="foreground job gone")
    assert not sim.pods_of("fg")


def test_pod_deletion_grace_and_preconditions(sim: Api) -> None:
    sim.core.create_namespaced_pod(
        sim.namespace,
        {"metadata": {"name": "p", "annotations": HANG}, "spec": {"containers": [{"name": "c", "image": "i"}]}},
    )
    running = wait_for(
        lambda: (lambda p: p if p.status.phase == "Running" else None)(
            sim.core.read_namespaced_pod("p", sim.namespace)
        ),
        what="pod running",
    )
    with pytest.raises(ApiException) as e:
        sim.core.delete_namespaced_pod(
            "p", sim.namespace, body=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid="other"))
        )
    assert e.value.status == 409
    out = sim.core.delete_namespaced_pod("p", sim.namespace, grace_period_seconds=0)
    assert out.metadata.uid == running.metadata.uid
    wait_for(lambda: sim.gone(lambda: sim.core.read_namespaced_pod("p", sim.namespace)), what="pod gone")


def test_deleting_a_running_jobs_pod_counts_a_failure_and_replaces_it(sim: Api) -> None:
    sim.create_job(job_manifest("replace", annotations=HANG, backoffLimit=3))
    first = wait_for(lambda: sim.pods_of("replace"), what="pod")[0].metadata.name
    sim.core.delete_namespaced_pod(first, sim.namespace)
    job = wait_for(
        lambda: (lambda j: j if j.status.failed == 1 and j.status.active == 1 else None)(sim.job("replace")),
        what="failed=1, active=1",
    )
    names = [p.metadata.name for p in sim.pods_of("replace")]
    assert first not in names and len(names) == 1
    assert job.status.terminating == 0
