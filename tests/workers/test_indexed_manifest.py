"""workers/indexed.py: a map dispatch's Indexed Job, and what its status and Pods say of each item (pure)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from k8s_dispatch.container import runner
from k8s_dispatch.container.contract import INPUT_ENV
from k8s_dispatch.core.errors import InvalidManifest, LabelMismatch
from k8s_dispatch.workers import indexed, manifest
from k8s_dispatch.workers.manifest import build_job
from k8s_dispatch.workers.resolver import demo_resolver
from k8s_dispatch.workers.types import (
    CapabilityName,
    CaseId,
    DispatchId,
    DispatchRef,
    IdempotencyKey,
    TenancyId,
    WorkerName,
)

SPEC = replace(demo_resolver().spec("demo.wordcount"), fail_on_exit_codes=(3,), backoff_limit=2)
REF = DispatchRef(
    dispatch_id=DispatchId("0b8e2f1c-4f5a-4d0e-9a3b-2c1d0e9f8a7b"),
    case_id=CaseId("case-42"),
    tenancy_id=TenancyId("acme"),
    capability=CapabilityName("demo.wordcount"),
    worker_name=WorkerName("demo-text"),
    idempotency_key=IdempotencyKey("map-1"),
)
INPUTS = [{"text": "a b"}, {"text": "$(HOME) c"}, 3]


def _job(**kwargs: Any) -> dict[str, Any]:
    base = build_job(REF, input={"map": {"items": 3}}, spec=SPEC, namespace="ns", deployment="d")
    return indexed.indexed_job(base, **{"inputs": INPUTS, "parallelism": 2, "max_failed_items": 1, **kwargs})


def test_the_map_is_one_indexed_job_with_every_jobs_protections() -> None:
    base = build_job(REF, input={"map": {"items": 3}}, spec=SPEC, namespace="ns", deployment="d")
    job = _job()
    spec = job["spec"]
    assert job["metadata"]["name"] == manifest.job_name(REF.dispatch_id)
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 3, 2)
    assert (spec["backoffLimitPerIndex"], spec["maxFailedIndexes"]) == (2, 1) and "backoffLimit" not in spec
    assert [r["action"] for r in spec["podFailurePolicy"]["rules"]] == ["Ignore", "FailIndex"]
    assert job["metadata"]["finalizers"] == spec["template"]["metadata"]["finalizers"] == [manifest.FINALIZER]
    for metadata in (job["metadata"], spec["template"]["metadata"]):
        assert metadata["labels"] == {**base["metadata"]["labels"], indexed.MAP_LABEL: "true"}
        assert metadata["annotations"][indexed.ITEMS_ANNOTATION] == "3"
    (container,) = spec["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert INPUT_ENV not in env and "$" not in env[indexed.ITEMS_ENV]  # never expanded as $(VAR)
    assert json.loads(env[indexed.ITEMS_ENV]) == INPUTS
    assert indexed.is_map_job(job) and not indexed.is_map_job(base)
    assert base["spec"]["backoffLimit"] == 2  # the dispatch's Job is left as it was


def test_parallelism_is_at_most_the_items_and_no_limit_leaves_max_failed_out() -> None:
    spec = _job(parallelism=50, max_failed_items=None)["spec"]
    assert spec["parallelism"] == 3 and "maxFailedIndexes" not in spec


@pytest.mark.parametrize(
    "kwargs",
    [{"inputs": []}, {"parallelism": 0}, {"max_failed_items": 4}, {"max_failed_items": -1}],
)
def test_a_map_no_job_can_carry_is_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidManifest):
        _job(**kwargs)


@pytest.mark.parametrize(
    ("text", "indexes"),
    [
        ("", set()),
        (None, set()),
        ("0", {0}),
        ("1,3-5,7", {1, 3, 4, 5, 7}),
        ("2-1,x,4", {4}),
        ("-3,9", {9}),
    ],
)
def test_interval_strings(text: object, indexes: set[int]) -> None:
    assert indexed.parse_intervals(text) == indexes


@given(st.sets(st.integers(min_value=0, max_value=300)))
def test_intervals_read_back_what_we_write_as_the_controller_does(indexes: set[int]) -> None:
    text = indexed.format_intervals(sorted(indexes))
    assert indexed.parse_intervals(text) == indexes
    assert ",," not in text and (text == "") == (not indexes)


def test_a_job_for_some_items_names_them_and_maps_its_indexes_to_theirs() -> None:
    job = _job(item_indexes=[1, 4, 5], max_failed_items=0)
    spec = job["spec"]
    assert (spec["completions"], spec["parallelism"], spec["maxFailedIndexes"]) == (3, 2, 0)
    for metadata in (job["metadata"], spec["template"]["metadata"]):
        assert metadata["annotations"][indexed.ITEM_INDEXES_ANNOTATION] == "1,4-5"
    assert indexed.item_indexes(job) == [1, 4, 5]
    assert [indexed.item_of([1, 4, 5], i) for i in (0, 1, 2, 3, -1, None)] == [1, 4, 5, None, None, None]
    job["status"] = {"completedIndexes": "0,2", "failedIndexes": "1,7"}
    assert indexed.status_indexes(job, indexed.item_indexes(job)) == ({1, 5}, {4})
    # Every item, in order: the indexes are the items' and the Job names none.
    whole = _job(item_indexes=[0, 1, 2])
    assert indexed.ITEM_INDEXES_ANNOTATION not in whole["metadata"]["annotations"]
    assert indexed.item_indexes(whole) is None and indexed.item_of(None, 7) == 7


@pytest.mark.parametrize("item_indexes", [[0, 1], [2, 1, 3], [1, 1, 2], [-1, 0, 1]])
def test_item_indexes_must_be_one_ascending_index_per_input(item_indexes: list[int]) -> None:
    with pytest.raises(InvalidManifest):
        _job(item_indexes=item_indexes)


@pytest.mark.parametrize("text", ["x", "3-1", "1,1", "4,2", "1,,2", "-1", "0-99999999", "1-4"])
def test_an_unreadable_item_indexes_annotation_is_a_label_mismatch(text: str) -> None:
    job = _job(item_indexes=[1, 4, 5])
    job["metadata"]["annotations"][indexed.ITEM_INDEXES_ANNOTATION] = text  # a hand edit
    with pytest.raises(LabelMismatch):
        indexed.item_indexes(job)


def test_the_runner_hands_the_function_its_own_item(tmp_path: Any) -> None:
    env = {e["name"]: e["value"] for e in _job()["spec"]["template"]["spec"]["containers"][0]["env"]}
    for index, expected in enumerate(INPUTS):
        assert runner.read_input({**env, indexed.INDEX_ENV: str(index)}) == expected
    for bad in ("3", "-1", "x", ""):
        with pytest.raises(runner.RunnerError):
            runner.read_input({**env, indexed.INDEX_ENV: bad})
