"""workers/pod_health.py: a Job's unstarted Pods against the capability's clocks, as tables of
Pods (the API's JSON) and ages; wait, or fail with the real cause as reason and its message."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from k8s_dispatch.workers.pod_health import (
    CHECK_GRACE,
    WAIT,
    StartPolicy,
    Verdict,
    assess,
    due_for_check,
    pods_of,
    read_pod,
    unstarted,
)

UID = "5d3c0d5e-0000-4000-8000-000000000001"
CREATED = "2026-01-01T10:00:00Z"
POLICY = StartPolicy(start_timeout_s=600, image_pull_timeout_s=300, config_error_timeout_s=60)
PULL = 'Back-off pulling image "foo:1"'
SCHEDULER = "0/3 nodes are available: 3 Insufficient cpu."


def job(**status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "kd-x", "uid": UID, "creationTimestamp": CREATED},
        "status": {"active": 1, **status},
    }


def pod(
    *,
    waiting: tuple[str, str] | None = None,
    phase: str = "Pending",
    scheduled_at: str | None = CREATED,
    unschedulable: str | None = None,
    state: dict[str, Any] | None = None,
    owner: str = UID,
    job_name: str = "kd-x",
    name: str = "kd-x-abcde",
) -> dict[str, Any]:
    conditions: list[dict[str, Any]] = []
    if unschedulable is not None:
        conditions.append(
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": unschedulable}
        )
    elif scheduled_at is not None:
        conditions.append({"type": "PodScheduled", "status": "True", "lastTransitionTime": scheduled_at})
    statuses = []
    if waiting is not None:
        statuses.append({"name": "worker", "state": {"waiting": {"reason": waiting[0], "message": waiting[1]}}})
    elif state is not None:
        statuses.append({"name": "worker", "state": state})
    return {
        "metadata": {
            "name": name,
            "creationTimestamp": CREATED,
            "labels": {"batch.kubernetes.io/job-name": job_name, "batch.kubernetes.io/controller-uid": owner},
            "ownerReferences": [{"kind": "Job", "name": job_name, "uid": owner, "controller": True}],
        },
        "status": {"phase": phase, "conditions": conditions, "containerStatuses": statuses},
    }


def s(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


def fail(reason: str, message: str, pod_name: str | None = "kd-x-abcde") -> Verdict:
    return Verdict(fail=True, reason=reason, message=message, pod=pod_name)


INVALID = ("InvalidImageName", 'couldn\'t parse image name "Foo:1"')
CONFIG = ("CreateContainerConfigError", 'secret "db" not found')
CREATING = ("ContainerCreating", "")


@pytest.mark.parametrize(
    ("pods", "age", "expected"),
    [
        # fail at once: no retry parses a bad reference
        ([pod(waiting=INVALID)], s(6), fail(*INVALID)),
        # image pulls: after imagePullTimeoutSeconds from the Pod's scheduling
        ([pod(waiting=("ImagePullBackOff", PULL))], s(299), WAIT),
        ([pod(waiting=("ImagePullBackOff", PULL))], s(300), fail("ImagePullBackOff", PULL)),
        ([pod(waiting=("ErrImagePull", "not found"))], s(301), fail("ErrImagePull", "not found")),
        # scheduled 100 s after the Job was made (its own server's clock): the pull clock starts then
        ([pod(waiting=("ImagePullBackOff", PULL), scheduled_at="2026-01-01T10:01:40Z")], s(399), WAIT),
        ([pod(waiting=("ImagePullBackOff", PULL), scheduled_at="2026-01-01T10:01:40Z")], s(400), fail("ImagePullBackOff", PULL)),
        # a Pod "scheduled" before its Job by a skewed reading never shortens the wait below zero
        ([pod(waiting=("ImagePullBackOff", PULL), scheduled_at="2026-01-01T09:00:00Z")], s(299), WAIT),
        # config errors: after the grace (the Secret may appear)
        ([pod(waiting=CONFIG)], s(59), WAIT),
        ([pod(waiting=CONFIG)], s(60), fail(*CONFIG)),
        ([pod(waiting=("CreateContainerError", "name is reserved"))], s(60), fail("CreateContainerError", "name is reserved")),
        ([pod(waiting=("RunContainerError", "exec failed"))], s(61), fail("RunContainerError", "exec failed")),
        # Unschedulable waits for the start clock (an autoscaler may be adding a node)
        ([pod(unschedulable=SCHEDULER)], s(599), WAIT),
        ([pod(unschedulable=SCHEDULER)], s(600), fail("Unschedulable", SCHEDULER)),
        # the start clock: whatever else keeps the container from starting
        ([pod(waiting=CREATING)], s(599), WAIT),
        ([pod(waiting=CREATING)], s(600), fail(
            "StartTimeout",
            "no container of the Job started within startTimeoutSeconds (600 s); pod kd-x-abcde: ContainerCreating",
        )),
        ([pod(scheduled_at=None)], s(600), fail(
            "StartTimeout", "no container of the Job started within startTimeoutSeconds (600 s); pod kd-x-abcde: Pending"
        )),
        ([], s(599), WAIT),
        ([], s(600), fail("StartTimeout", "no Pod of the Job was created within startTimeoutSeconds (600 s)", None)),
        # a started container meets the start clock, whatever its siblings say
        ([pod(waiting=INVALID, name="a"), pod(phase="Running", state={"running": {}}, name="b")], s(900), WAIT),
        ([pod(state={"terminated": {"exitCode": 1}}, phase="Failed")], s(900), WAIT),
        # another Job's Pod (an earlier Job of the same name, or another name) says nothing of this one
        ([pod(waiting=INVALID, owner="another-uid")], s(10), WAIT),
        ([pod(waiting=INVALID, job_name="kd-y")], s(10), WAIT),
        # the sharpest cause first: a bad image before an unschedulable sibling
        ([pod(unschedulable=SCHEDULER, name="a"), pod(waiting=INVALID, name="b")], s(6), fail(*INVALID, "b")),
    ],
)  # fmt: skip
def test_assess(pods: list[dict[str, Any]], age: timedelta, expected: Verdict) -> None:
    assert assess(job(), pods, age=age, policy=POLICY) == expected


def test_the_start_clock_names_a_never_run_reason_whose_own_timeout_is_longer() -> None:
    policy = StartPolicy(start_timeout_s=60, image_pull_timeout_s=300, config_error_timeout_s=600)
    assert assess(job(), [pod(waiting=("ImagePullBackOff", PULL))], age=s(60), policy=policy) == fail(
        "ImagePullBackOff", PULL
    )
    assert assess(job(), [pod(waiting=CONFIG)], age=s(59), policy=policy) == WAIT


def test_a_failed_create_event_names_why_no_pod_exists_at_the_start_clock() -> None:
    events = [
        {"type": "Normal", "reason": "SuccessfulCreate", "message": "Created pod"},
        {"type": "Warning", "reason": "FailedCreate", "message": "old", "lastTimestamp": "2026-01-01T10:00:01Z"},
        {"type": "Warning", "reason": "FailedCreate", "lastTimestamp": "2026-01-01T10:05:00Z",
         "message": 'pods "kd-x-1" is forbidden: exceeded quota: q, requested: pods=1, used: pods=2, limited: pods=2'},
    ]  # fmt: skip
    verdict = assess(job(), [], age=s(600), policy=POLICY, events=events)
    assert (verdict.fail, verdict.reason) == (True, "FailedCreate") and "exceeded quota" in (verdict.message or "")
    assert assess(job(), [], age=s(599), policy=POLICY, events=events) == WAIT


def test_a_message_less_reason_still_says_which_pod() -> None:
    assert assess(job(), [pod(waiting=("InvalidImageName", ""))], age=s(6), policy=POLICY) == fail(
        "InvalidImageName", "pod kd-x-abcde: InvalidImageName"
    )


@pytest.mark.parametrize(
    ("status", "metadata", "expected"),
    [
        ({"active": 1}, {}, True),
        ({"active": 1, "ready": 0}, {}, True),
        ({}, {}, True),  # no Pod created yet (quota, admission): still unstarted
        ({"active": 1, "ready": 1}, {}, False),
        ({"succeeded": 1}, {}, False),
        ({"failed": 1}, {}, False),  # a Pod ran and failed: the Job's own backoff decides
        ({"conditions": [{"type": "Failed", "status": "True", "reason": "DeadlineExceeded"}]}, {}, False),
        ({"active": 1}, {"deletionTimestamp": "2026-01-01T10:00:00Z"}, False),
        ({"active": 1, "ready": True}, {}, True),  # not a count: ignored
    ],
)
def test_unstarted_reads_only_the_jobs_status(status: dict[str, Any], metadata: dict[str, Any], expected: bool) -> None:
    assert unstarted({"metadata": {"name": "kd-x", **metadata}, "status": status}) is expected


@pytest.mark.parametrize(("suspend", "expected"), [(True, False), (False, True), (None, True), ("true", True)])
def test_a_suspended_job_has_not_started_its_start_clock(suspend: Any, expected: bool) -> None:
    job = {"metadata": {"name": "kd-x"}, "spec": {"suspend": suspend}, "status": {}}
    assert unstarted(job) is expected


def test_pods_are_read_only_past_the_grace() -> None:
    assert not due_for_check(job(), age=CHECK_GRACE - s(1))
    assert due_for_check(job(), age=CHECK_GRACE)
    assert not due_for_check(job(ready=1), age=s(900))


def test_pods_of_picks_this_jobs_pods_from_a_namespace_list() -> None:
    mine, earlier, other = pod(name="a"), pod(name="b", owner="old-uid"), pod(name="c", job_name="kd-y")
    orphan = pod(name="d")
    orphan["metadata"]["ownerReferences"] = []  # orphaned, its labels kept
    assert [p["metadata"]["name"] for p in pods_of(job(), [mine, earlier, other, orphan])] == ["a", "d"]


@pytest.mark.parametrize(
    "tolerated",
    [
        {},
        {"metadata": None, "status": None},
        {"status": {"containerStatuses": [None, 3]}},
        {"status": {"conditions": "x"}},
    ],
)
def test_read_pod_tolerates_missing_or_odd_fields(tolerated: dict[str, Any]) -> None:
    view = read_pod(tolerated)
    assert not view.started and view.waiting_reason is None and view.unschedulable is None
