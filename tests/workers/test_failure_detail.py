"""Why a Job failed, from its Pods, Events and log (pure): reasons, exit codes and signals, the
disrupted Pods, and a detail the store always keeps whatever bytes and strings the cluster sent."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from k8s_dispatch.core.payloads import canonical_json
from k8s_dispatch.workers import failure_detail as fd

JOB = {
    "metadata": {"name": "kd-x", "uid": "job-uid"},
    "status": {
        "conditions": [
            {"type": "FailureTarget", "status": "True", "reason": "BackoffLimitExceeded", "message": "limit"},
            {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded", "message": "limit"},
        ]
    },
}


def pod(name: str, *, exit_code: int = 1, reason: str = "Error", finished: str = "2026-01-01T00:00:02Z",
        disrupted: bool = False, phase: str = "Failed", **terminated: Any) -> dict[str, Any]:  # fmt: skip
    conditions = [{"type": "Ready", "status": "False"}]
    if disrupted:
        conditions.append(
            {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI",
             "message": "Eviction API: evicting", "lastTransitionTime": "2026-01-01T00:00:01Z"}
        )  # fmt: skip
    state = {"exitCode": exit_code, "reason": reason, "finishedAt": finished, **terminated}
    return {
        "metadata": {"name": name, "uid": f"uid-{name}"},
        "spec": {"nodeName": "node-1"},
        "status": {
            "phase": phase,
            "conditions": conditions,
            "containerStatuses": [{"name": "worker", "state": {"terminated": state}}],
        },
    }


def test_disrupted_pods_are_the_failed_ones_with_the_condition() -> None:
    pods = [pod("b", disrupted=True, exit_code=143), pod("a"), pod("c", disrupted=True, phase="Running")]
    (only,) = fd.disruptions(pods)
    assert only == fd.Disruption(
        "uid-b", "b", "node-1", "EvictionByEvictionAPI", "Eviction API: evicting", "2026-01-01T00:00:01Z"
    )
    assert only.payload()["pod_uid"] == "uid-b"


@pytest.mark.parametrize(
    ("job_reason", "container_reason", "reason"),
    [
        ("BackoffLimitExceeded", "OOMKilled", "OOMKilled"),
        ("PodFailurePolicy", "OOMKilled", "OOMKilled"),
        ("BackoffLimitExceeded", "Error", "BackoffLimitExceeded"),
        ("DeadlineExceeded", "OOMKilled", "DeadlineExceeded"),  # the deadline, not the memory, ended it
    ],
)
def test_oomkilled_is_its_own_reason_when_a_pod_failure_ended_the_job(
    job_reason: str, container_reason: str, reason: str
) -> None:
    assert fd.failure_reason(job_reason, pod("a", exit_code=137, reason=container_reason)) == reason


@pytest.mark.parametrize(
    ("reported", "exit_code", "name"),
    [
        (None, 137, "SIGKILL"),
        (None, 143, "SIGTERM"),
        (None, 1, None),
        (None, 0, None),
        (11, 139, "SIGSEGV"),
        (0, 2, None),
    ],
)
def test_the_signal_comes_from_the_runtime_or_the_exit_code(reported: Any, exit_code: int, name: str | None) -> None:
    assert fd.signal_name(reported, exit_code) == name


def test_the_failing_pod_is_the_latest_that_was_not_disrupted() -> None:
    pods = [
        pod("a", finished="2026-01-01T00:00:05Z", disrupted=True),
        pod("b"),
        pod("c", finished="2026-01-01T00:00:01Z"),
    ]
    assert fd.failed_pod(pods)["metadata"]["name"] == "b"
    assert fd.failed_pod([pod("a", disrupted=True)])["metadata"]["name"] == "a"
    assert fd.failed_pod([]) is None


def test_the_detail_holds_what_is_known() -> None:
    events = [
        {"type": "Normal", "reason": "SuccessfulCreate", "involvedObject": {"kind": "Job", "name": "kd-x"}},
        {"type": "Warning", "reason": "BackoffLimitExceeded", "message": "limit", "count": 1,
         "lastTimestamp": "2026-01-01T00:00:03Z", "involvedObject": {"kind": "Job", "name": "kd-x"}},
    ]  # fmt: skip
    detail = fd.detail(JOB, pod("b", exit_code=137, reason="OOMKilled"), events=events, log=b"one\ntwo\n")
    assert detail == {
        "job_reason": "BackoffLimitExceeded",
        "job_message": "limit",
        "pod": "b",
        "node": "node-1",
        "exit_code": 137,
        "signal": "SIGKILL",
        "container_reason": "OOMKilled",
        "finished_at": "2026-01-01T00:00:02Z",
        "log_tail": "one\ntwo\n",
        "events": [
            {
                "object": "Job/kd-x",
                "reason": "BackoffLimitExceeded",
                "message": "limit",
                "count": 1,
                "last_seen": "2026-01-01T00:00:03Z",
            }
        ],
    }
    assert fd.detail(JOB, None) == {"job_reason": "BackoffLimitExceeded", "job_message": "limit"}


def test_the_log_tail_is_the_last_2_kib_from_a_line_and_a_character() -> None:
    log = ("é" * 3000 + "\n").encode() + b"".join(b"line %d\n" % i for i in range(400))
    tail = fd.log_tail(log)
    assert tail is not None and len(tail.encode()) <= fd.MAX_LOG_BYTES
    assert tail.startswith("line ") and tail.endswith("line 399\n")
    cut_mid_character = fd.log_tail("é".encode() * 2000)
    assert cut_mid_character is not None and set(cut_mid_character) == {"é"}
    assert fd.log_tail(b"") is None
    invalid = fd.log_tail(b"\xff" * 3000 + b"the end\n")  # each bad byte a 3-byte U+FFFD: still 2 KiB stored
    assert invalid is not None and len(invalid.encode()) <= fd.MAX_LOG_BYTES and invalid.endswith("\ufffdthe end\n")


hostile_text = st.text(st.characters(min_codepoint=0, max_codepoint=0x10FFFF), max_size=3000)  # surrogates included


@given(
    log=st.binary(max_size=6000),
    message=hostile_text,
    reason=hostile_text,
    event_message=hostile_text,
    exit_code=st.integers(-(2**31), 2**31 - 1),
)
def test_the_detail_is_always_storable_and_bounded(
    log: bytes, message: str, reason: str, event_message: str, exit_code: int
) -> None:
    failing = pod("p", exit_code=exit_code, reason=reason, message=message)
    failing["status"]["message"] = message
    events = [{"type": "Warning", "reason": reason, "message": event_message, "involvedObject": {"name": message}}] * 30
    detail = fd.detail(JOB, failing, events=events, log=log, disrupted=fd.disruptions([failing]))
    text = canonical_json(detail, what="detail")  # raises if the store could not keep it
    assert len(text.encode()) < 64 * 1024
    assert len(detail.get("log_tail", "").encode()) <= fd.MAX_LOG_BYTES
    assert len(detail["events"]) == fd.MAX_EVENTS
