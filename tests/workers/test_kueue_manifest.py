"""A capability's Kueue `queue`: the field as the resolver checks it, the suspended, labelled Job
`build_job` makes of it, and a suspended Job's start clock in workers/pod_health.py (pure)."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from k8s_dispatch.core.errors import ConfigError, InvalidManifest
from k8s_dispatch.core.names import is_dns1123_subdomain, is_label_value
from k8s_dispatch.workers.manifest import QUEUE_NAME_LABEL, build_job, is_queue_name
from k8s_dispatch.workers.pod_health import (
    CHECK_GRACE,
    WAIT,
    StartPolicy,
    assess,
    due_for_check,
    is_suspended,
    start_age,
    unstarted,
)
from k8s_dispatch.workers.resolver import CapabilityResolver
from k8s_dispatch.workers.types import DispatchRef

CAPABILITY = {"worker": "demo-text", "image": "img:1", "queue": "team-a"}
REF = DispatchRef(
    dispatch_id="0b8e2f1c-4f5a-4d0e-9a3b-2c1d0e9f8a7b",
    case_id="case-42",
    tenancy_id="acme",
    capability="demo.queued",
    worker_name="demo-text",
    idempotency_key="order-1001",
)
POLICY = StartPolicy(start_timeout_s=60)
CREATED = "2026-01-01T10:00:00Z"


def resolver(**fields: Any) -> CapabilityResolver:
    return CapabilityResolver.from_mapping({"capabilities": {"demo.queued": {**CAPABILITY, **fields}}}, source="c.yaml")


def job_of(**fields: Any) -> dict[str, Any]:
    return build_job(REF, input={"n": 1}, spec=resolver(**fields).spec("demo.queued"), namespace="jobs", deployment="d")


# --- the field ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["team-a", "a", "0", "team.a", "a-b.c-d", "x" * 63])
def test_a_local_queue_name_is_accepted(name: str) -> None:
    assert resolver(queue=name).spec("demo.queued").queue == name


def test_no_queue_field_means_no_queue() -> None:
    spec = CapabilityResolver.from_mapping({"capabilities": {"c": {"worker": "w", "image": "i"}}}).spec("c")
    assert spec.queue is None


@pytest.mark.parametrize("name", ["Team-A", "-a", "a-", "a_b", "a..b", ".a", "a b", "", "x" * 64, "a/b", "ä", "a.-b"])
def test_a_bad_local_queue_name_names_file_capability_and_field(name: str) -> None:
    with pytest.raises(ConfigError) as raised:
        resolver(queue=name)
    lines = str(raised.value).splitlines()[1:]
    assert lines == [
        f"c.yaml: capability 'demo.queued': field 'queue': {name!r} is not a LocalQueue name "
        "(a DNS-1123 subdomain usable as a label value)"
    ]


@pytest.mark.parametrize("value", [3, ["team-a"], {"name": "team-a"}, True])
def test_a_queue_that_is_not_a_string_is_refused(value: object) -> None:
    with pytest.raises(ConfigError, match=r"c\.yaml: capability 'demo.queued': field 'queue': must be a string"):
        resolver(queue=value)


def test_null_queue_is_no_queue() -> None:
    assert resolver(queue=None).spec("demo.queued").queue is None


def test_the_queue_label_cannot_be_set_through_labels() -> None:
    with pytest.raises(ConfigError, match=r"field 'labels': 'kueue.x-k8s.io/queue-name' is set from the capability"):
        resolver(queue=None, labels={QUEUE_NAME_LABEL: "team-a"})


@given(st.text(alphabet="abz09-.A_", max_size=70))
def test_is_queue_name_is_kueues_rule(name: str) -> None:
    """Kueue's webhook: IsDNS1123Subdomain of the label value; the API server: a label value."""
    assert is_queue_name(name) == (is_dns1123_subdomain(name) and is_label_value(name))


# --- the Job ------------------------------------------------------------------------------


def test_a_queued_capabilitys_job_is_created_suspended_with_kueues_label() -> None:
    job = job_of()
    assert job["spec"]["suspend"] is True
    assert job["metadata"]["labels"][QUEUE_NAME_LABEL] == "team-a"
    # Kueue reads the Job's label; the Pods it admits need none (Kueue's pod integration stays off them).
    assert QUEUE_NAME_LABEL not in job["spec"]["template"]["metadata"]["labels"]
    unqueued = job_of(queue=None)
    assert "suspend" not in unqueued["spec"] and QUEUE_NAME_LABEL not in unqueued["metadata"]["labels"]
    # Otherwise the same Job: ours labels, finalizers, the template.
    without = {k: v for k, v in job["metadata"]["labels"].items() if k != QUEUE_NAME_LABEL}
    assert without == unqueued["metadata"]["labels"]
    assert job["spec"]["template"] == unqueued["spec"]["template"]


def test_build_job_refuses_a_hand_built_spec_with_a_bad_queue() -> None:
    spec = replace(resolver().spec("demo.queued"), queue="Not A Queue")
    with pytest.raises(InvalidManifest, match="queue: 'Not A Queue' is not a LocalQueue name"):
        build_job(REF, input={}, spec=spec, namespace="jobs", deployment="d")


# --- a queued Job's start clock -------------------------------------------------------------


def job(
    *,
    suspend: bool | None,
    condition: str | None = None,
    start: str | None = None,
    queue: bool = True,
    **status: Any,
) -> dict[str, Any]:
    """A Job as the API shows it: `condition` the status of its Suspended condition, if any."""
    labels = {QUEUE_NAME_LABEL: "team-a"} if queue else {}
    conditions = [] if condition is None else [{"type": "Suspended", "status": condition}]
    spec = {} if suspend is None else {"suspend": suspend}
    body: dict[str, Any] = {"conditions": conditions, **status}
    if start is not None:
        body["startTime"] = start
    return {
        "metadata": {"name": "kd-x", "uid": "u1", "creationTimestamp": CREATED, "labels": labels},
        "spec": spec,
        "status": body,
    }


def minutes(n: float) -> timedelta:
    return timedelta(minutes=n)


@pytest.mark.parametrize(
    ("the_job", "suspended", "clock"),
    [
        # Created suspended, not yet seen by the Job controller / seen: queued.
        (job(suspend=True), True, None),
        (job(suspend=True, condition="True"), True, None),
        # Unsuspended (by Kueue), the controller not yet acting on it: still queued, no clock.
        (job(suspend=False, condition="True"), True, None),
        (job(suspend=False), False, None),
        # Resumed at 10:09 (startTime): 10 minutes after creation, the clock has run 1.
        (job(suspend=False, condition="False", start="2026-01-01T10:09:00Z"), False, minutes(1)),
        (job(suspend=None, condition="False", start="2026-01-01T10:09:00Z", queue=False), False, minutes(1)),
        # An operator's suspend of a queue-less Job is queued too.
        (job(suspend=True, queue=False), True, None),
        # Never suspended: the clock runs from creation, as before (startTime is not read).
        (job(suspend=None, queue=False, start="2026-01-01T10:09:00Z"), False, minutes(10)),
        (job(suspend=False, queue=False), False, minutes(10)),
    ],
)
def test_is_suspended_and_start_age(the_job: dict[str, Any], suspended: bool, clock: timedelta | None) -> None:
    assert is_suspended(the_job) is suspended
    assert start_age(the_job, age=minutes(10)) == clock


def test_a_suspended_job_waits_past_its_start_timeout_and_is_never_read() -> None:
    for suspended in (job(suspend=True), job(suspend=True, condition="True"), job(suspend=False, condition="True")):
        assert not unstarted(suspended) and not due_for_check(suspended, age=minutes(60))
        assert assess(suspended, [], age=minutes(60), policy=POLICY) == WAIT


def test_a_resumed_job_gets_its_whole_start_timeout_from_the_resume() -> None:
    """Queued 59 minutes, resumed: no Pod yet 30 s later waits; 61 s later it is a StartTimeout."""
    resumed = job(suspend=False, condition="False", start="2026-01-01T10:59:00Z", active=0)
    assert unstarted(resumed)
    assert not due_for_check(resumed, age=minutes(59) + CHECK_GRACE - timedelta(seconds=1))
    assert due_for_check(resumed, age=minutes(59) + CHECK_GRACE)
    assert assess(resumed, [], age=minutes(59.5), policy=POLICY) == WAIT
    verdict = assess(resumed, [], age=minutes(60) + timedelta(seconds=1), policy=POLICY)
    assert verdict.fail and verdict.reason == "StartTimeout"
    assert "within startTimeoutSeconds (60 s)" in (verdict.message or "")


def test_a_never_suspended_job_keeps_its_clock_from_creation() -> None:
    plain = job(suspend=None, queue=False, active=1)
    verdict = assess(plain, [], age=minutes(1) + timedelta(seconds=1), policy=POLICY)
    assert verdict.fail and verdict.reason == "StartTimeout"
