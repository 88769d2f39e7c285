"""Pure parts: the Job controller's decisions (jobsync.plan_job), the three patch formats, the
Table printer's durations, paths, the simulate runner's plan from annotations, and the store's
ordered keys and counts."""

from __future__ import annotations

import uuid

import pytest

from k8s_dispatch.demo.localcluster import paths, simrunner
from k8s_dispatch.demo.localcluster.jobsync import TRACKING_FINALIZER, PodView, plan_job
from k8s_dispatch.demo.localcluster.patching import PatchError, json_patch, merge_patch, strategic_merge_patch
from k8s_dispatch.demo.localcluster.registry import new_uid
from k8s_dispatch.demo.localcluster.resources import JOBS, NAMESPACES, PODS
from k8s_dispatch.demo.localcluster.store import Store
from k8s_dispatch.demo.localcluster.tables import human_duration
from k8s_dispatch.demo.localcluster.timestamps import rfc3339

NOW = 1_700_000_000.0


def _job(**spec: object) -> dict:
    return {
        "metadata": {"name": "j", "namespace": "d", "uid": "u"},
        "spec": {
            "completions": 1,
            "parallelism": 1,
            "backoffLimit": 6,
            "template": {"spec": {"restartPolicy": "Never"}},
            **spec,
        },
        "status": {},
    }


def _pod(name: str, phase: str, *, tracked: bool = True, deleting: bool = False, ready: bool = False) -> PodView:
    return PodView("d", name, f"uid-{name}", phase, deleting, tracked, ready, 0, rfc3339(NOW))


def test_a_new_job_starts_and_asks_for_one_pod() -> None:
    plan = plan_job(_job(), [], NOW)
    assert plan.create == 1 and plan.started and plan.status["startTime"] == rfc3339(NOW)
    assert plan.status["active"] == 1 and plan.status["ready"] == 0 and plan.status["terminating"] == 0


def test_a_succeeded_pod_is_counted_and_completes_the_job() -> None:
    plan = plan_job(_job(), [_pod("a", "Succeeded")], NOW, start_at=NOW - 5)
    assert [p.name for p in plan.count] == ["a"] and plan.create == 0 and plan.finished
    assert [c["type"] for c in plan.status["conditions"]] == ["SuccessCriteriaMet", "Complete"]
    assert plan.status["succeeded"] == 1 and plan.status["completionTime"] == rfc3339(NOW)


def test_an_already_counted_pod_is_not_counted_twice() -> None:
    job = _job()
    job["status"] = {"failed": 1, "startTime": rfc3339(NOW - 1)}
    plan = plan_job(job, [_pod("a", "Failed", tracked=False)], NOW, last_failure_at=NOW - 100)
    assert plan.count == [] and plan.status["failed"] == 1 and plan.create == 1


def test_failures_beyond_the_backoff_limit_fail_the_job_after_pods_stop() -> None:
    job = _job(backoffLimit=1, parallelism=2, completions=3)
    job["status"] = {"failed": 1, "startTime": rfc3339(NOW - 1)}
    plan = plan_job(job, [_pod("a", "Failed"), _pod("b", "Running")], NOW)
    assert [c["type"] for c in plan.status["conditions"]] == ["FailureTarget"]
    assert [p.name for p in plan.delete] == ["b"] and not plan.finished
    job["status"] = plan.status
    plan = plan_job(job, [_pod("b", "Failed")], NOW + 1)
    types = [(c["type"], c["reason"]) for c in plan.status["conditions"]]
    assert types == [("FailureTarget", "BackoffLimitExceeded"), ("Failed", "BackoffLimitExceeded")]
    assert plan.status["failed"] == 3 and "completionTime" not in plan.status


def test_a_recent_failure_delays_the_replacement_pod() -> None:
    job = _job()
    job["status"] = {"startTime": rfc3339(NOW - 1)}
    plan = plan_job(job, [_pod("a", "Failed")], NOW, backoff_base=2.0)
    assert plan.create == 0 and plan.requeue_at == NOW + 2.0 and plan.new_failures == 1
    job["status"] = plan.status
    later = plan_job(job, [_pod("a", "Failed", tracked=False)], NOW + 2.5, last_failure_at=NOW, backoff_base=2.0)
    assert later.create == 1


def test_the_deadline_is_scheduled_then_enforced() -> None:
    job = _job(activeDeadlineSeconds=10)
    plan = plan_job(job, [], NOW)
    assert plan.requeue_at == NOW + 10
    job["status"] = plan.status
    plan = plan_job(job, [_pod("a", "Running")], NOW + 10, start_at=NOW)
    assert plan.status["conditions"][0]["reason"] == "DeadlineExceeded" and [p.name for p in plan.delete] == ["a"]


def test_ttl_after_finished() -> None:
    job = _job(ttlSecondsAfterFinished=30)
    job["status"] = {
        "conditions": [{"type": "Complete", "status": "True", "lastTransitionTime": rfc3339(NOW)}],
        "completionTime": rfc3339(NOW),
    }
    assert plan_job(job, [], NOW + 10).requeue_at == NOW + 30
    assert plan_job(job, [], NOW + 30).delete_job


def test_suspend_deletes_active_pods_and_resume_restarts_the_clock() -> None:
    plan = plan_job(_job(suspend=True), [_pod("a", "Running")], NOW)
    # deleted uncounted (tracking finalizer off first), as deleteJobPods does: a suspend is no failure
    assert [p.name for p in plan.uncount] == ["a"] and plan.delete == []
    assert plan.status["conditions"][0]["reason"] == "JobSuspended"
    job = _job(suspend=False)
    job["status"] = plan.status
    plan = plan_job(job, [], NOW + 5)
    assert plan.status["conditions"][0]["reason"] == "JobResumed" and plan.status["startTime"] == rfc3339(NOW + 5)
    assert plan.create == 1


def test_terminating_pods_are_replaced_and_reported() -> None:
    plan = plan_job(_job(), [_pod("a", "Running", deleting=True)], NOW, start_at=NOW)
    assert plan.create == 1 and plan.status["terminating"] == 1


# --- patches --------------------------------------------------------------------------------


def test_merge_patch_rfc7386() -> None:
    assert merge_patch({"a": {"b": 1, "c": 2}, "l": [1]}, {"a": {"b": None, "d": 3}, "l": [2]}) == {
        "a": {"c": 2, "d": 3},
        "l": [2],
    }


def test_strategic_merge_patch_directives() -> None:
    pod = {
        "metadata": {"finalizers": ["a"], "labels": {"x": "1"}},
        "spec": {"containers": [{"name": "c1", "image": "i1"}, {"name": "c2", "image": "i2"}]},
    }
    out = strategic_merge_patch(
        pod,
        {
            "metadata": {"finalizers": ["b", "a"]},
            "spec": {"containers": [{"name": "c2", "$patch": "delete"}, {"name": "c3", "image": "i3"}]},
        },
        "Pod",
    )
    # kube-apiserver's order: the patch's own order, and an item new to the server before the server's next
    assert out["metadata"]["finalizers"] == ["b", "a"]
    assert [c["name"] for c in out["spec"]["containers"]] == ["c3", "c1"]
    env = {"spec": {"containers": [{"name": "c", "env": [{"name": "A", "value": "1"}, {"name": "C", "value": "3"}]}]}}
    out = strategic_merge_patch(
        env,
        {"spec": {"containers": [{"name": "c", "env": [{"name": "B", "value": "2"}, {"name": "C", "value": "33"}]}]}},
        "Pod",
    )
    assert out["spec"]["containers"][0]["env"] == [
        {"name": "B", "value": "2"},
        {"name": "A", "value": "1"},
        {"name": "C", "value": "33"},
    ]  # as seen on kube-apiserver 1.36
    out = strategic_merge_patch(pod, {"metadata": {"labels": {"$patch": "replace", "y": "2"}}}, "Pod")
    assert out["metadata"]["labels"] == {"y": "2"}
    assert pod["metadata"]["labels"] == {"x": "1"}  # inputs untouched
    with pytest.raises(PatchError):
        strategic_merge_patch(pod, {"spec": {"containers": [{"image": "no-name"}]}}, "Pod")


def test_json_patch_operations() -> None:
    doc = {"a": [1, 2], "b": {"c": 1}}
    out = json_patch(
        doc,
        [
            {"op": "add", "path": "/a/-", "value": 3},
            {"op": "move", "from": "/b/c", "path": "/d"},
            {"op": "copy", "from": "/d", "path": "/e"},
            {"op": "replace", "path": "/a/0", "value": 0},
            {"op": "test", "path": "/e", "value": 1},
        ],
    )
    assert out == {"a": [0, 2, 3], "b": {}, "d": 1, "e": 1} and doc == {"a": [1, 2], "b": {"c": 1}}
    for bad in (
        [{"op": "remove", "path": "/zz"}],
        [{"op": "test", "path": "/a/0", "value": 9}],
        [{"op": "nope", "path": "/a"}],
        {"op": "add"},
    ):
        with pytest.raises(PatchError):
            json_patch(doc, bad)


# --- misc -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (59, "59s"),
        (119, "119s"),
        (150, "2m30s"),
        (600, "10m"),
        (3 * 3600 + 60, "3h1m"),
        (10 * 3600, "10h"),
        (3 * 86400, "3d"),
        (-5, "<invalid>"),
    ],
)
def test_human_durations_match_kubectl(seconds: float, text: str) -> None:
    assert human_duration(seconds) == text


def test_paths() -> None:
    t = paths.parse("/apis/batch/v1/namespaces/ns/jobs/j/status")
    assert (t.resource, t.namespace, t.name, t.subresource, t.watch_path) == (JOBS, "ns", "j", "status", False)
    t = paths.parse("/api/v1/watch/namespaces/ns/pods")
    assert (t.resource, t.namespace, t.name, t.watch_path) == (PODS, "ns", None, True)
    t = paths.parse("/api/v1/namespaces/ns")
    assert (t.resource, t.name) == (NAMESPACES, "ns")
    assert paths.parse("/api/v1/pods/x") is None and paths.parse("/apis/apps/v1/deployments") is None
    assert paths.parse("/api/v1/namespaces/ns/pods/p/exec") is None


def test_simulate_plan_from_annotations() -> None:
    pod = {
        "metadata": {"annotations": {simrunner.OUTCOME: "fail", simrunner.DURATION: "250"}},
        "spec": {"containers": [{"env": [{"name": "K8S_DISPATCH_INPUT", "value": "[1, 2]"}]}]},
    }
    p = simrunner.plan(pod)
    assert (p.outcome, p.exit_code, p.duration, p.message) == ("fail", 1, 0.25, '{"simulated":true,"input":[1,2]}')
    assert simrunner.plan({"metadata": {}, "spec": {}}).message == '{"simulated":true,"input":null}'
    assert TRACKING_FINALIZER == "batch.kubernetes.io/job-tracking"


def test_uids_are_random_version_4_uuids_in_canonical_text() -> None:
    uids = [new_uid() for _ in range(2000)]
    assert len(set(uids)) == len(uids)
    for text in uids:
        parsed = uuid.UUID(text)
        assert (parsed.version, parsed.variant, str(parsed)) == (4, uuid.RFC_4122, text)


def test_the_store_lists_a_namespace_in_name_order_and_counts_it_through_writes() -> None:
    store = Store()
    # Namespaces that share a prefix, or sort next to it, must not leak into its range.
    for namespace, name in [("ns", "b"), ("ns-a", "a"), ("n", "z"), ("ns", "a"), ("nt", "a"), ("ns", "c")]:
        store.insert(JOBS, {"metadata": {"namespace": namespace, "name": name}})
    assert [e.name for e in store.list(JOBS, "ns")] == ["a", "b", "c"]
    assert [(e.namespace, e.name) for e in store.list(JOBS)] == [
        ("n", "z"), ("ns", "a"), ("ns", "b"), ("ns", "c"), ("ns-a", "a"), ("nt", "a"),
    ]  # fmt: skip
    store.remove(store.get(JOBS, "ns", "b"))
    store.insert(JOBS, {"metadata": {"namespace": "ns", "name": "aa"}})
    assert [e.name for e in store.list(JOBS, "ns")] == ["a", "aa", "c"]
    counts = [store.count(JOBS, namespace) for namespace in ("ns", "ns-a", "gone")]
    assert (counts, store.count(JOBS)) == ([3, 1, 0], 6)
