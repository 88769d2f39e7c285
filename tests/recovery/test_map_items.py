"""delivery/items.py's pure decisions: what a map Job's Pods say of each item, the items its end
leaves open, and the map's one terminal event (tables of cases)."""

from __future__ import annotations

from typing import Any

import pytest

from k8s_dispatch.delivery import items
from k8s_dispatch.store import maps
from k8s_dispatch.store.models import EventType, ItemEventType
from k8s_dispatch.workers import indexed

D = "0b8e2f1c-4f5a-4d0e-9a3b-2c1d0e9f8a7b"
UID = "job-uid"


def pod(index: int, phase: str, *, failures: int = 0, ignored: int = 0, message: str | None = None,
        exit_code: int | None = None, reason: str | None = None) -> dict[str, Any]:  # fmt: skip
    terminated: dict[str, Any] = {}
    if phase in ("Succeeded", "Failed"):
        code = exit_code if exit_code is not None else (0 if phase == "Succeeded" else 1)
        terminated = {"exitCode": code, "reason": reason or ("Completed" if code == 0 else "Error")}
        if message is not None:
            terminated["message"] = message
    return {
        "metadata": {
            "name": f"p-{index}-{failures}-{ignored}",
            "annotations": {
                "batch.kubernetes.io/job-completion-index": str(index),
                "batch.kubernetes.io/job-index-failure-count": str(failures),
                "batch.kubernetes.io/job-index-ignored-failure-count": str(ignored),
            },
        },
        "status": {
            "phase": phase,
            "containerStatuses": [{"name": "worker", "state": {"terminated": terminated} if terminated else {}}],
        },
    }


def job(*, completed: str = "", failed: str | None = None, condition: tuple[str, str] | None = None) -> dict[str, Any]:
    status: dict[str, Any] = {"completedIndexes": completed}
    if failed is not None:
        status["failedIndexes"] = failed
    if condition is not None:
        kind, reason = condition
        status["conditions"] = [{"type": kind, "status": "True", "reason": reason}]
    return {"metadata": {"name": "kd-" + D, "uid": UID}, "status": status}


def ends(decided: items.Decided) -> list[tuple[int, str, Any]]:
    return [(e.item_index, e.type.value, e.payload.get("output", e.payload.get("reason"))) for e in decided.ends]


OK = ItemEventType.ITEM_COMPLETED.value
FAILED = ItemEventType.ITEM_FAILED.value


@pytest.mark.parametrize(
    ("the_job", "pods", "ended", "expected", "retried"),
    [
        # a success ends its item with its result; a running Pod says nothing yet
        (job(completed="0"), [pod(0, "Succeeded", message='{"a":1}'), pod(1, "Running")], {}, [(0, OK, {"a": 1})], []),
        # an item already ended is not ended again
        (job(completed="0"), [pod(0, "Succeeded", message='{"a":1}')], {0: OK}, [], []),
        # a failure whose index may run again waits; once the controller gave the index up, it ends it
        (job(), [pod(2, "Failed", message="boom")], {}, [], []),
        (job(failed="2"), [pod(2, "Failed", message="boom", exit_code=3)], {}, [(2, FAILED, "ContainerFailed")], []),
        # a failed Pod whose index ran again (failure or disruption counted) is retried, not an end
        (job(), [pod(1, "Failed"), pod(1, "Running", failures=1)], {}, [], ["p-1-0-0"]),
        (job(), [pod(1, "Failed"), pod(1, "Pending", ignored=1)], {}, [], ["p-1-0-0"]),
        # a success after failures speaks for its index
        (job(completed="1"), [pod(1, "Failed"), pod(1, "Succeeded", failures=1, message="2")], {}, [(1, OK, 2)],
         ["p-1-0-0"]),
        # a success whose result is not JSON fails its item, saying so
        (job(completed="0"), [pod(0, "Succeeded", message="<html>")], {}, [(0, FAILED, "ResultNotJson")], []),
        # the Job ended: a failed Pod's item ends even if its index is not listed failed
        (job(condition=("Failed", "MaxFailedIndexesExceeded")), [pod(4, "Failed", message="x")], {},
         [(4, FAILED, "ContainerFailed")], []),
        # an OOM kill is the item's reason; a Pod with no index, or out of range, is ignored
        (job(failed="0"), [pod(0, "Failed", exit_code=137, reason="OOMKilled"), pod(9, "Succeeded")], {},
         [(0, FAILED, "OOMKilled")], []),
    ],
)  # fmt: skip
def test_what_a_map_jobs_pods_decide(the_job, pods, ended, expected, retried) -> None:
    decided = items.decide(D, the_job, pods, ended, items=5)
    assert ends(decided) == expected
    assert [p["metadata"]["name"] for p in decided.retried] == retried


def test_a_failed_items_end_keeps_its_exit_code_and_message() -> None:
    decided = items.decide(D, job(failed="0"), [pod(0, "Failed", message="bad item\n", exit_code=2)], {}, items=1)
    assert decided.ends == [
        maps.ItemEnd(
            D, 0, ItemEventType.ITEM_FAILED, {"reason": "ContainerFailed", "exit_code": 2, "message": "bad item\n"}
        )
    ]


def test_the_items_a_jobs_end_leaves_open() -> None:
    the_job = job(completed="0-1", failed="2", condition=("Failed", "DeadlineExceeded"))
    shape = maps.MapShape(items=5, parallelism=2, max_failed_items=None, min_succeeded=None)
    open_ends = items.open_item_ends(D, the_job, shape, {0: OK, 2: FAILED})
    assert [(e.item_index, e.payload["reason"]) for e in open_ends] == [
        (1, items.ITEM_RESULT_LOST),  # counted succeeded, no Pod holds its result
        (3, "DeadlineExceeded"),
        (4, "DeadlineExceeded"),
    ]


@pytest.mark.parametrize(
    ("min_succeeded", "condition", "counts", "event", "reason"),
    [
        (None, ("Complete", "CompletionsReached"), {OK: 5}, EventType.WORKER_COMPLETED, None),
        (None, ("Failed", "FailedIndexes"), {OK: 4, FAILED: 1}, EventType.WORKER_FAILED, "ItemsFailed"),
        (4, ("Failed", "FailedIndexes"), {OK: 4, FAILED: 1}, EventType.WORKER_COMPLETED, None),
        (4, ("Failed", "MaxFailedIndexesExceeded"), {OK: 2, FAILED: 3}, EventType.WORKER_FAILED,
         "MaxFailedIndexesExceeded"),
    ],
)  # fmt: skip
def test_the_maps_one_event_says_how_many_and_why(min_succeeded, condition, counts, event, reason) -> None:
    shape = maps.MapShape(items=5, parallelism=2, max_failed_items=None, min_succeeded=min_succeeded)
    ended = items.map_event(D, job(condition=condition), shape, counts)
    summary = {"items": 5, "succeeded": counts.get(OK, 0), "failed": counts.get(FAILED, 0),
               "needed": min_succeeded or 5}  # fmt: skip
    assert ended.type is event
    if event is EventType.WORKER_COMPLETED:
        assert ended.payload == {"output": summary}
    else:
        assert ended.payload["reason"] == reason and ended.payload["detail"] == summary
        assert ended.payload["message"].startswith(f"{summary['succeeded']} of 5 items succeeded")


def test_a_job_made_for_the_open_items_speaks_for_them_by_their_own_indexes() -> None:
    """A lost Job made again for items 1, 3 and 4 only: its completion indexes 0-2 are those items."""
    the_job = job(completed="0", failed="1", condition=("Failed", "DeadlineExceeded"))
    the_job["metadata"]["annotations"] = {indexed.ITEM_INDEXES_ANNOTATION: "1,3-4"}
    pods = [pod(0, "Succeeded", message='{"a":1}'), pod(1, "Failed", message="x", exit_code=2), pod(5, "Succeeded")]
    decided = items.decide(D, the_job, pods, {0: OK, 2: OK}, items=5)
    assert ends(decided) == [(1, OK, {"a": 1}), (3, FAILED, "ContainerFailed")]
    shape = maps.MapShape(items=5, parallelism=2, max_failed_items=None, min_succeeded=None)
    left = items.open_item_ends(D, the_job, shape, {0: OK, 2: OK, 1: OK, 3: FAILED})
    assert [(e.item_index, e.payload["reason"]) for e in left] == [(4, "DeadlineExceeded")]


@pytest.mark.parametrize(
    ("status", "annotation", "ended", "retried", "expected"),
    [
        # a change that ended nothing new reads no Pod
        ({"completedIndexes": "0-2", "failedIndexes": "3"}, None, {0: OK, 1: OK, 2: OK, 3: FAILED}, (), []),
        # only the indexes counted since what is recorded, completed or given up
        ({"completedIndexes": "0-4", "failedIndexes": "6"}, None, {0: OK, 1: OK, 2: OK}, (), [3, 4, 6]),
        # a held failed Pod's index, unless its item ended; out of range is never read
        ({"completedIndexes": "0"}, None, {0: OK}, (0, 5, 99), [5]),
        # a Job made for items 1, 3 and 4: its completion indexes map to them
        ({"completedIndexes": "0-1", "failedIndexes": "2"}, "1,3-4", {1: OK}, (), [1, 2]),
        ({"completedIndexes": "0-2"}, "1,3-4", {}, (7,), [0, 1, 2]),
    ],
)  # fmt: skip
def test_a_running_maps_hand_off_reads_only_the_indexes_that_changed(status, annotation, ended, retried, expected):
    the_job: dict[str, Any] = {"metadata": {"name": "kd-" + D, "uid": UID}, "status": status}
    if annotation is not None:
        the_job["metadata"]["annotations"] = {indexed.ITEM_INDEXES_ANNOTATION: annotation}
    assert items.indexes_to_read(the_job, ended, 10, retried=retried) == expected


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        ({}, 0),
        # the last failed Pod of each index given up is not a retry
        ({"failed": 2, "failedIndexes": "1,4"}, 0),
        ({"failed": 3, "failedIndexes": "1,4"}, 1),
        # failures the controller has let go of but not counted yet count too
        ({"failed": 1, "uncountedTerminatedPods": {"failed": ["u1", "u2"]}, "failedIndexes": "2"}, 2),
        ({"failed": "x"}, 0),
    ],
)
def test_retries_are_seen_in_the_jobs_failure_counter(status, expected) -> None:
    assert items.retried_count({"status": status}) == expected
