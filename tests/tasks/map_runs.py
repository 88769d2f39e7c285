"""What the end-to-end map tests share (tests/tasks/test_maps*.py): a simulated map capability
whose items fail by design, scheduling a map through the API, reading its items' outcomes, and
the checks that every item ended once with its own output or failure and nothing is left held."""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection
from typing import Any

from k8s_dispatch import api
from k8s_dispatch.store.db import transaction
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.manifest import FINALIZER
from k8s_dispatch.workers.resolver import CapabilityResolver

SIM = "localcluster.k8s-dispatch.io/"


def map_capability(items: int, failing: Collection[int], duration_ms: int) -> dict[str, Any]:
    """Each index's Pod returns {"i": index} after `duration_ms`; the `failing` ones exit 2 with
    a log line saying so."""
    by_index = {
        str(i): {"outcome": "fail", "exit-code": "2", "log": f"bad item {i}\n"}
        if i in failing
        else {"result": {"i": i}}
        for i in range(items)
    }
    return {
        "worker": "sim",
        "image": "sim:1",
        "backoffLimit": 0,
        "annotations": {SIM + "duration-ms": str(duration_ms), SIM + "by-index": json.dumps(by_index)},
    }


def schedule_map(d: Any, capability: str, items: list[Any], **kwargs: Any) -> str:
    """A map of `capability` over `items` on a new case, through the deployment's producer; its id."""
    with transaction(d.sessions) as session:
        case_id = f"case-{uuid.uuid4().hex[:10]}"
        api.create_case(session, case_id=case_id, tenancy_id="tenant-a")
        result = api.schedule_map_in_session(
            session,
            case_id=case_id,
            tenancy_id="tenant-a",
            capability=capability,
            items=items,
            idempotency_key=f"map-{uuid.uuid4().hex}",
            router=CapabilityResolver.from_settings(d.settings),
            max_input_bytes=d.settings.max_input_bytes,
            via=d.producer,
            **kwargs,
        )
    return result.dispatch_id


def items_of(d: Any, map_id: str) -> list[api.ItemOutcome]:
    with transaction(d.sessions) as session:
        return api.item_outcomes(session, map_id)


def check_items(outcomes: list[api.ItemOutcome], items: int, failing: Collection[int]) -> None:
    """One event per item, each with its own output, or the failure its Pod had (`map_capability`)."""
    assert sorted(o.index for o in outcomes) == list(range(items)), [o.index for o in outcomes]
    for o in outcomes:
        if o.index in failing:
            assert o.event is api.ItemEventType.ITEM_FAILED, o
            assert (o.payload["reason"], o.payload["exit_code"]) == ("ContainerFailed", 2), o
            assert f"bad item {o.index}" in o.payload["message"], o
        else:
            assert o.event is api.ItemEventType.ITEM_COMPLETED, o
            assert o.payload == {"item": o.index, "output": {"i": o.index}}, o


def held_pods(d: Any) -> list[str]:
    """Our Pods that hold our finalizer now."""
    pods = d.kube.list_pods(d.namespace, label_selector=job_labels.selector())
    return [p["metadata"]["name"] for p in pods if FINALIZER in (p["metadata"].get("finalizers") or [])]


def assert_nothing_left(d: Any, *, timeout_s: float = 30) -> None:
    """No Job of ours, and no Pod holding our finalizer (waited for)."""
    d.wait_no_jobs(timeout_s=timeout_s)
    d.wait(lambda: not held_pods(d), timeout_s=timeout_s, what="no Pod holding our finalizer")
