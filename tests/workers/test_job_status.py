"""workers/job_status.py: Job conditions -> outcome, termination message -> result or reason."""

from __future__ import annotations

import datetime as dt
import json
import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kubernetes import client as k8s

from k8s_dispatch.container.contract import encode_input
from k8s_dispatch.store import dispatches
from k8s_dispatch.store.models import EventType
from k8s_dispatch.workers.job_status import (
    CONTAINER_FAILED,
    JOB_DELETED,
    JOB_FAILED,
    MAX_RESULT_BYTES,
    RESULT_LOST,
    RESULT_MISSING,
    RESULT_NOT_JSON,
    RESULT_TOO_LARGE,
    Completion,
    JobState,
    Outcome,
    Result,
    completion,
    job_state,
    parse_result,
    pick_termination,
)
from tests.workers import strategies as S

JOB_UID = "7d0f4a6e-0000-4000-8000-000000000001"
LOST = "the Job succeeded but no Pod of it holds the result any more"


def condition(kind: str, status: str = "True", reason: str | None = None, message: str | None = None) -> dict[str, Any]:
    c: dict[str, Any] = {"type": kind, "status": status}
    if reason is not None:
        c["reason"] = reason
    if message is not None:
        c["message"] = message
    return c


def job(*conditions: dict[str, Any], deleting: bool = False) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": "kd-x", "uid": JOB_UID}
    if deleting:
        metadata["deletionTimestamp"] = "2024-05-01T10:00:00Z"
    return {"metadata": metadata, "status": {"conditions": list(conditions)}}


@pytest.mark.parametrize(
    ("the_job", "expected"),
    [
        ({}, JobState(Outcome.RUNNING)),
        ({"status": None}, JobState(Outcome.RUNNING)),
        ({"status": {"conditions": None}}, JobState(Outcome.RUNNING)),
        (job(), JobState(Outcome.RUNNING)),
        (job(condition("Suspended", reason="JobSuspended")), JobState(Outcome.RUNNING)),
        (job(condition("Complete", status="False")), JobState(Outcome.RUNNING)),
        (job(condition("Failed", status="Unknown")), JobState(Outcome.RUNNING)),
        (job(condition("Complete")), JobState(Outcome.SUCCEEDED)),
        (
            job(
                condition("SuccessCriteriaMet", reason="CompletionsReached"),
                condition("Complete", reason="CompletionsReached"),
            ),
            JobState(Outcome.SUCCEEDED, "CompletionsReached"),
        ),
        (
            job(condition("SuccessCriteriaMet", reason="CompletionsReached")),
            JobState(Outcome.SUCCEEDED, "CompletionsReached"),
        ),
        (
            job(
                condition(
                    "Failed", reason="BackoffLimitExceeded", message="Job has reached the specified backoff limit"
                )
            ),
            JobState(Outcome.FAILED, "BackoffLimitExceeded", "Job has reached the specified backoff limit"),
        ),
        (
            job(condition("FailureTarget", reason="DeadlineExceeded", message="past deadline")),
            JobState(Outcome.FAILED, "DeadlineExceeded", "past deadline"),
        ),
        (
            job(condition("FailureTarget", reason="PodFailurePolicy"), condition("Failed", reason="PodFailurePolicy")),
            JobState(Outcome.FAILED, "PodFailurePolicy"),
        ),
        (job(condition("Failed")), JobState(Outcome.FAILED, JOB_FAILED)),
        # A contradictory Job: the final Failed speaks over an interim SuccessCriteriaMet.
        (job(condition("SuccessCriteriaMet"), condition("Failed", reason="X")), JobState(Outcome.FAILED, "X")),
        (job(deleting=True), JobState(Outcome.FAILED, JOB_DELETED, "the Job was deleted before it finished")),
        (job(condition("Complete"), deleting=True), JobState(Outcome.SUCCEEDED)),
        (
            job(condition("Failed", reason="DeadlineExceeded"), deleting=True),
            JobState(Outcome.FAILED, "DeadlineExceeded"),
        ),
        ({"status": {"conditions": ["junk", {"status": "True"}, condition("Complete")]}}, JobState(Outcome.SUCCEEDED)),
    ],
)
def test_job_state(the_job: dict[str, Any], expected: JobState) -> None:
    assert job_state(the_job) == expected
    assert job_state(the_job).terminal == (expected.outcome is not Outcome.RUNNING)


def test_job_state_reads_what_the_python_client_serialises() -> None:
    model = k8s.V1Job(
        metadata=k8s.V1ObjectMeta(name="kd-x", uid=JOB_UID),
        status=k8s.V1JobStatus(
            conditions=[
                k8s.V1JobCondition(
                    type="Failed",
                    status="True",
                    reason="DeadlineExceeded",
                    message="Job was active longer than specified deadline",
                    last_transition_time=dt.datetime(2024, 5, 1, tzinfo=dt.UTC),
                )
            ]
        ),
    )
    with k8s.ApiClient() as api:
        as_dict = api.sanitize_for_serialization(model)
    assert job_state(as_dict) == JobState(
        Outcome.FAILED, "DeadlineExceeded", "Job was active longer than specified deadline"
    )


OK_JSON = '{"words":3}'


@pytest.mark.parametrize(
    ("message", "exit_ok", "expected"),
    [
        (OK_JSON, True, Result(output={"words": 3})),
        ("[1,2]", True, Result(output=[1, 2])),
        ("null", True, Result(output=None)),
        ('  {"a": "é"}\n', True, Result(output={"a": "é"})),
        (None, True, Result(reason=RESULT_MISSING, detail="the container exited 0 without writing a result")),
        ("", True, Result(reason=RESULT_MISSING, detail="the container exited 0 without writing a result")),
        (" \n", True, Result(reason=RESULT_MISSING, detail="the container exited 0 without writing a result")),
        (
            "Traceback (most recent call last):\nboom",
            False,
            Result(reason=CONTAINER_FAILED, detail="Traceback (most recent call last):\nboom"),
        ),
        (None, False, Result(reason=CONTAINER_FAILED)),
        ("", False, Result(reason=CONTAINER_FAILED)),
    ],
)
def test_parse_result(message: str | None, exit_ok: bool, expected: Result) -> None:
    assert parse_result(message, exit_ok=exit_ok) == expected


@pytest.mark.parametrize(
    "message",
    ["done", "{'a': 1}", '{"a": 1', "NaN", '{"x": Infinity}', "[" * 2000 + "]" * 2000, '{"a":1}{"b":2}'],
    ids=["word", "python-repr", "truncated", "nan", "infinity", "too-deep", "two-documents"],
)
def test_parse_result_not_json_is_a_reason_not_a_crash(message: str) -> None:
    result = parse_result(message, exit_ok=True)
    assert not result.ok and result.reason == RESULT_NOT_JSON and result.output is None
    assert result.detail and message[:20] in result.detail


@pytest.mark.parametrize(("size", "ok"), [(MAX_RESULT_BYTES, True), (MAX_RESULT_BYTES + 1, False)])
def test_parse_result_size_limit(size: int, ok: bool) -> None:
    message = json.dumps("x" * (size - 2))
    assert len(message) == size
    result = parse_result(message, exit_ok=True)
    assert result.ok is ok
    assert result.reason == (None if ok else RESULT_TOO_LARGE)


def test_a_result_the_kubelet_cut_says_so_and_one_merely_not_json_does_not() -> None:
    whole = json.dumps({"rows": ["x" * 100] * 50})  # over 4 KiB: the kubelet keeps its last 4,096 bytes
    cut = parse_result(whole[-MAX_RESULT_BYTES:], exit_ok=True)
    assert cut.reason == RESULT_NOT_JSON and cut.detail is not None and "kubelet cuts" in cut.detail
    short = parse_result('{"a": 1', exit_ok=True)
    assert short.reason == RESULT_NOT_JSON and short.detail is not None and "kubelet" not in short.detail


def test_parse_result_counts_bytes_not_characters() -> None:
    message = json.dumps("é" * 2100, ensure_ascii=False)  # 2102 characters, 4202 bytes
    assert parse_result(message, exit_ok=True).reason == RESULT_TOO_LARGE


def test_parse_result_keeps_the_end_of_a_long_log_tail() -> None:
    log = "noise\n" * 1000 + "ValueError: the real error"
    detail = parse_result(log, exit_ok=False).detail
    assert detail is not None and detail.endswith("ValueError: the real error") and len(detail) <= 2048


@given(S.json_values)
def test_what_the_runner_writes_parses_back(value: object) -> None:
    text = encode_input(value)
    result = parse_result(text, exit_ok=True)
    if len(text.encode()) <= MAX_RESULT_BYTES:
        assert result == Result(output=json.loads(json.dumps(value)))
    else:
        assert result.reason == RESULT_TOO_LARGE


@pytest.mark.parametrize(
    ("message", "why"),
    [
        ("1e400", "Out of range float"),
        ("-1e400", "Out of range float"),
        ('{"a": [1, 2e999]}', "Out of range float"),
        ('"\\ud800"', "surrogates not allowed"),  # what JavaScript writes when it cuts a string mid-emoji
        ('{"\\udfff": 1}', "surrogates not allowed"),
        ("[" * 101 + "]" * 101, "nested more than 100 deep"),
        ('{"a":' * 101 + "1" + "}" * 101, "nested more than 100 deep"),
        # Python's json reads this from a shallow stack, not from a deep one: refused either way.
        ("[" * 990 + "]" * 990, "nested more than 100 deep|maximum recursion depth"),
    ],
    ids=["1e400", "-1e400", "inf-inside", "lone-surrogate", "surrogate-key", "deep-101", "deep-objects", "deep-990"],
)
def test_a_result_the_store_cannot_keep_is_not_json(message: str, why: str) -> None:
    result = parse_result(message, exit_ok=True)
    assert (result.reason, result.output) == (RESULT_NOT_JSON, None)
    assert result.detail is not None and re.search(why, result.detail)
    assert dispatches.storable_terminal(terminal(result), reason=RESULT_NOT_JSON) == terminal(
        result
    )  # its failure is storable


def terminal(result: Result) -> dispatches.TerminalEvent:
    payload = {"output": result.output} if result.ok else {"reason": result.reason, "message": result.detail}
    return dispatches.TerminalEvent(
        JOB_UID, EventType.WORKER_COMPLETED if result.ok else EventType.WORKER_FAILED, payload
    )


@pytest.mark.parametrize("message", ["[" * 100 + "]" * 100, "1e308", '"\\u0000"', '"\\ud83d\\ude00"'])
def test_a_result_the_store_can_keep_is_output(message: str) -> None:
    result = parse_result(message, exit_ok=True)
    assert result.ok and result.output == json.loads(message)


# Text that is, or is near, JSON: any text, JSON documents, numbers past a double's range,
# escaped surrogates (lone or paired), nesting around the limit.
NEAR_JSON = st.one_of(
    st.text(max_size=300),
    S.json_values.map(json.dumps),
    st.from_regex(r"\A-?[0-9]{1,3}(\.[0-9]{1,3})?[eE][+-]?[0-9]{1,4}\Z"),
    st.from_regex(r'\A"(\\u[dD][89abAB][0-9a-fA-F]{2})?(\\u[dD][c-fC-F][0-9a-fA-F]{2})?"\Z'),
    st.integers(95, 105).map(lambda n: "[" * n + "]" * n),
)


@given(NEAR_JSON)
def test_the_parser_accepts_exactly_what_the_store_keeps(message: str) -> None:
    """One rule, not two: an output the parser gives is kept by the store as it is, and a
    failure it gives is storable too."""
    result = parse_result(message, exit_ok=True)
    event = terminal(result)
    assert dispatches.storable_terminal(event, reason="Unstorable") == event


@given(st.text(max_size=300), st.booleans())
def test_parse_result_never_raises(message: str, exit_ok: bool) -> None:
    result = parse_result(message, exit_ok=exit_ok)
    assert result.ok or result.reason in (RESULT_MISSING, RESULT_NOT_JSON, RESULT_TOO_LARGE, CONTAINER_FAILED)


# --- pods ------------------------------------------------------------------------------


def pod(
    name: str,
    *,
    exit_code: int | None = 0,
    message: str | None = OK_JSON,
    finished: str | None = "2024-05-01T10:00:00Z",
    phase: str | None = None,
    container: str = "worker",
    owner_uid: str | None = JOB_UID,
    running: bool = False,
) -> dict[str, Any]:
    state: dict[str, Any]
    if running:
        state = {"running": {"startedAt": "2024-05-01T09:59:00Z"}}
    else:
        terminated: dict[str, Any] = {"reason": "Completed" if exit_code == 0 else "Error"}
        if exit_code is not None:
            terminated["exitCode"] = exit_code
        if message is not None:
            terminated["message"] = message
        if finished is not None:
            terminated["finishedAt"] = finished
        state = {"terminated": terminated}
    metadata: dict[str, Any] = {"name": name}
    if owner_uid is not None:
        metadata["ownerReferences"] = [{"kind": "Job", "name": "kd-x", "uid": owner_uid, "controller": True}]
    if phase is None:
        phase = "Running" if running else ("Succeeded" if exit_code == 0 else "Failed")
    return {
        "metadata": metadata,
        "status": {"phase": phase, "containerStatuses": [{"name": container, "state": state}]},
    }


@pytest.mark.parametrize(
    ("pods", "expected_pod"),
    [
        ([], None),
        ([pod("a", running=True)], None),
        ([pod("a", exit_code=None)], None),  # no exit code: says nothing
        ([pod("a")], "a"),
        # A succeeded pod wins over a later failed one, and the latest failure over older ones.
        ([pod("ok", finished="2024-05-01T10:00:00Z"), pod("bad", exit_code=1, finished="2024-05-01T11:00:00Z")], "ok"),
        (
            [
                pod("old", exit_code=1, finished="2024-05-01T10:00:00Z"),
                pod("new", exit_code=2, finished="2024-05-01T11:00:00Z"),
            ],
            "new",
        ),
        (
            [
                pod("new", exit_code=2, finished="2024-05-01T11:00:00+00:00"),
                pod("old", exit_code=1, finished="2024-05-01T10:00:00Z"),
            ],
            "new",
        ),
        ([pod("no-time", exit_code=1, finished=None), pod("timed", exit_code=1)], "timed"),
        ([pod("running", running=True), pod("failed", exit_code=1)], "failed"),
        # Another Job's pods (an earlier Job of the same name) are ignored; ownerless ones kept.
        ([pod("stale", owner_uid="other-uid"), pod("mine", exit_code=1)], "mine"),
        ([pod("ownerless", owner_uid=None)], "ownerless"),
        # A container of another name is used only when it is the pod's only container.
        ([pod("main", container="main")], "main"),
    ],
)
def test_pick_termination(pods: list[dict[str, Any]], expected_pod: str | None) -> None:
    termination = pick_termination(pods, job_uid=JOB_UID)
    assert (termination.pod_name if termination else None) == expected_pod


def test_pick_termination_ignores_orphans_by_their_controller_uid_label() -> None:
    orphan = pod("orphan", owner_uid=None)
    orphan["metadata"]["labels"] = {"batch.kubernetes.io/controller-uid": "old-uid"}
    assert pick_termination([orphan], job_uid=JOB_UID) is None
    assert pick_termination([orphan]) is not None  # no uid given: nothing filtered


def test_pick_termination_prefers_the_worker_container_among_several() -> None:
    the_pod = pod("p")
    the_pod["status"]["containerStatuses"].insert(
        0, {"name": "sidecar", "state": {"terminated": {"exitCode": 0, "message": "sidecar says hi"}}}
    )
    termination = pick_termination([the_pod])
    assert termination is not None and termination.message == OK_JSON


def test_pick_termination_reads_what_the_python_client_serialises() -> None:
    finished = dt.datetime(2024, 5, 1, 10, tzinfo=dt.UTC)
    model = k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(name="kd-x-abcde"),
        status=k8s.V1PodStatus(
            phase="Succeeded",
            container_statuses=[
                k8s.V1ContainerStatus(
                    name="worker",
                    image="img",
                    image_id="",
                    ready=False,
                    restart_count=0,
                    state=k8s.V1ContainerState(
                        terminated=k8s.V1ContainerStateTerminated(
                            exit_code=0, reason="Completed", message=OK_JSON, finished_at=finished
                        )
                    ),
                )
            ],
        ),
    )
    with k8s.ApiClient() as api:
        as_dict = api.sanitize_for_serialization(model)
    termination = pick_termination([as_dict])
    assert termination is not None
    assert (termination.pod_name, termination.exit_code, termination.message) == ("kd-x-abcde", 0, OK_JSON)
    assert termination.finished_at == finished and termination.pod_succeeded


@pytest.mark.parametrize(
    ("the_job", "pods", "expected"),
    [
        (job(), [pod("a", running=True)], None),
        (job(condition("Complete")), [pod("a")], Completion(succeeded=True, output={"words": 3})),
        (
            job(condition("Complete")),
            [pod("a", message=None)],
            Completion(
                succeeded=False, reason=RESULT_MISSING, detail="the container exited 0 without writing a result"
            ),
        ),
        (
            job(condition("Complete")),
            [],  # the pod is gone: the result is lost (the work runs again), not missing
            Completion(succeeded=False, reason=RESULT_LOST, detail=LOST),
        ),
        (
            job(condition("Complete")),
            [pod("a", exit_code=1, message="log tail")],  # only a failed pod left: its log is no result
            Completion(succeeded=False, reason=RESULT_LOST, detail=LOST),
        ),
        (
            job(condition("Complete")),
            [pod("stale", owner_uid="other-uid")],  # an earlier Job's pod of the same name holds no result of this one
            Completion(succeeded=False, reason=RESULT_LOST, detail=LOST),
        ),
        (job(condition("Complete")), [pod("a", message="oops")], "ResultNotJson"),
        (
            job(condition("Failed", reason="BackoffLimitExceeded", message="backoff")),
            [pod("a", exit_code=1, message="Traceback...\nValueError: bad")],
            Completion(succeeded=False, reason="BackoffLimitExceeded", detail="Traceback...\nValueError: bad"),
        ),
        (
            job(
                condition("Failed", reason="DeadlineExceeded", message="Job was active longer than specified deadline")
            ),
            [],  # pods killed at the deadline and gone
            Completion(
                succeeded=False, reason="DeadlineExceeded", detail="Job was active longer than specified deadline"
            ),
        ),
        (
            job(condition("Failed", reason="DeadlineExceeded", message="deadline")),
            [pod("a", running=True)],
            Completion(succeeded=False, reason="DeadlineExceeded", detail="deadline"),
        ),
        (
            job(condition("Complete")),
            [pod("stale", owner_uid="other-uid", message='{"stale":true}'), pod("mine")],
            Completion(succeeded=True, output={"words": 3}),
        ),
        (
            job(deleting=True),
            [],
            Completion(succeeded=False, reason=JOB_DELETED, detail="the Job was deleted before it finished"),
        ),
    ],
)
def test_completion(the_job: dict[str, Any], pods: list[dict[str, Any]], expected: Completion | str | None) -> None:
    got = completion(the_job, pods)
    if isinstance(expected, str):
        assert got is not None and not got.succeeded and got.reason == expected
    else:
        assert got == expected
    # Only a succeeded Job whose result went with its Pod is re-run; everything else is recorded.
    assert (got is not None and got.lost) == (isinstance(expected, Completion) and expected.reason == RESULT_LOST)
