"""The REST verbs on Jobs, Pods and Namespaces through the official Python client: create, read,
list (selectors, pagination), patch (merge, strategic, JSON), replace with conflicts, the status
subresource, and errors as Status objects."""

from __future__ import annotations

import json

import pytest
from conftest import Api, job_manifest, raw_request, wait_for
from kubernetes import client
from kubernetes.client import ApiException

HANG = {"localcluster.k8s-dispatch.io/outcome": "hang"}


def _status(e: ApiException) -> dict:
    return json.loads(e.body)


def test_create_fills_metadata_defaults_selector_and_labels(sim: Api) -> None:
    job = sim.create_job(job_manifest("made", annotations=HANG))
    meta, spec = job.metadata, job.spec
    assert meta.uid and meta.resource_version and meta.creation_timestamp and meta.generation == 1
    assert meta.namespace == sim.namespace
    assert spec.completions == 1 and spec.parallelism == 1 and spec.backoff_limit == 6
    assert spec.completion_mode == "NonIndexed" and spec.suspend is False
    assert spec.selector.match_labels == {"batch.kubernetes.io/controller-uid": meta.uid}
    tlabels = spec.template.metadata.labels
    assert tlabels["batch.kubernetes.io/job-name"] == "made" and tlabels["job-name"] == "made"
    assert tlabels["controller-uid"] == meta.uid
    assert meta.labels == tlabels  # copied from the template when the Job has none
    c = spec.template.spec.containers[0]
    assert c.termination_message_path == "/dev/termination-log" and c.termination_message_policy == "File"
    assert sim.core.read_namespace(sim.namespace).status.phase == "Active"  # namespaces appear on first use


def test_pods_are_owned_by_their_job_and_carry_the_tracking_finalizer(sim: Api) -> None:
    job = sim.create_job(job_manifest("owned", annotations=HANG))
    pods = wait_for(lambda: sim.pods_of("owned"), what="the job's pod")
    pod = pods[0]
    assert pod.metadata.name.startswith("owned-") and len(pod.metadata.name) == len("owned-") + 5
    ref = pod.metadata.owner_references[0]
    assert (ref.kind, ref.name, ref.uid, ref.controller, ref.block_owner_deletion) == (
        "Job",
        "owned",
        job.metadata.uid,
        True,
        True,
    )
    assert pod.metadata.finalizers == ["batch.kubernetes.io/job-tracking"]
    running = wait_for(lambda: (lambda j: j if j.status.ready == 1 else None)(sim.job("owned")), what="ready=1")
    assert running.status.active == 1 and running.status.start_time is not None


def test_errors_are_status_objects(sim: Api) -> None:
    with pytest.raises(ApiException) as e:
        sim.job("missing")
    body = _status(e.value)
    assert e.value.status == 404
    assert body["kind"] == "Status" and body["reason"] == "NotFound"
    assert body["message"] == 'jobs.batch "missing" not found'
    assert body["details"] == {"name": "missing", "group": "batch", "kind": "jobs"}

    sim.create_job(job_manifest("twice", annotations=HANG))
    with pytest.raises(ApiException) as e:
        sim.create_job(job_manifest("twice", annotations=HANG))
    assert e.value.status == 409 and _status(e.value)["reason"] == "AlreadyExists"
    assert _status(e.value)["message"] == 'jobs.batch "twice" already exists'

    bad = job_manifest("Bad_Name")
    bad["spec"]["template"]["spec"]["restartPolicy"] = "Always"
    with pytest.raises(ApiException) as e:
        sim.create_job(bad)
    body = _status(e.value)
    assert e.value.status == 422 and body["reason"] == "Invalid"
    assert body["message"].startswith('Job.batch "Bad_Name" is invalid: [metadata.name: Invalid value: "Bad_Name"')
    fields = {c["field"]: c["reason"] for c in body["details"]["causes"]}
    assert fields == {"metadata.name": "FieldValueInvalid", "spec.template.spec.restartPolicy": "FieldValueRequired"}

    with pytest.raises(ApiException) as e:
        sim.core.read_namespaced_pod("nope", sim.namespace)
    assert _status(e.value)["message"] == 'pods "nope" not found'


def test_unknown_fields_are_dropped_or_rejected_with_strict_validation(sim: Api) -> None:
    manifest = job_manifest("strict", annotations=HANG)
    manifest["spec"]["bogus"] = 1
    path = f"/apis/batch/v1/namespaces/{sim.namespace}/jobs"
    code, _, body = raw_request(sim.cluster, "POST", path + "?fieldValidation=Strict", manifest)
    assert code == 400
    assert json.loads(body)["message"] == (
        'Job in version "v1" cannot be handled as a Job: strict decoding error: unknown field "spec.bogus"'
    )
    code, headers, body = raw_request(sim.cluster, "POST", path, manifest)  # default: Warn
    assert code == 201 and "bogus" not in json.loads(body)["spec"]
    assert headers["warning"] == '299 - "unknown field \\"spec.bogus\\""'
    code, _, body = raw_request(
        sim.cluster, "POST", path, {**manifest, "spec": {**manifest["spec"], "backoffLimit": "six"}}
    )
    assert code == 400 and "cannot unmarshal string" in json.loads(body)["message"]


def test_list_with_label_and_field_selectors(sim: Api) -> None:
    for name, tier in (("a1", "front"), ("a2", "back"), ("a3", "front")):
        sim.create_job(job_manifest(name, labels={"tier": tier, "app": "x"}, annotations=HANG))

    def names(sel):
        return sorted(j.metadata.name for j in sim.batch.list_namespaced_job(sim.namespace, label_selector=sel).items)

    assert names("tier=front") == ["a1", "a3"]
    assert names("tier!=front") == ["a2"]
    assert names("tier in (back,other)") == ["a2"]
    assert names("tier notin (back),app") == ["a1", "a3"]
    assert names("!app") == []
    by_field = sim.batch.list_namespaced_job(sim.namespace, field_selector="metadata.name=a2").items
    assert [j.metadata.name for j in by_field] == ["a2"]
    everywhere = sim.batch.list_job_for_all_namespaces(label_selector="tier=back").items
    assert "a2" in [j.metadata.name for j in everywhere]
    with pytest.raises(ApiException) as e:
        sim.batch.list_namespaced_job(sim.namespace, label_selector="tier in (")
    assert e.value.status == 400


def test_pagination_is_a_consistent_snapshot(sim: Api) -> None:
    for i in range(7):
        sim.create_job(job_manifest(f"p{i}", annotations=HANG))
    first = sim.batch.list_namespaced_job(sim.namespace, limit=3)
    assert [j.metadata.name for j in first.items] == ["p0", "p1", "p2"]
    assert first.metadata._continue and first.metadata.remaining_item_count == 4
    sim.create_job(job_manifest("p7", annotations=HANG))  # after the snapshot: not in these pages
    sim.batch.delete_namespaced_job("p5", sim.namespace, propagation_policy="Background")
    seen = [j.metadata.name for j in first.items]
    token = first.metadata._continue
    while token:
        page = sim.batch.list_namespaced_job(sim.namespace, limit=3, _continue=token)
        assert page.metadata.resource_version == first.metadata.resource_version
        seen += [j.metadata.name for j in page.items]
        token = page.metadata._continue
    assert seen == [f"p{i}" for i in range(7)]
    with pytest.raises(ApiException) as e:
        sim.batch.list_namespaced_job(sim.namespace, limit=3, _continue=first.metadata._continue[:-4] + "AAAA")
    assert e.value.status in (400, 410)


def test_an_expired_continue_token_is_410(lsim: Api) -> None:
    # localcluster alone: it frees a snapshot read to its end, where kube-apiserver keeps a token
    # valid until etcd compacts past it (5 minutes by default): demo/localcluster/README.md, divergences
    sim = lsim
    for i in range(3):
        sim.create_job(job_manifest(f"e{i}", annotations=HANG))
    first = sim.batch.list_namespaced_job(sim.namespace, limit=1)
    token = first.metadata._continue
    rest = sim.batch.list_namespaced_job(sim.namespace, limit=5, _continue=token)  # reads to the end: snapshot freed
    assert not rest.metadata._continue
    with pytest.raises(ApiException) as e:
        sim.batch.list_namespaced_job(sim.namespace, limit=1, _continue=token)
    assert e.value.status == 410 and _status(e.value)["reason"] == "Expired"


def test_merge_strategic_and_json_patches(sim: Api) -> None:
    sim.create_job(job_manifest("patched", labels={"a": "1"}, annotations=HANG))
    job = sim.batch.patch_namespaced_job(
        "patched", sim.namespace, {"metadata": {"labels": {"b": "2"}, "finalizers": ["x.io/one"]}}
    )
    assert job.metadata.labels == {"a": "1", "b": "2"} and job.metadata.finalizers == ["x.io/one"]
    # strategic merge: finalizers merge as a set, a new one before the server's next (kube-apiserver's order)
    job = sim.batch.patch_namespaced_job("patched", sim.namespace, {"metadata": {"finalizers": ["x.io/two"]}})
    assert job.metadata.finalizers == ["x.io/two", "x.io/one"]
    job = sim.batch.patch_namespaced_job(
        "patched", sim.namespace, {"metadata": {"finalizers": ["x.io/zero", "x.io/one", "x.io/four"]}}
    )
    assert job.metadata.finalizers == ["x.io/zero", "x.io/two", "x.io/one", "x.io/four"]
    job = sim.batch.patch_namespaced_job(
        "patched", sim.namespace, {"metadata": {"$deleteFromPrimitiveList/finalizers": ["x.io/zero", "x.io/four"]}}
    )
    job = sim.batch.patch_namespaced_job(
        "patched", sim.namespace, {"metadata": {"$deleteFromPrimitiveList/finalizers": ["x.io/one"]}}
    )
    assert job.metadata.finalizers == ["x.io/two"]
    # JSON merge patch replaces lists and deletes with null
    job = sim.batch.patch_namespaced_job(
        "patched",
        sim.namespace,
        {"metadata": {"finalizers": ["x.io/three"], "labels": {"a": None}}},
        _content_type="application/merge-patch+json",
    )
    assert job.metadata.finalizers == ["x.io/three"] and "a" not in job.metadata.labels
    # JSON patch (a list body)
    job = sim.batch.patch_namespaced_job(
        "patched",
        sim.namespace,
        [
            {"op": "test", "path": "/metadata/finalizers/0", "value": "x.io/three"},
            {"op": "remove", "path": "/metadata/finalizers/0"},
            {"op": "add", "path": "/spec/backoffLimit", "value": 2},
        ],
    )
    assert not job.metadata.finalizers and job.spec.backoff_limit == 2 and job.metadata.generation == 2
    with pytest.raises(ApiException) as e:
        sim.batch.patch_namespaced_job(
            "patched", sim.namespace, [{"op": "test", "path": "/spec/backoffLimit", "value": 9}]
        )
    assert e.value.status == 422
    with pytest.raises(ApiException) as e:  # an immutable field
        sim.batch.patch_namespaced_job(
            "patched",
            sim.namespace,
            {"spec": {"template": {"spec": {"containers": [{"name": "main", "image": "other"}]}}}},
        )
    assert e.value.status == 422 and "field is immutable" in _status(e.value)["message"]


def test_strategic_merge_of_containers_by_name(sim: Api) -> None:
    pod = {
        "metadata": {"name": "solo", "annotations": HANG},
        "spec": {
            "containers": [
                {"name": "a", "image": "one", "env": [{"name": "X", "value": "1"}]},
                {"name": "b", "image": "two"},
            ]
        },
    }
    sim.core.create_namespaced_pod(sim.namespace, pod)
    got = sim.core.patch_namespaced_pod(
        "solo", sim.namespace, {"spec": {"containers": [{"name": "b", "image": "three"}]}}
    )
    assert [(c.name, c.image) for c in got.spec.containers] == [("a", "one"), ("b", "three")]
    assert got.spec.containers[0].env[0].value == "1"


def test_replace_checks_the_resource_version(sim: Api) -> None:
    sim.create_job(job_manifest("rep", annotations=HANG))
    # once its pod runs, the controller has nothing more to write: no race with our replace
    job = wait_for(lambda: (lambda j: j if j.status.ready == 1 else None)(sim.job("rep")), what="job settled")
    job.metadata.labels["new"] = "yes"
    updated = sim.batch.replace_namespaced_job("rep", sim.namespace, job)
    assert updated.metadata.labels["new"] == "yes"
    assert int(updated.metadata.resource_version) > int(job.metadata.resource_version)
    job.metadata.labels["again"] = "no"  # still the old resourceVersion
    with pytest.raises(ApiException) as e:
        sim.batch.replace_namespaced_job("rep", sim.namespace, job)
    body = _status(e.value)
    assert e.value.status == 409 and body["reason"] == "Conflict"
    assert body["message"] == (
        'Operation cannot be fulfilled on jobs.batch "rep": the object has been modified; '
        "please apply your changes to the latest version and try again"
    )
    with pytest.raises(ApiException) as e:
        sim.batch.patch_namespaced_job(
            "rep", sim.namespace, {"metadata": {"resourceVersion": "1", "labels": {"z": "1"}}}
        )
    assert e.value.status == 409


def test_status_subresource_keeps_the_spec_and_takes_status_and_metadata(sim: Api) -> None:
    sim.create_job(job_manifest("st", annotations={**HANG}, suspend=True))
    wait_for(lambda: "Suspended" in [c.type for c in sim.job("st").status.conditions or []], what="Suspended")
    # a condition of our own: a status field the Job controller leaves alone
    mine = {
        "type": "x.io/Checked",
        "status": "True",
        "reason": "Test",
        "message": "m",
        "lastTransitionTime": "2026-01-01T00:00:00Z",
    }
    job = sim.batch.patch_namespaced_job_status(
        "st",
        sim.namespace,
        [
            {"op": "add", "path": "/status/conditions/-", "value": mine},
            {"op": "add", "path": "/metadata/labels/ignored", "value": "1"},
            {"op": "replace", "path": "/spec/backoffLimit", "value": 1},
        ],
    )
    assert job.spec.backoff_limit == 6
    # the spec cannot change there, metadata can (kube-apiserver's status strategy resets only the spec)
    assert "x.io/Checked" in [c.type for c in job.status.conditions] and job.metadata.labels["ignored"] == "1"
    other = {**mine, "type": "x.io/Other"}
    job = sim.batch.patch_namespaced_job(
        "st", sim.namespace, [{"op": "add", "path": "/status/conditions/-", "value": other}]
    )
    assert "x.io/Other" not in [c.type for c in job.status.conditions]  # the main resource ignores status
    read = sim.batch.read_namespaced_job_status("st", sim.namespace)
    assert "x.io/Checked" in [c.type for c in read.status.conditions]
    read.status.conditions = [c for c in read.status.conditions if c.type != "x.io/Checked"]
    replaced = sim.batch.replace_namespaced_job_status("st", sim.namespace, read)
    assert "x.io/Checked" not in [c.type for c in replaced.status.conditions]
    # and status is validated: completedIndexes belong to Indexed Jobs
    with pytest.raises(ApiException) as e:
        sim.batch.patch_namespaced_job_status(
            "st", sim.namespace, {"status": {"completedIndexes": "0"}}, _content_type="application/merge-patch+json"
        )
    assert e.value.status == 422
    assert "cannot set non-empty completedIndexes when non-indexed completion mode" in _status(e.value)["message"]


def test_namespaces_list_get_create_delete(sim: Api) -> None:
    name = f"{sim.namespace}-own"
    made = sim.core.create_namespace({"metadata": {"name": name, "labels": {"team": name}}})
    assert made.status.phase == "Active"
    assert made.metadata.labels["kubernetes.io/metadata.name"] == name
    names = [n.metadata.name for n in sim.core.list_namespace(label_selector=f"team={name}").items]
    assert names == [name]
    sim.batch.create_namespaced_job(name, job_manifest("inside", annotations=HANG))
    sim.core.delete_namespace(name)
    wait_for(lambda: sim.gone(lambda: sim.core.read_namespace(name)), timeout=60, what="namespace deleted")
    assert sim.gone(lambda: sim.batch.read_namespaced_job("inside", name))
    with pytest.raises(ApiException) as e:
        sim.core.create_namespace({"metadata": {"name": "Not_A_Label"}})
    assert e.value.status == 422


def test_pods_can_be_created_directly_and_run(sim: Api) -> None:
    pod = {
        "metadata": {"name": "bare", "annotations": {"localcluster.k8s-dispatch.io/duration-ms": "10"}},
        "spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "i"}]},
    }
    created = sim.core.create_namespaced_pod(sim.namespace, pod)
    assert created.status.phase == "Pending" and created.spec.service_account_name == "default"
    done = wait_for(
        lambda: (lambda p: p if p.status.phase == "Succeeded" else None)(
            sim.core.read_namespaced_pod("bare", sim.namespace)
        ),
        what="pod succeeded",
    )
    term = done.status.container_statuses[0].state.terminated
    assert term.exit_code == 0 and term.reason == "Completed" and term.finished_at is not None
    log = sim.core.read_namespaced_pod_log("bare", sim.namespace)
    assert json.loads(log) == {"simulated": True, "input": None}


def test_http_listener_and_https_kubeconfig_serve_the_same_api(lsim: Api) -> None:
    sim = lsim  # localcluster's two listeners
    cluster = sim.cluster.backend
    assert cluster.url.startswith("http://") and cluster.https_url.startswith("https://")
    cfg = client.Configuration(
        host=cluster.url, api_key={"authorization": cluster.token}, api_key_prefix={"authorization": "Bearer"}
    )
    with client.ApiClient(cfg) as plain:
        ver = client.VersionApi(plain).get_code()
        assert ver.major == "1" and ver.minor == "32"
        sim.create_job(job_manifest("both", annotations=HANG))
        assert client.BatchV1Api(plain).read_namespaced_job("both", sim.namespace).metadata.name == "both"
