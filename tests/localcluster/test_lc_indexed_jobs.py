"""Indexed Jobs as the Job controller of Kubernetes 1.36 runs them, on localcluster and on the real
control plane (the `sim` fixture runs each test on both): Pods named and labelled with their
completion index (env JOB_COMPLETION_INDEX, hostname), `completedIndexes`/`failedIndexes`
intervals, per-index backoff, `maxFailedIndexes`, podFailurePolicy FailIndex, successPolicy,
`uncountedTerminatedPods` around the tracking finalizer, our own Pod finalizer holding finished
Pods, and the API server's validation of the fields.

Outcomes per index come from the simulate runner's `by-index` annotation (demo/localcluster/
simrunner.py). A retried index costs 10 s on the real control plane (its first per-index backoff)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from conftest import Api, condition_types, job_manifest, raw_request, wait_for
from hypothesis import given
from hypothesis import strategies as st
from kubernetes.client import ApiException

from k8s_dispatch.demo.localcluster import indexes

SIM = "localcluster.k8s-dispatch.io/"
INDEX = "batch.kubernetes.io/job-completion-index"
FAILURES = "batch.kubernetes.io/job-index-failure-count"
TRACKING = "batch.kubernetes.io/job-tracking"
OURS = "k8s-dispatch.io/result-protection"
QUICK = {SIM + "duration-ms": "20"}


def indexed(name: str, completions: int, parallelism: int, *, by_index: dict[int, dict[str, Any]] | None = None,
            annotations: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:  # fmt: skip
    ann = {**QUICK, **(annotations or {})}
    if by_index:
        ann[SIM + "by-index"] = json.dumps({str(k): v for k, v in by_index.items()})
    return job_manifest(
        name, annotations=ann, completionMode="Indexed", completions=completions, parallelism=parallelism, **spec
    )


def job_json(sim: Api, name: str) -> dict[str, Any]:
    code, _, body = raw_request(sim.cluster, "GET", f"/apis/batch/v1/namespaces/{sim.namespace}/jobs/{name}")
    assert code == 200, body
    obj: dict[str, Any] = json.loads(body)
    return obj


def job_history(sim: Api, name: str, since: str) -> list[dict[str, Any]]:
    """Every status the Job had after resourceVersion `since`, in order (a watch read to its end)."""
    path = (
        f"/apis/batch/v1/namespaces/{sim.namespace}/jobs?watch=true&resourceVersion={since}"
        f"&fieldSelector=metadata.name%3D{name}&timeoutSeconds=1"
    )
    code, _, body = raw_request(sim.cluster, "GET", path)
    assert code == 200
    return [e["object"].get("status") or {} for e in map(json.loads, body.splitlines())]


def pod_events(sim: Api, name: str, since: str) -> list[tuple[str, dict[str, Any]]]:
    """Every change to the Job's Pods after resourceVersion `since`, in order."""
    path = (
        f"/api/v1/namespaces/{sim.namespace}/pods?watch=true&resourceVersion={since}"
        f"&labelSelector=batch.kubernetes.io/job-name%3D{name}&timeoutSeconds=1"
    )
    code, _, body = raw_request(sim.cluster, "GET", path)
    assert code == 200
    return [(e["type"], e["object"]) for e in map(json.loads, body.splitlines())]


def by_index(pods: list[Any]) -> dict[int, list[Any]]:
    out: dict[int, list[Any]] = {}
    for p in pods:
        out.setdefault(int(p.metadata.annotations[INDEX]), []).append(p)
    return out


def reasons(job: Any) -> list[tuple[str, str, str]]:
    return [(c.type, c.reason, c.message) for c in job.status.conditions if c.status == "True"]


def counted(sim: Api, name: str, n: int) -> list[Any]:
    """The Job's `n` Pods once none carries the tracking finalizer any more."""
    return wait_for(
        lambda: (lambda ps: ps if len(ps) == n and all(TRACKING not in (p.metadata.finalizers or []) for p in ps)
                 else None)(sim.pods_of(name)),
        what=f"{n} pods of {name} counted",
    )  # fmt: skip


# --- pods and status -------------------------------------------------------------------------


def test_each_index_runs_once_in_a_pod_named_labelled_and_given_its_index(sim: Api) -> None:
    rv = sim.batch.list_namespaced_job(sim.namespace).metadata.resource_version
    sim.create_job(indexed("idx", 5, 2, annotations={SIM + "duration-ms": "300"}))
    job = sim.wait_job("idx", "Complete", timeout=20)
    assert reasons(job) == [
        ("SuccessCriteriaMet", "CompletionsReached", "Reached expected number of succeeded pods"),
        ("Complete", "CompletionsReached", "Reached expected number of succeeded pods"),
    ]
    status = job_json(sim, "idx")["status"]
    assert status["completedIndexes"] == "0-4" and status["succeeded"] == 5 and "failed" not in status
    assert "failedIndexes" not in status and status["uncountedTerminatedPods"] == {}
    assert status["ready"] == 0 and status["terminating"] == 0 and "active" not in status
    pods = counted(sim, "idx", 5)
    for index, group in sorted(by_index(pods).items()):
        (pod,) = group  # a succeeded index never runs again
        assert re.fullmatch(rf"idx-{index}-[a-z0-9]{{5}}", pod.metadata.name)
        assert pod.metadata.labels[INDEX] == str(index) and pod.spec.hostname == f"idx-{index}"
        assert FAILURES not in pod.metadata.annotations  # only with backoffLimitPerIndex
        env = {e.name: e for e in pod.spec.containers[0].env}
        assert env["JOB_COMPLETION_INDEX"].value_from.field_ref.field_path == f"metadata.labels['{INDEX}']"
        assert pod.status.phase == "Succeeded"
    assert sorted(by_index(pods)) == [0, 1, 2, 3, 4]
    history = job_history(sim, "idx", rv)
    assert max(s.get("active", 0) for s in history) == 2  # never more than parallelism
    done = [s.get("completedIndexes", "") for s in history]
    assert done == sorted(done, key=len) and done[-1] == "0-4"  # intervals only grow
    assert all(not (s.get("uncountedTerminatedPods") or {}).get("succeeded") for s in history)


def test_two_neighbouring_indexes_are_written_as_a_pair(sim: Api) -> None:
    sim.create_job(indexed("pair", 4, 4, successPolicy={"rules": [{"succeededIndexes": "1,2"}]},
                           by_index={0: {"outcome": "hang"}, 3: {"outcome": "hang"}}))  # fmt: skip
    job = sim.wait_job("pair", "Complete", timeout=20)
    assert job.status.completed_indexes == "1,2" and job.status.succeeded == 2


def test_a_failed_index_is_retried_with_its_failure_count_until_it_succeeds(sim: Api) -> None:
    rv = sim.batch.list_namespaced_job(sim.namespace).metadata.resource_version
    sim.create_job(indexed("retry", 3, 3, backoffLimitPerIndex=1, by_index={1: {"outcome": "fail", "attempts": 1}}))
    job = sim.wait_job("retry", timeout=40 if sim.cluster.is_real else 10)
    assert condition_types(job) == ["SuccessCriteriaMet", "Complete"]
    status = job_json(sim, "retry")["status"]
    assert status["completedIndexes"] == "0-2" and status["failedIndexes"] == "" and status["failed"] == 1
    assert job_json(sim, "retry")["spec"]["backoffLimit"] == 2**31 - 1  # the default with backoffLimitPerIndex
    groups = by_index(counted(sim, "retry", 4))
    assert sorted(len(g) for g in groups.values()) == [1, 1, 2]
    attempts = sorted(groups[1], key=lambda p: p.metadata.annotations[FAILURES])
    assert [(p.metadata.annotations[FAILURES], p.status.phase) for p in attempts] == [
        ("0", "Failed"),
        ("1", "Succeeded"),
    ]
    assert {p.metadata.annotations[FAILURES] for p in groups[0] + groups[2]} == {"0"}
    # The failed Pod keeps its tracking finalizer (it is not counted) until its replacement exists:
    # the count it carries goes on in the replacement's annotation.
    events = pod_events(sim, "retry", rv)
    first, second = (p.metadata.uid for p in attempts)
    added = next(i for i, (t, o) in enumerate(events) if t == "ADDED" and o["metadata"]["uid"] == second)
    released = next(i for i, (_, o) in enumerate(events)
                    if o["metadata"]["uid"] == first and TRACKING not in (o["metadata"].get("finalizers") or []))  # fmt: skip
    assert added < released


def test_a_failure_an_ignore_rule_matches_is_retried_without_counting(sim: Api) -> None:
    policy = {"rules": [{"action": "Ignore", "onExitCodes": {"operator": "In", "values": [5]}}]}
    sim.create_job(indexed("ign", 2, 2, backoffLimitPerIndex=0, podFailurePolicy=policy,
                           by_index={1: {"outcome": "fail", "exit-code": "5", "attempts": 1}}))  # fmt: skip
    job = sim.wait_job("ign", timeout=40 if sim.cluster.is_real else 10)
    assert condition_types(job) == ["SuccessCriteriaMet", "Complete"]
    status = job_json(sim, "ign")["status"]
    assert (status["completedIndexes"], status["failedIndexes"], "failed" in status) == ("0,1", "", False)
    retried = sorted(by_index(counted(sim, "ign", 3))[1], key=lambda p: p.status.phase)
    assert [(p.status.phase, p.metadata.annotations[FAILURES], p.metadata.annotations.get(FAILURES.replace("failure", "ignored-failure")))
            for p in retried] == [("Failed", "0", None), ("Succeeded", "0", "1")]  # fmt: skip


def test_an_indexed_job_scaled_down_stops_the_indexes_past_its_completions(sim: Api) -> None:
    sim.create_job(indexed("elastic", 4, 4, by_index={2: {"outcome": "hang"}, 3: {"outcome": "hang"}}))
    wait_for(lambda: sim.job("elastic").status.completed_indexes == "0,1", what="indexes 0 and 1 done")
    sim.batch.patch_namespaced_job("elastic", sim.namespace, {"spec": {"completions": 2, "parallelism": 2}})
    job = sim.wait_job("elastic", timeout=20)
    assert reasons(job)[-1] == ("Complete", "CompletionsReached", "Reached expected number of succeeded pods")
    status = job_json(sim, "elastic")["status"]
    assert (status["completedIndexes"], status["succeeded"], "failed" in status) == ("0,1", 2, False)
    wait_for(lambda: sorted(by_index(sim.pods_of("elastic"))) == [0, 1], what="indexes 2 and 3 stopped and gone")


def test_indexes_that_fail_past_their_backoff_fail_the_job_once_all_are_done(sim: Api) -> None:
    rv = sim.batch.list_namespaced_job(sim.namespace).metadata.resource_version
    sim.create_job(indexed("fails", 4, 4, backoffLimitPerIndex=0,
                           by_index={1: {"outcome": "fail"}, 3: {"outcome": "fail", "duration-ms": "300"}}))  # fmt: skip
    job = sim.wait_job("fails", timeout=20)
    assert reasons(job) == [("FailureTarget", "FailedIndexes", "Job has failed indexes"),
                            ("Failed", "FailedIndexes", "Job has failed indexes")]  # fmt: skip
    status = job_json(sim, "fails")["status"]
    assert (status["completedIndexes"], status["failedIndexes"], status["succeeded"], status["failed"]) == (
        "0,2", "1,3", 2, 2,
    )  # fmt: skip
    assert status["uncountedTerminatedPods"] == {} and "completionTime" not in status
    pods = counted(sim, "fails", 4)
    failed_uids = {p.metadata.uid for p in pods if p.status.phase == "Failed"}
    # Each failed Pod's uid is written to uncountedTerminatedPods before its tracking finalizer
    # comes off, and moves into `failed` after: never both, never neither.
    history = job_history(sim, "fails", rv)
    seen: set[str] = set()
    for s in history:
        uncounted = set((s.get("uncountedTerminatedPods") or {}).get("failed") or [])
        seen |= uncounted
        assert s.get("failed", 0) + len(uncounted) <= 2
    assert seen == failed_uids


def test_more_failed_indexes_than_allowed_fail_the_job_at_once_and_stop_its_pods(sim: Api) -> None:
    sim.create_job(indexed("maxf", 6, 2, backoffLimitPerIndex=0, maxFailedIndexes=0,
                           by_index={0: {"outcome": "fail"}, 1: {"outcome": "hang"}}))  # fmt: skip
    job = sim.wait_job("maxf", "Failed", timeout=20)
    msg = "Job has exceeded the specified maximal number of failed indexes"
    assert reasons(job) == [
        ("FailureTarget", "MaxFailedIndexesExceeded", msg),
        ("Failed", "MaxFailedIndexesExceeded", msg),
    ]
    status = job_json(sim, "maxf")["status"]
    assert status["failedIndexes"] == "0" and "completedIndexes" not in status
    # index 1's running Pod is stopped and counted as failed; the indexes after it never start
    assert status["failed"] == 2 and not status.get("active") and status["terminating"] == 0
    wait_for(lambda: sorted(by_index(sim.pods_of("maxf"))) == [0], what="index 1's stopped pod gone")


def test_a_fail_index_rule_fails_the_index_without_retrying_it(sim: Api) -> None:
    policy = {"rules": [{"action": "FailIndex", "onExitCodes": {"operator": "In", "values": [42]}}]}
    sim.create_job(indexed("failix", 3, 3, backoffLimitPerIndex=3, podFailurePolicy=policy,
                           by_index={2: {"outcome": "fail", "exit-code": "42"}}))  # fmt: skip
    job = sim.wait_job("failix", timeout=20)
    assert condition_types(job) == ["FailureTarget", "Failed"] and job.status.conditions[-1].reason == "FailedIndexes"
    status = job_json(sim, "failix")["status"]
    assert (status["completedIndexes"], status["failedIndexes"], status["failed"]) == ("0,1", "2", 1)
    assert len(by_index(sim.pods_of("failix"))[2]) == 1


def test_a_long_job_name_is_cut_to_fit_the_index_in_its_pods_names(sim: Api) -> None:
    name = "j" * 60
    sim.create_job(indexed(name, 2, 2))
    sim.wait_job(name, "Complete", timeout=20)
    names = sorted(p.metadata.name for p in sim.pods_of(name))
    assert [n[:-5] for n in names] == ["j" * 55 + "-0-", "j" * 55 + "-1-"]
    assert sorted(p.spec.hostname for p in sim.pods_of(name)) == [f"{name}-0", f"{name}-1"]


def test_a_suspended_indexed_job_stops_its_pods_uncounted_and_reruns_those_indexes(sim: Api) -> None:
    sim.create_job(indexed("pause", 3, 3, by_index={2: {"duration-ms": "4000"}}))
    wait_for(lambda: sim.job("pause").status.completed_indexes == "0,1", what="indexes 0 and 1 done")
    sim.batch.patch_namespaced_job("pause", sim.namespace, {"spec": {"suspend": True}})
    wait_for(lambda: "Suspended" in condition_types(sim.job("pause")), what="suspended")
    wait_for(lambda: [p.status.phase for p in by_index(sim.pods_of("pause")).get(2, [])] in ([], ["Failed"]),
             what="index 2 stopped")  # fmt: skip
    sim.batch.patch_namespaced_job("pause", sim.namespace, {"spec": {"suspend": False}})
    job = sim.wait_job("pause", timeout=20)
    assert condition_types(job) == ["SuccessCriteriaMet", "Complete"]
    status = job_json(sim, "pause")["status"]
    assert (status["completedIndexes"], status["succeeded"], "failed" in status) == ("0-2", 3, False)
    assert [p.status.phase for p in by_index(sim.pods_of("pause"))[2]][-1:] == ["Succeeded"]


def test_the_global_backoff_limit_fails_an_indexed_job_and_its_running_pods_count_as_failed(sim: Api) -> None:
    sim.create_job(indexed("global", 3, 3, backoffLimit=0, by_index={0: {"outcome": "fail"}, 2: {"outcome": "hang"}}))
    job = sim.wait_job("global", timeout=20)
    assert reasons(job)[-1] == ("Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit")
    status = job_json(sim, "global")["status"]
    assert "failedIndexes" not in status and status["failed"] == 2  # index 0, and index 2 stopped
    assert status.get("completedIndexes", "") in ("", "1")  # index 1 may or may not have finished first


def test_an_active_deadline_fails_an_indexed_job(sim: Api) -> None:
    sim.create_job(indexed("late", 2, 2, activeDeadlineSeconds=1, by_index={1: {"outcome": "hang"}}))
    job = sim.wait_job("late", timeout=20)
    assert reasons(job)[-1] == ("Failed", "DeadlineExceeded", "Job was active longer than specified deadline")
    status = job_json(sim, "late")["status"]
    # index 1 never ends and counts as failed; index 0 (20 ms) has succeeded unless the machine is slow
    done = status.get("completedIndexes", "")
    assert done in ("0", "") and status["failed"] == (1 if done else 2)


# --- successPolicy ---------------------------------------------------------------------------


def test_a_success_policy_on_indexes_ends_the_job_and_stops_the_rest(sim: Api) -> None:
    manifest = indexed("lead", 4, 4, successPolicy={"rules": [{"succeededIndexes": "0"}]},
                       by_index={i: {"outcome": "hang"} for i in (1, 2, 3)})  # fmt: skip
    sim.create_job(manifest)
    job = sim.wait_job("lead", "Complete", timeout=20)
    assert reasons(job) == [("SuccessCriteriaMet", "SuccessPolicy", "Matched rules at index 0"),
                            ("Complete", "SuccessPolicy", "Matched rules at index 0")]  # fmt: skip
    status = job_json(sim, "lead")["status"]
    assert status["completedIndexes"] == "0" and status["succeeded"] == 1 and status["completionTime"]
    # The Pods it stops lose their tracking finalizer with SuccessCriteriaMet: never counted as failed.
    assert "failed" not in status and status["terminating"] == 0
    wait_for(lambda: sorted(by_index(sim.pods_of("lead"))) == [0], what="the stopped pods gone")  # nothing holds them


def test_a_success_policy_on_a_count_and_our_finalizer_holds_every_finished_pod(sim: Api) -> None:
    manifest = indexed("count", 4, 4, successPolicy={"rules": [{"succeededIndexes": "0-3", "succeededCount": 2}]},
                       by_index={2: {"outcome": "hang"}, 3: {"outcome": "hang"}})  # fmt: skip
    manifest["spec"]["template"]["metadata"]["finalizers"] = [OURS]
    sim.create_job(manifest)
    job = sim.wait_job("count", "Complete", timeout=20)
    assert job.status.conditions[0].message == "Matched rules at index 0"
    assert job.status.completed_indexes == "0,1" and not job.status.failed
    pods = counted(sim, "count", 4)  # the two stopped Pods stay, held by our finalizer
    assert all(p.metadata.finalizers == [OURS] for p in pods)
    phases = {int(p.metadata.annotations[INDEX]): p.status.phase for p in pods}
    assert phases == {0: "Succeeded", 1: "Succeeded", 2: "Failed", 3: "Failed"}
    for p in pods:
        sim.core.patch_namespaced_pod(
            p.metadata.name, sim.namespace, [{"op": "remove", "path": "/metadata/finalizers/0"}]
        )
    wait_for(lambda: len(sim.pods_of("count")) == 2, what="the released stopped pods gone")
    sim.batch.delete_namespaced_job("count", sim.namespace, propagation_policy="Background")
    wait_for(lambda: not sim.pods_of("count"), what="the rest gone with their job")


# --- validation ------------------------------------------------------------------------------


def _causes(sim: Api, manifest: dict[str, Any]) -> list[tuple[str, str, str]]:
    with pytest.raises(ApiException) as caught:
        sim.create_job(manifest)
    assert caught.value.status == 422
    body = json.loads(caught.value.body)
    return sorted((c["field"], c["reason"], c["message"]) for c in body["details"]["causes"])


def test_the_api_server_refuses_bad_indexed_job_specs(sim: Api) -> None:
    def bad(**spec: Any) -> dict[str, Any]:
        return job_manifest("bad", **spec)

    ix = {"completionMode": "Indexed", "completions": 3, "parallelism": 3}
    assert _causes(sim, bad(backoffLimitPerIndex=1)) == [
        ("spec.backoffLimitPerIndex", "FieldValueInvalid", "Invalid value: 1: requires indexed completion mode")
    ]
    assert _causes(sim, bad(**ix, maxFailedIndexes=1)) == [
        ("spec.backoffLimitPerIndex", "FieldValueRequired", "Required value: when maxFailedIndexes is specified")
    ]
    assert _causes(sim, bad(**ix, backoffLimitPerIndex=-1, maxFailedIndexes=4)) == [
        ("spec.backoffLimitPerIndex", "FieldValueInvalid", "Invalid value: -1: must be greater than or equal to 0"),
        ("spec.maxFailedIndexes", "FieldValueInvalid", "Invalid value: 4: must be less than or equal to completions"),
    ]
    assert _causes(sim, bad(completionMode="Indexed", parallelism=2)) == [
        ("spec.completions", "FieldValueRequired", "Required value: when completion mode is Indexed")
    ]
    assert _causes(sim, bad(**ix, successPolicy={"rules": []})) == [
        (
            "spec.successPolicy.rules",
            "FieldValueRequired",
            "Required value: at least one rules must be specified when the successPolicy is specified",
        )
    ]
    assert _causes(sim, bad(**ix, successPolicy={"rules": [{}]})) == [
        (
            "spec.successPolicy.rules[0]",
            "FieldValueRequired",
            "Required value: at least one of succeededCount or succeededIndexes must be specified",
        )
    ]
    for text, why in (
        ("2-1", "non-increasing order, previous: 2, current: 1"),
        ("1,0", "non-increasing order, previous: 1, current: 0"),
        ("0-5", 'too large index: "5"'),
        ("x", 'cannot convert string to integer for index: "x"'),
        (
            "0-1-2",
            'the fragment "0-1-2" violates the requirement that an index interval can have at most two '
            "parts separated by '-'",
        ),
    ):
        assert _causes(sim, bad(**ix, successPolicy={"rules": [{"succeededIndexes": text}]})) == [
            (
                "spec.successPolicy.rules[0].succeededIndexes",
                "FieldValueInvalid",
                f"Invalid value: {json.dumps(text)}: error parsing succeededIndexes: {why}",
            )
        ]
    assert _causes(sim, bad(**ix, successPolicy={"rules": [{"succeededIndexes": "0,1", "succeededCount": 3}]})) == [
        (
            "spec.successPolicy.rules[0].succeededCount",
            "FieldValueInvalid",
            "Invalid value: 3: must be less than or equal to 2 (the number of indexes in the specified succeededIndexes field)",
        )
    ]
    assert _causes(sim, bad(**ix, successPolicy={"rules": [{"succeededCount": 4}]})) == [
        (
            "spec.successPolicy.rules[0].succeededCount",
            "FieldValueInvalid",
            "Invalid value: 4: must be less than or equal to 3 (the number of specified completions)",
        )
    ]
    fail_index = {"rules": [{"action": "FailIndex", "onExitCodes": {"operator": "In", "values": [3]}}]}
    assert _causes(sim, bad(**ix, podFailurePolicy=fail_index)) == [
        (
            "spec.podFailurePolicy.rules[0].action",
            "FieldValueInvalid",
            'Invalid value: "FailIndex": requires the backoffLimitPerIndex to be set',
        )
    ]
    assert _causes(sim, bad(successPolicy={"rules": [{"succeededCount": 1}]})) == [
        (
            "spec.successPolicy",
            "FieldValueInvalid",
            'Invalid value: {"Rules":[{"SucceededIndexes":null,"SucceededCount":1}]}: requires indexed completion mode',
        )
    ]
    assert _causes(sim, bad(maxFailedIndexes=1)) == [
        ("spec.backoffLimitPerIndex", "FieldValueRequired", "Required value: when maxFailedIndexes is specified"),
        ("spec.maxFailedIndexes", "FieldValueInvalid", "Invalid value: 1: requires indexed completion mode"),
    ]
    assert _causes(sim, bad(completionMode="Indexed", completions=3, parallelism=100001)) == [
        (
            "spec.parallelism",
            "FieldValueInvalid",
            "Invalid value: 100001: must be less than or equal to 100000 when completion mode is Indexed",
        )
    ]
    assert _causes(sim, bad(**ix, successPolicy={"rules": [{"succeededCount": 1}] * 21})) == [
        ("spec.successPolicy.rules", "FieldValueTooMany", "Too many: 21: must have at most 20 items")
    ]
    assert _causes(sim, bad(**ix, successPolicy={"rules": [{"succeededCount": -1}]})) == [
        (
            "spec.successPolicy.rules[0].succeededCount",
            "FieldValueInvalid",
            "Invalid value: -1: must be greater than or equal to 0",
        )
    ]
    long = "n" * 62
    assert _causes(sim, job_manifest(long, completionMode="Indexed", completions=10, parallelism=1)) == [
        ("metadata.name", "FieldValueInvalid",
         f'Invalid value: "{long}": will not able to create pod with invalid DNS label: {long}-9')]  # fmt: skip


def test_the_api_server_refuses_changes_to_per_index_fields(sim: Api) -> None:
    sim.create_job(indexed("upd", 3, 3, suspend=True, backoffLimitPerIndex=1))
    path = f"/apis/batch/v1/namespaces/{sim.namespace}/jobs/upd"
    for spec, field, message in (
        ({"backoffLimitPerIndex": 2}, "spec.backoffLimitPerIndex", "Invalid value: 2: field is immutable"),
        ({"completions": 2}, "spec.completions", "Invalid value: 2: can only be modified in tandem with spec.parallelism"),
        ({"successPolicy": {"rules": [{"succeededCount": 1}]}}, "spec.successPolicy", None),
    ):  # fmt: skip
        code, _, body = raw_request(
            sim.cluster, "PATCH", path, {"spec": spec}, content_type="application/merge-patch+json"
        )
        assert code == 422, body
        causes = {c["field"]: c["message"] for c in json.loads(body)["details"]["causes"]}
        assert field in causes, causes
        if message is not None:
            assert causes[field] == message
    code, _, body = raw_request(sim.cluster, "PATCH", path, {"spec": {"completions": 2, "parallelism": 2}},
                                content_type="application/merge-patch+json")  # fmt: skip
    assert code == 200, body


def test_the_api_server_refuses_bad_index_intervals_in_a_status(sim: Api) -> None:
    sim.create_job(indexed("st", 4, 1, suspend=True, backoffLimitPerIndex=1))
    wait_for(lambda: "Suspended" in condition_types(sim.job("st")), what="suspended")
    path = f"/apis/batch/v1/namespaces/{sim.namespace}/jobs/st/status"
    for status, field, message in (
        ({"completedIndexes": "3-1"}, "status.completedIndexes",
         'Invalid value: "3-1": error parsing completedIndexes: non-increasing order, previous: 3, current: 1'),
        ({"completedIndexes": "7"}, "status.completedIndexes",
         'Invalid value: "7": error parsing completedIndexes: too large index: "7"'),
        ({"failedIndexes": "0-x"}, "status.failedIndexes",
         'Invalid value: "0-x": error parsing failedIndexes: cannot convert string to integer for index: "x"'),
        ({"completedIndexes": "0-2", "failedIndexes": "2"}, "status.failedIndexes",
         'Invalid value: "2": failedIndexes and completedIndexes overlap at index: 2'),
    ):  # fmt: skip
        code, _, body = raw_request(sim.cluster, "PATCH", path, {"status": status},
                                    content_type="application/merge-patch+json")  # fmt: skip
        assert code == 422, body
        causes = [(c["field"], c["message"]) for c in json.loads(body)["details"]["causes"]]
        assert (field, message) in causes, causes


# --- exec mode (localcluster only: the real control plane's node agent runs in simulate mode) ---


def test_exec_a_container_reads_its_index_from_the_environment(ex: Api) -> None:
    command = ["sh", "-c", 'printf "%s" "$JOB_COMPLETION_INDEX" > "$TERMINATION_MESSAGE_PATH"']
    ex.create_job(job_manifest("env", command=command, completionMode="Indexed", completions=3, parallelism=3))
    ex.wait_job("env", "Complete", timeout=20)
    for index, (pod,) in by_index(ex.pods_of("env")).items():
        assert pod.status.container_statuses[0].state.terminated.message == str(index)


# --- the interval strings (pure) ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("members", "text"),
    [([], ""), ([3], "3"), ([1, 2], "1,2"), ([0, 1, 2], "0-2"), ([0, 2, 3, 4, 7, 8], "0,2-4,7,8")],
)
def test_indexes_are_written_as_the_job_controller_writes_them(members: list[int], text: str) -> None:
    assert indexes.format_intervals(indexes.with_indexes([], members)) == text
    assert list(indexes.members(indexes.parse(text, 100))) == members


@given(st.sets(st.integers(min_value=0, max_value=60)), st.integers(min_value=1, max_value=70))
def test_written_indexes_read_back_and_pass_the_api_servers_check(members: set[int], completions: int) -> None:
    text = indexes.format_intervals(indexes.with_indexes([], members))
    count, problem = indexes.validate_format(text, max(completions, 61))
    assert problem is None and count == len(members)
    kept = sorted(i for i in members if i < completions)
    assert list(indexes.members(indexes.parse(text, completions))) == kept


@pytest.mark.parametrize(
    ("rules", "succeeded", "message"),
    [
        ([{"succeededIndexes": "0-2"}], "0,1", None),
        ([{"succeededIndexes": "0-2"}], "0-3", "Matched rules at index 0"),
        ([{"succeededIndexes": "0-3", "succeededCount": 2}], "1,5", None),
        ([{"succeededIndexes": "0-3", "succeededCount": 2}], "1,3", "Matched rules at index 0"),
        ([{"succeededCount": 9}, {"succeededCount": 2}], "4,7", "Matched rules at index 1"),
        ([{"succeededIndexes": "9"}, {"succeededCount": 1}], "2", "Matched rules at index 1"),
    ],
)
def test_success_policy_rules_match_as_the_job_controller_matches_them(
    rules: list[dict[str, Any]], succeeded: str, message: str | None
) -> None:
    done = indexes.parse(succeeded, 8)
    assert indexes.match_success_policy({"rules": rules}, 8, done) == message
