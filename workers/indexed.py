"""A map dispatch as an Indexed Job (pure): the dispatch's Job (`workers.manifest.build_job`) made
into one Pod per item, and what an Indexed Job's status and Pods say about each item.

The Job keeps everything `build_job` gives every Job (name from the dispatch id, our finalizer
on it and its Pods, self-describing labels, the security defaults) and becomes `completionMode:
Indexed` with `completions` = items, the map's `parallelism`, the capability's `backoffLimit` per
index (`backoffLimitPerIndex`: an item's retries never spend another's) and `maxFailedIndexes`.
The capability's `failOnExitCodes` fail the item (`FailIndex`), not the whole map.

Inputs: the items' inputs travel as one JSON array in the Pod template's env (`ITEMS_ENV`) and
the runner hands the function the one at its `JOB_COMPLETION_INDEX`. Chosen over a ConfigMap
owned by the Job (one key per index, mounted) because neither localcluster nor our node agent
has ConfigMaps or volumes, and the template needs no second object to exist before the Pods
start; the price is that every Pod object carries the whole array, so a map's inputs are capped
(`store.maps.MAX_MAP_INPUT_BYTES`, refused at schedule above it), far under etcd's 1.5 MiB.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

from k8s_dispatch.container.contract import INPUT_ENV, encode_input
from k8s_dispatch.container.runner import INDEX_ENV, ITEMS_ENV
from k8s_dispatch.core.errors import InvalidManifest
from k8s_dispatch.workers import labels as job_labels

MAP_LABEL = job_labels.PREFIX + "map"  # on a map's Job and Pods: "true"
ITEMS_ANNOTATION = job_labels.PREFIX + "items"  # the number of items
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"  # the Job controller's, on each Pod
FAILURE_COUNT = "batch.kubernetes.io/job-index-failure-count"
MAX_COMPLETIONS = 100_000  # the API's limit with backoffLimitPerIndex
__all__ = ["INDEX_ENV", "ITEMS_ENV"]


def indexed_job(
    job: Mapping[str, Any],
    *,
    inputs: list[Any],
    parallelism: int,
    max_failed_items: int | None,
) -> dict[str, Any]:
    """`job` (a dispatch's Job from `build_job`) as the Indexed Job of a map over `inputs`.

    Raises:
        InvalidManifest: no items, more than MAX_COMPLETIONS, or parallelism / max_failed_items
            out of range (`store.maps` refuses them at schedule: a row edited by hand).
        InputNotSerialisable: an input is not JSON.
    """
    count = len(inputs)
    if not 1 <= count <= MAX_COMPLETIONS:
        raise InvalidManifest(f"a map needs 1 to {MAX_COMPLETIONS} items, not {count}")
    if parallelism < 1:
        raise InvalidManifest(f"parallelism {parallelism} is not positive")
    if max_failed_items is not None and not 0 <= max_failed_items <= count:
        raise InvalidManifest(f"max_failed_items {max_failed_items} is not from 0 to {count}")
    body = copy.deepcopy(dict(job))
    spec = body["spec"]
    spec["completionMode"] = "Indexed"
    spec["completions"] = count
    spec["parallelism"] = min(parallelism, count)
    spec["backoffLimitPerIndex"] = spec.pop("backoffLimit")
    if max_failed_items is not None:
        spec["maxFailedIndexes"] = max_failed_items
    for rule in spec.get("podFailurePolicy", {}).get("rules", []):
        if rule.get("action") == "FailJob":  # one bad item fails itself, not the map
            rule["action"] = "FailIndex"
    for metadata in (body["metadata"], spec["template"]["metadata"]):
        metadata["labels"][MAP_LABEL] = "true"
        metadata["annotations"][ITEMS_ANNOTATION] = str(count)
    for container in spec["template"]["spec"]["containers"]:
        env = [var for var in container.get("env", []) if var.get("name") != INPUT_ENV]
        container["env"] = [*env, {"name": ITEMS_ENV, "value": encode_input(inputs)}]
    return body


def is_map_job(job: Mapping[str, Any]) -> bool:
    """Whether a Job (or a Pod) is a map's, by its label."""
    return ((job.get("metadata") or {}).get("labels") or {}).get(MAP_LABEL) == "true"


def parse_intervals(text: object) -> set[int]:
    """The indexes of a `completedIndexes` / `failedIndexes` string ("1,3-5"); malformed parts
    are skipped (the API server writes them, but nothing here trusts the cluster blindly)."""
    found: set[int] = set()
    if not isinstance(text, str):
        return found
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        try:
            first = int(low)
            last = int(high) if high else first
        except ValueError:
            continue
        if 0 <= first <= last and last - first <= MAX_COMPLETIONS:
            found.update(range(first, last + 1))
    return found


def pod_index(pod: Mapping[str, Any]) -> int | None:
    """The completion index the Job controller gave a Pod, or None."""
    text = ((pod.get("metadata") or {}).get("annotations") or {}).get(COMPLETION_INDEX)
    try:
        index = int(str(text))
    except ValueError:
        return None
    return index if index >= 0 else None


def failure_count(pod: Mapping[str, Any]) -> int:
    """How many Pods of its index failed before this one (the Job controller's annotation)."""
    try:
        return max(0, int(str(((pod.get("metadata") or {}).get("annotations") or {}).get(FAILURE_COUNT, "0"))))
    except ValueError:
        return 0


def status_indexes(job: Mapping[str, Any]) -> tuple[set[int], set[int]]:
    """The Job's completed and failed indexes, from its status."""
    status = job.get("status") or {}
    return parse_intervals(status.get("completedIndexes")), parse_intervals(status.get("failedIndexes"))


def latest_by_index(pods: Iterable[Mapping[str, Any]]) -> dict[int, int]:
    """For each index, the highest failure count among its Pods: a Pod below it was retried."""
    latest: dict[int, int] = {}
    for pod in pods:
        index = pod_index(pod)
        if index is not None:
            latest[index] = max(latest.get(index, 0), failure_count(pod))
    return latest
