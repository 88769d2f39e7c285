"""The Kubernetes adapter against localcluster over HTTP: every call, and every error mapping."""

from __future__ import annotations

import json
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from k8s_dispatch.core.errors import (
    AlreadyExists,
    ApiRejected,
    ApiUnavailable,
    AuthorizationNotReady,
    ConfigError,
    InvalidManifest,
    NotFound,
    QuotaExceeded,
    Transient,
)
from k8s_dispatch.demo.localcluster import LocalCluster
from k8s_dispatch.demo.localcluster.quota import QUOTA_JOBS
from k8s_dispatch.ops.processes import wait_until
from k8s_dispatch.workers import kube as kube_module
from k8s_dispatch.workers.job_status import job_state
from k8s_dispatch.workers.kube import KubeClient, release_patch

OURS = "k8s-dispatch.io/result-protection"


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(mode="simulate") as c:
        yield c


@pytest.fixture
def kube(cluster):
    with KubeClient(cluster.kubeconfig, timeout_s=5) as client:
        yield client


@pytest.fixture
def ns():
    return f"kube-{uuid.uuid4().hex[:8]}"


def job(
    name: str, *, labels: dict[str, str] | None = None, finalizers: list[str] | None = None, **annotations: str
) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": labels or {"suite": "kube"}, "finalizers": finalizers or []},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "metadata": {"annotations": {"localcluster.k8s-dispatch.io/duration-ms": "10", **annotations}},
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [
                        {"name": "worker", "image": "busybox", "terminationMessagePolicy": "FallbackToLogsOnError"}
                    ],
                },
            },
        },
    }


# --- config ------------------------------------------------------------------------------


def test_a_missing_kubeconfig_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"nope.yaml"):
        KubeClient(tmp_path / "nope.yaml")


def test_a_garbled_kubeconfig_is_a_config_error(tmp_path):
    path = tmp_path / "kubeconfig"
    path.write_text("clusters: [this is: not, a kubeconfig\n")
    with pytest.raises(ConfigError, match=str(path)):
        KubeClient(path)


# --- jobs --------------------------------------------------------------------------------


def test_create_get_and_already_exists(kube, ns):
    assert kube.host.startswith("https://")  # over TLS, verified with the kubeconfig's CA
    created = kube.create_job(ns, job("one", finalizers=[OURS]))
    assert created["metadata"]["name"] == "one"
    assert created["metadata"]["namespace"] == ns
    assert created["metadata"]["uid"]
    assert created["metadata"]["finalizers"] == [OURS]
    got = kube.get_job(ns, "one")
    assert got["metadata"]["uid"] == created["metadata"]["uid"]
    assert got["spec"]["template"]["spec"]["containers"][0]["terminationMessagePolicy"] == "FallbackToLogsOnError"
    with pytest.raises(AlreadyExists) as raised:
        kube.create_job(ns, job("one"))
    assert "already exists" in str(raised.value)


def test_get_missing_job_is_not_found(kube, ns):
    with pytest.raises(NotFound, match="not found"):
        kube.get_job(ns, "missing")


def test_an_invalid_job_is_rejected_with_the_apis_reason_and_message(kube, ns):
    with pytest.raises(ApiRejected) as raised:
        kube.create_job(ns, job("Not_A_Valid_Name"))
    assert raised.value.reason == "Invalid"
    assert "Not_A_Valid_Name" in str(raised.value)
    assert "422" in str(raised.value)


def set_job_quota(cluster, namespace: str, limit: int | None) -> None:
    """localcluster's stand-in for a ResourceQuota `count/jobs.batch: limit` (None: removed)."""
    api = kubernetes.config.new_client_from_config(config_file=str(cluster.kubeconfig))
    try:
        body = {"metadata": {"annotations": {QUOTA_JOBS: None if limit is None else str(limit)}}}
        kubernetes.client.CoreV1Api(api).patch_namespace(namespace, body)
    finally:
        api.close()


def test_a_create_past_the_namespaces_quota_is_passing_not_a_refusal(cluster, kube, ns):
    kube.create_job(ns, job("q-1"))
    set_job_quota(cluster, ns, 1)
    with pytest.raises(QuotaExceeded) as raised:
        kube.create_job(ns, job("q-2"))
    assert isinstance(raised.value, Transient) and raised.value.reason == "QuotaExceeded"
    assert 'jobs.batch "q-2" is forbidden: exceeded quota: ' in str(raised.value) and "403 Forbidden" in str(
        raised.value
    )
    kube.delete_job(ns, "q-1")  # no finalizer: gone at once, and the quota has room again
    assert kube.create_job(ns, job("q-2"))["metadata"]["name"] == "q-2"
    set_job_quota(cluster, ns, None)


@pytest.mark.parametrize(
    ("status", "message", "error", "reason"),
    [
        (
            403,
            'jobs.batch "kd-1" is forbidden: exceeded quota: q, requested: count/jobs.batch=1, used: '
            "count/jobs.batch=5, limited: count/jobs.batch=5",
            QuotaExceeded,
            "QuotaExceeded",
        ),
        (
            403,
            'jobs.batch "kd-1" is forbidden: status unknown for quota: q, resource: count/jobs.batch',
            QuotaExceeded,
            "QuotaExceeded",
        ),
        (403, 'jobs.batch "kd-1" is forbidden: failed quota: q: must specify limits.cpu', ApiRejected, "Forbidden"),
        (
            403,
            'jobs.batch is forbidden: User "system:serviceaccount:x:y" cannot create resource "jobs"',
            ApiRejected,
            "Forbidden",
        ),
        # kube-apiserver before its RBAC cache is filled (seen in the chaos run on the real one)
        (
            403,
            'jobs.batch is forbidden: User "system:serviceaccount:x:y" cannot create resource "jobs" in API group '
            '"batch" in the namespace "x": RBAC: clusterrole.rbac.authorization.k8s.io "system:basic-user" not found',
            AuthorizationNotReady,
            "AuthorizationNotReady",
        ),
    ],
)
def test_which_403_is_passing(status, message, error, reason):
    body = json.dumps(
        {"kind": "Status", "status": "Failure", "reason": "Forbidden", "message": message, "code": status}
    )
    mapped = kube_module._mapped(ApiException(status=status, reason="Forbidden", body=body), "create job in ns")
    assert type(mapped) is error and mapped.reason == reason and message in str(mapped)


def test_a_body_the_client_schema_refuses_never_reaches_the_server(kube, ns):
    body = job("schema")
    body["spec"]["template"]["spec"]["containers"][0]["resources"] = {"limits": {"memory": 64}}  # not a string
    with pytest.raises(InvalidManifest, match="schema"):
        kube.create_job(ns, body)
    with pytest.raises(NotFound):
        kube.get_job(ns, "schema")


def test_iter_jobs_pages_through_everything_with_the_selector(kube, ns):
    for i in range(7):
        kube.create_job(ns, job(f"page-{i}", labels={"suite": "paging"}))
    kube.create_job(ns, job("other", labels={"suite": "elsewhere"}))
    pages = list(kube.iter_jobs(ns, label_selector="suite=paging", page_size=3))
    assert [len(p) for p in pages] == [3, 3, 1]
    assert sorted(j["metadata"]["name"] for p in pages for j in p) == [f"page-{i}" for i in range(7)]
    first = kube.list_jobs_page(ns, label_selector="suite=paging", limit=5)
    assert len(first["items"]) == 5 and first["metadata"]["continue"]
    rest = kube.list_jobs_page(ns, label_selector="suite=paging", limit=5, continue_token=first["metadata"]["continue"])
    assert len(rest["items"]) == 2 and not rest["metadata"].get("continue")


def test_an_expired_continue_token_restarts_the_listing_from_scratch(kube, ns):
    for i in range(5):
        kube.create_job(ns, job(f"exp-{i}", labels={"suite": "expiry"}))
    pages = kube.iter_jobs(ns, label_selector="suite=expiry", page_size=2)
    first = next(pages)
    assert len(first) == 2
    # The server keeps a bounded number of list snapshots: enough other paginated lists
    # evict ours, and its continue token then answers 410 Expired.
    stale = kube.list_jobs_page(ns, label_selector="suite=expiry", limit=1)["metadata"]["continue"]
    for _ in range(200):
        kube.list_jobs_page(ns, label_selector="suite=expiry", limit=1)
    with pytest.raises(ApiUnavailable) as raised:
        kube.list_jobs_page(ns, label_selector="suite=expiry", limit=1, continue_token=stale)
    assert raised.value.reason == "Expired"
    rest = [j["metadata"]["name"] for page in pages for j in page]
    # Listed again from the start: every Job is there (the first page's twice, as documented).
    assert sorted(rest) == [f"exp-{i}" for i in range(5)]


def test_iter_jobs_of_an_empty_namespace_yields_one_empty_page(kube, ns):
    assert list(kube.iter_jobs(ns, label_selector="suite=none")) == [[]]


def test_list_pods_of_a_finished_job_carries_its_termination_message(kube, ns):
    kube.create_job(ns, job("done", **{"localcluster.k8s-dispatch.io/result": '{"answer": 42}'}))
    wait_until(lambda: job_state(kube.get_job(ns, "done")).terminal, what="job done", timeout=10.0)
    pods = kube.list_pods(ns, label_selector="batch.kubernetes.io/job-name=done")
    assert len(pods) == 1
    terminated = pods[0]["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 0
    assert terminated["message"] == '{"answer": 42}'
    assert kube.list_pods(ns, label_selector="batch.kubernetes.io/job-name=other") == []


# --- finalizers and deletion ----------------------------------------------------------------


def test_remove_finalizer_takes_out_exactly_ours(kube, ns):
    kube.create_job(ns, job("fin", finalizers=["a.example/one", OURS, "b.example/two"]))
    assert kube.remove_finalizer(ns, "fin", OURS) is True
    assert kube.get_job(ns, "fin")["metadata"]["finalizers"] == ["a.example/one", "b.example/two"]
    assert kube.remove_finalizer(ns, "fin", OURS) is False  # absent: nothing to do
    assert kube.remove_finalizer(ns, "gone", OURS) is False  # no such Job: nothing to do


def test_concurrent_finalizer_removals_never_remove_the_wrong_entry(kube, ns):
    names = [f"x.example/f{i}" for i in range(6)]
    kube.create_job(ns, job("race", finalizers=names))
    results: dict[str, bool] = {}

    def remove(finalizer: str) -> None:
        barrier.wait()
        results[finalizer] = kube.remove_finalizer(ns, "race", finalizer)

    threads = [threading.Thread(target=remove, args=(n,)) for n in names[1:]]  # keep f0
    barrier = threading.Barrier(len(threads))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {n: True for n in names[1:]}
    assert kube.get_job(ns, "race")["metadata"]["finalizers"] == [names[0]]


def test_delete_waits_for_our_finalizer_then_the_job_is_gone(kube, ns):
    kube.create_job(ns, job("del", finalizers=[OURS]))
    assert kube.delete_job(ns, "del") is True
    held = kube.get_job(ns, "del")
    assert held["metadata"].get("deletionTimestamp")
    assert kube.remove_finalizer(ns, "del", OURS) is True
    wait_until(lambda: not _exists(kube, ns, "del"), what="job deleted", timeout=10.0)
    assert kube.delete_job(ns, "del") is False  # already gone: no error


DONE = ("example.io/done", "true")


def test_release_from_a_snapshot_takes_our_finalizer_off_and_labels_the_job_in_one_patch(kube, ns):
    snapshot = kube.create_job(ns, job("rel", finalizers=[OURS, "b.example/two"]))
    assert kube.release_job(ns, "rel", finalizer=OURS, label=DONE, snapshot=snapshot) is True
    metadata = kube.get_job(ns, "rel")["metadata"]
    assert metadata["finalizers"] == ["b.example/two"]
    assert metadata["labels"] == {"suite": "kube", DONE[0]: "true"}
    # Again from the same (now stale) snapshot: the test fails, a re-read finds nothing to do.
    assert kube.release_job(ns, "rel", finalizer=OURS, label=DONE, snapshot=snapshot) is False
    assert kube.release_job(ns, "gone", finalizer=OURS, label=DONE) is False  # no such Job


def test_release_from_a_stale_snapshot_reads_again_when_the_finalizers_moved(cluster, kube, ns):
    snapshot = kube.create_job(ns, job("moved", finalizers=[OURS]))
    # Someone else puts a finalizer in front of ours: the snapshot's index 0 is now theirs.
    api = kubernetes.config.new_client_from_config(config_file=str(cluster.kubeconfig))
    try:
        kubernetes.client.BatchV1Api(api).patch_namespaced_job(
            "moved", ns, [{"op": "add", "path": "/metadata/finalizers/0", "value": "a.example/one"}],
            _content_type="application/json-patch+json",
        )  # fmt: skip
    finally:
        api.close()
    assert kube.release_job(ns, "moved", finalizer=OURS, label=DONE, snapshot=snapshot) is True
    metadata = kube.get_job(ns, "moved")["metadata"]
    assert metadata["finalizers"] == ["a.example/one"]
    assert metadata["labels"][DONE[0]] == "true"


def test_release_never_touches_a_job_recreated_under_the_same_name(kube, ns):
    stale = kube.create_job(ns, job("again", finalizers=[OURS]))
    kube.release_job(ns, "again", finalizer=OURS)
    kube.delete_job(ns, "again")
    wait_until(lambda: not _exists(kube, ns, "again"), what="first job gone", timeout=10.0)
    assert kube.release_job(ns, "again", finalizer=OURS, label=DONE, snapshot=stale) is False  # the patch's 404
    fresh = kube.create_job(ns, job("again", finalizers=[OURS]))
    assert fresh["metadata"]["uid"] != stale["metadata"]["uid"]
    assert kube.release_job(ns, "again", finalizer=OURS, label=DONE, snapshot=stale) is False
    metadata = kube.get_job(ns, "again")["metadata"]
    assert metadata["finalizers"] == [OURS] and DONE[0] not in metadata["labels"]


def test_delete_jobs_removes_exactly_the_selected_jobs_and_their_pods(kube, ns):
    for name, labels in (("d1", {"suite": "kube", "done": "yes"}), ("d2", {"suite": "kube", "done": "yes"}),
                         ("keep", {"suite": "kube"})):  # fmt: skip
        kube.create_job(ns, job(name, labels=labels))
    wait_until(lambda: len(kube.list_pods(ns, label_selector="batch.kubernetes.io/job-name in (d1,d2)")) == 2,
               what="the pods of d1 and d2", timeout=10.0)  # fmt: skip
    assert len(kube.delete_jobs(ns, label_selector="suite=kube,done=yes")) == 2
    wait_until(lambda: not _exists(kube, ns, "d1") and not _exists(kube, ns, "d2"), what="jobs deleted", timeout=10.0)
    wait_until(lambda: kube.list_pods(ns, label_selector="batch.kubernetes.io/job-name in (d1,d2)") == [],
               what="their pods deleted (background propagation)", timeout=10.0)  # fmt: skip
    assert _exists(kube, ns, "keep")
    assert kube.delete_jobs(ns, label_selector="suite=kube,done=yes") == []


def test_delete_jobs_answers_with_a_job_a_finalizer_holds_and_its_finalizers(kube, ns):
    """The sweep reads the held Jobs from the bulk delete's answer instead of another LIST."""
    kube.create_job(ns, job("held", labels={"suite": "kube", "done": "yes"}, finalizers=[OURS]))
    kube.create_job(ns, job("free", labels={"suite": "kube", "done": "yes"}))
    answered = {
        j["metadata"]["name"]: j["metadata"].get("finalizers") or []
        for j in kube.delete_jobs(ns, label_selector="suite=kube,done=yes")
    }
    assert answered == {"held": [OURS], "free": []}
    assert _exists(kube, ns, "held")
    assert [j["metadata"]["name"] for j in kube.delete_jobs(ns, label_selector="suite=kube,done=yes")] == ["held"]
    kube.release_job(ns, "held", finalizer=OURS)
    wait_until(lambda: not _exists(kube, ns, "held"), what="the released job gone", timeout=10.0)


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        ({"uid": "u", "finalizers": ["a", OURS], "labels": {"x": "1"}}, [
            {"op": "test", "path": "/metadata/uid", "value": "u"},
            {"op": "test", "path": "/metadata/finalizers/1", "value": OURS},
            {"op": "remove", "path": "/metadata/finalizers/1"},
            {"op": "add", "path": "/metadata/labels/example.io~1done", "value": "true"},
        ]),
        ({"uid": "u", "finalizers": [OURS], "labels": {DONE[0]: "true"}}, [
            {"op": "test", "path": "/metadata/uid", "value": "u"},
            {"op": "test", "path": "/metadata/finalizers/0", "value": OURS},
            {"op": "remove", "path": "/metadata/finalizers/0"},
        ]),
        ({"uid": "u"}, [
            {"op": "test", "path": "/metadata/uid", "value": "u"},
            {"op": "add", "path": "/metadata/labels", "value": {DONE[0]: "true"}},
        ]),
        ({"uid": "u", "labels": {DONE[0]: "true"}}, []),  # nothing to change: no request
    ],
)  # fmt: skip
def test_release_patch(metadata, expected):
    assert release_patch(metadata, finalizer=OURS, label=DONE) == expected


def _exists(kube: KubeClient, ns: str, name: str) -> bool:
    try:
        kube.get_job(ns, name)
    except NotFound:
        return False
    return True


# --- unavailability ----------------------------------------------------------------------


@pytest.fixture
def faulty_cluster():
    with LocalCluster(mode="simulate") as c:
        yield c


def test_server_errors_are_api_unavailable(faulty_cluster, ns):
    with KubeClient(faulty_cluster.kubeconfig, timeout_s=5) as kube:
        kube.create_job(ns, job("f"))
        faulty_cluster.set_faults(1.0, 0)
        for call in (
            lambda: kube.get_job(ns, "f"),
            lambda: kube.create_job(ns, job("g")),
            lambda: kube.list_jobs_page(ns, label_selector="suite=kube"),
            lambda: list(kube.iter_jobs(ns, label_selector="suite=kube")),
            lambda: kube.list_pods(ns, label_selector="a=b"),
            lambda: kube.delete_job(ns, "f"),
            lambda: kube.remove_finalizer(ns, "f", OURS),
            lambda: kube.delete_jobs(ns, label_selector="suite=kube"),
        ):
            with pytest.raises(ApiUnavailable):
                call()
        faulty_cluster.set_faults(0.0, 0)
        assert kube.get_job(ns, "f")["metadata"]["name"] == "f"


def test_a_slow_api_times_out_as_api_unavailable(faulty_cluster, ns):
    with KubeClient(faulty_cluster.kubeconfig, timeout_s=0.3) as kube:
        faulty_cluster.set_faults(0.0, latency_ms=2000)
        try:
            for call in (lambda: kube.get_job(ns, "anything"), lambda: kube.create_job(ns, job("slow"))):
                started = time.monotonic()
                with pytest.raises(ApiUnavailable):
                    call()
                assert time.monotonic() - started < 1.9
        finally:
            faulty_cluster.set_faults(0.0, latency_ms=0)


def test_an_unreachable_api_is_api_unavailable(tmp_path, ns):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(_kubeconfig("http://127.0.0.1:1", token="x"))
    with KubeClient(kubeconfig, timeout_s=1) as kube, pytest.raises(ApiUnavailable):
        kube.get_job(ns, "x")


def test_a_wrong_token_is_rejected_as_unauthorized(cluster, tmp_path, ns):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(_kubeconfig(cluster.url, token="wrong-token"))
    with KubeClient(kubeconfig, timeout_s=5) as kube:
        for call in (
            lambda: kube.get_job(ns, "x"),
            lambda: kube.create_job(ns, job("x")),
            lambda: kube.release_job(ns, "x", finalizer=OURS, snapshot={"metadata": {"finalizers": [OURS]}}),
        ):
            with pytest.raises(ApiRejected) as raised:
                call()
            assert raised.value.reason == "Unauthorized"


EXEC_PLUGIN = """
import json, pathlib, sys
calls = pathlib.Path(sys.argv[1])
n = int(calls.read_text()) if calls.exists() else 0
calls.write_text(str(n + 1))
token = sys.argv[2] if n == 0 else sys.argv[3]  # a wrong token first, then the right one
print(json.dumps({"apiVersion": "client.authentication.k8s.io/v1beta1", "kind": "ExecCredential",
                  "status": {"token": token, "expirationTimestamp": "2000-01-01T00:00:00Z"}}))
"""


def test_an_expired_token_is_refreshed_by_the_configs_hook(cluster, tmp_path, ns):
    """A credential plugin's token is re-read when it expires (the config's refresh hook): the
    token loaded with the config is wrong and already expired, so only a refreshed one works."""
    plugin, calls = tmp_path / "plugin.py", tmp_path / "calls"
    plugin.write_text(EXEC_PLUGIN)
    config = yaml.safe_load(cluster.kubeconfig.read_text())
    right = config["users"][0]["user"]["token"]
    config["users"][0]["user"] = {"exec": {
        "apiVersion": "client.authentication.k8s.io/v1beta1", "command": sys.executable,
        "args": [str(plugin), str(calls), "wrong-token", right], "interactiveMode": "Never",
    }}  # fmt: skip
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(config))
    with KubeClient(kubeconfig, timeout_s=5) as kube:
        assert calls.read_text() == "1"  # loaded with the wrong token
        created = kube.create_job(ns, job("refreshed", finalizers=[OURS]))
        assert kube.release_job(ns, "refreshed", finalizer=OURS, snapshot=created) is True
        assert kube.get_job(ns, "refreshed")["metadata"].get("finalizers") in (None, [])
    assert int(calls.read_text()) >= 2  # the plugin ran again


def _kubeconfig(server: str, *, token: str) -> str:
    return f"""apiVersion: v1
kind: Config
clusters:
- name: c
  cluster: {{server: "{server}"}}
users:
- name: u
  user: {{token: "{token}"}}
contexts:
- name: x
  context: {{cluster: c, user: u}}
current-context: x
"""


def test_kubeconfig_path_may_be_a_string(cluster):
    with KubeClient(str(cluster.kubeconfig)) as kube:
        assert kube.host.startswith("http")
    assert isinstance(cluster.kubeconfig, Path)


# --- what on_request is told ---------------------------------------------------------------


def test_on_request_is_told_each_requests_verb_and_answer(cluster, faulty_cluster, ns):
    seen: list[tuple[str, str]] = []
    with KubeClient(cluster.kubeconfig, timeout_s=5, on_request=lambda verb, code: seen.append((verb, code))) as kube:
        kube.create_job(ns, job("o", labels={"suite": "observed"}, finalizers=[OURS]))
        with pytest.raises(AlreadyExists):
            kube.create_job(ns, job("o"))
        kube.get_job(ns, "o")
        with pytest.raises(NotFound):
            kube.get_job(ns, "missing")
        list(kube.iter_jobs(ns, label_selector="suite=observed"))
        kube.list_pods(ns, label_selector="suite=observed")
        kube.remove_finalizer(ns, "o", OURS)
        kube.delete_jobs(ns, label_selector="suite=observed")
    assert seen[:5] == [("create", "201"), ("create", "409"), ("get", "200"), ("get", "404"), ("list", "200")]
    assert ("patch", "200") in seen and seen[-1] == ("deletecollection", "200")
    assert {verb for verb, _ in seen} == {"create", "get", "list", "patch", "deletecollection"}

    unanswered: list[tuple[str, str]] = []
    with KubeClient(faulty_cluster.kubeconfig, timeout_s=5, on_request=lambda v, c: unanswered.append((v, c))) as kube:
        faulty_cluster.set_faults(1.0, 0)
        try:
            with pytest.raises(ApiUnavailable):
                kube.get_job(ns, "o")
            with pytest.raises(ApiUnavailable):
                kube.create_job(ns, job("p"))
        finally:
            faulty_cluster.set_faults(0.0, 0)
    assert all(code in ("500", "503", "429") for _, code in unanswered), unanswered  # the faults it injects
    # Each attempt is a request: a 429 (Retry-After: 1) is waited out and sent again, up to
    # RETRY_AFTER_ATTEMPTS times; the call ends at its first other answer, or at the last 429.
    calls = [[code for verb, code in unanswered if verb == v] for v in ("get", "create")]
    assert [verb for verb, _ in unanswered] == ["get"] * len(calls[0]) + ["create"] * len(calls[1])
    for codes in calls:
        assert codes[:-1] == ["429"] * (len(codes) - 1)
        assert codes[-1] != "429" or len(codes) == kube_module.RETRY_AFTER_ATTEMPTS + 1, codes


def test_on_request_is_told_of_a_request_no_server_answered(tmp_path, ns):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(_kubeconfig("http://127.0.0.1:1", token="x"))
    seen: list[tuple[str, str]] = []
    with KubeClient(kubeconfig, timeout_s=2, on_request=lambda verb, code: seen.append((verb, code))) as kube:
        with pytest.raises(ApiUnavailable):
            kube.list_jobs_page(ns, label_selector="a=b")
        with pytest.raises(ApiUnavailable):
            kube.create_job(ns, job("u"))
    assert seen == [("list", "error"), ("create", "error")]
