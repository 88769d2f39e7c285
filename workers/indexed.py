"""A map dispatch as an Indexed Job (pure): the dispatch's Job (`workers.manifest.build_job`) made
into one Pod per item, and what an Indexed Job's status and Pods say about each item.

The Job keeps everything `build_job` gives every Job (name from the dispatch id, our finalizer
on it and its Pods, self-describing labels, the security defaults) and becomes `completionMode:
Indexed` with `completions` = items, the map's `parallelism`, the capability's `backoffLimit` per
index (`backoffLimitPerIndex`: an item's retries never spend another's) and `maxFailedIndexes`.
The capability's `failOnExitCodes` fail the item (`FailIndex`), not the whole map.

Inputs, with an object store: once they are more than a few KiB (`artifacts.inputs`), packed into
one object (`container.packing`) whose presigned GET URL and Merkle root the Pod template carries
(`ITEMS_URL_ENV`, `ITEMS_REF_ENV`, under 1 KiB whatever the map's size); each Pod reads and checks
its own item's bytes only. Chosen over a ConfigMap or Secret owned by the Job (one key per index,
mounted) because neither localcluster nor our node agent mounts volumes, such an object is capped
at 1 MiB (a map's inputs would need many, made before the Pods can start), and mounted in full
it would give every Pod every item anyway.

Without a store (the fallback), or for small maps: one JSON array in the Pod template's env
(`ITEMS_ENV`), the runner handing the function the one at its `JOB_COMPLETION_INDEX`. Every Pod
object then carries the whole array, so a map's inputs are capped (`store.maps.MAX_MAP_INPUT_BYTES`,
refused at schedule above it), far under etcd's 1.5 MiB.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from k8s_dispatch.container.contract import INPUT_ENV, ITEMS_REF_ENV, ITEMS_URL_ENV, ItemsDownload, encode_input
from k8s_dispatch.container.runner import INDEX_ENV, ITEMS_ENV
from k8s_dispatch.core.errors import InvalidManifest, LabelMismatch
from k8s_dispatch.workers import labels as job_labels

MAP_LABEL = job_labels.PREFIX + "map"  # on a map's Job and Pods: "true"
ITEMS_ANNOTATION = job_labels.PREFIX + "items"  # the number of items the Job runs
# On a Job made for some of the map's items only (a lost Job's re-creation runs the items still
# open): which item each completion index runs, in order, as intervals ("2,5-9").
ITEM_INDEXES_ANNOTATION = job_labels.PREFIX + "item-indexes"
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
    item_indexes: Sequence[int] | None = None,
    items_download: ItemsDownload | None = None,
) -> dict[str, Any]:
    """`job` (a dispatch's Job from `build_job`) as the Indexed Job of a map over `inputs`.
    `item_indexes`: the map's item each input is (ascending); None or 0..n-1: every item, and
    the Job's completion indexes are the items'. Otherwise the Job names them
    (`ITEM_INDEXES_ANNOTATION`): a lost Job is made again for its open items only.
    `items_download` (`artifacts.inputs.items_download`): `inputs` packed in the object store,
    which the Pods read there; None: they travel in the env.

    Raises:
        InvalidManifest: no items, more than MAX_COMPLETIONS, parallelism / max_failed_items
            out of range (`store.maps` refuses them at schedule: a row edited by hand), or
            `item_indexes` not one ascending index per input, `items_download` packing
            another number of items.
        InputNotSerialisable: an input is not JSON.
    """
    count = len(inputs)
    if not 1 <= count <= MAX_COMPLETIONS:
        raise InvalidManifest(f"a map needs 1 to {MAX_COMPLETIONS} items, not {count}")
    indexes = list(range(count)) if item_indexes is None else list(item_indexes)
    if len(indexes) != count or not _ascending(indexes):
        raise InvalidManifest(f"item indexes {indexes[:10]}... are not one ascending index per input")
    if items_download is not None and items_download.items != count:
        raise InvalidManifest(f"the packed inputs hold {items_download.items} items, the map runs {count}")
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
        if indexes != list(range(count)):
            metadata["annotations"][ITEM_INDEXES_ANNOTATION] = format_intervals(indexes)
    for container in spec["template"]["spec"]["containers"]:
        env = [var for var in container.get("env", []) if var.get("name") != INPUT_ENV]
        if items_download is None:
            container["env"] = [*env, {"name": ITEMS_ENV, "value": encode_input(inputs)}]
        else:
            container["env"] = [
                *env,
                {"name": ITEMS_URL_ENV, "value": items_download.url},
                {"name": ITEMS_REF_ENV, "value": items_download.reference()},
            ]
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


def format_intervals(indexes: Iterable[int]) -> str:
    """Ascending indexes as the Job controller writes them: runs joined ("0-2,5,7-9")."""
    parts: list[str] = []
    run: list[int] = []
    for index in indexes:
        if run and index == run[-1] + 1:
            run.append(index)
            continue
        if run:
            parts.append(_run_text(run))
        run = [index]
    if run:
        parts.append(_run_text(run))
    return ",".join(parts)


def _run_text(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


def _ascending(indexes: Sequence[int]) -> bool:
    return all(i >= 0 for i in indexes[:1]) and all(a < b for a, b in itertools.pairwise(indexes))


def item_indexes(job: Mapping[str, Any]) -> list[int] | None:
    """Which item each completion index of a map's Job (or Pod) runs: the Job's
    `ITEM_INDEXES_ANNOTATION`, or None when the indexes are the items' (no annotation). Read
    strictly, unlike the controller's strings: it decides whose result a Pod's is.

    Raises:
        LabelMismatch: the annotation is not ascending intervals of non-negative indexes, or a
            Job's names another number of items than its `completions` (a hand edit).
    """
    metadata = job.get("metadata") or {}
    text = (metadata.get("annotations") or {}).get(ITEM_INDEXES_ANNOTATION)
    if text is None:
        return None
    where = f"{metadata.get('namespace')}/{metadata.get('name')}"
    indexes: list[int] = []
    try:
        for part in str(text).split(","):
            low, _, high = part.partition("-")
            first, last = int(low), int(high) if high else int(low)
            if not 0 <= first <= last or last - first >= MAX_COMPLETIONS - len(indexes):
                raise ValueError(part)
            indexes.extend(range(first, last + 1))
    except ValueError as e:
        raise LabelMismatch(f"job {where}: annotation {ITEM_INDEXES_ANNOTATION} {text!r} is not intervals: {e}") from e
    if not _ascending(indexes):
        raise LabelMismatch(f"job {where}: annotation {ITEM_INDEXES_ANNOTATION} {text!r} is not ascending")
    completions = (job.get("spec") or {}).get("completions")
    if completions is not None and completions != len(indexes):
        raise LabelMismatch(
            f"job {where}: annotation {ITEM_INDEXES_ANNOTATION} names {len(indexes)} items; the Job runs {completions}"
        )
    return indexes


def item_of(indexes: Sequence[int] | None, index: int | None) -> int | None:
    """The item completion `index` runs, given the Job's `item_indexes` (None: out of range)."""
    if index is None or indexes is None:
        return index
    return indexes[index] if 0 <= index < len(indexes) else None


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


def status_indexes(job: Mapping[str, Any], indexes: Sequence[int] | None = None) -> tuple[set[int], set[int]]:
    """The items the Job counts completed and failed, from its status: its completion indexes
    through `indexes` (the Job's `item_indexes`; None: the same)."""
    status = job.get("status") or {}

    def items(text: object) -> set[int]:
        return {i for i in (item_of(indexes, c) for c in parse_intervals(text)) if i is not None}

    return items(status.get("completedIndexes")), items(status.get("failedIndexes"))
