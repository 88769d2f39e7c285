"""Disrupted Pods: each recorded once as WORKER_DISRUPTED, and a dispatch disrupted more often than
its capability's `maxDisruptions` failed with reason Disrupted (its Job deleted).

The Job's podFailurePolicy Ignores a disrupted Pod, so the Job's status never counts it (neither
`failed` nor `uncountedTerminatedPods`): the Pod itself, which our finalizer keeps, is the only
trace. Poll finds them with ONE LIST per namespace of our Pods in phase Failed (`scan`: a few
bytes when there are none) and a completing batch in the Pod LIST it makes anyway
(`record_pods`); once recorded, a disrupted Pod is released (its eviction deleted it already,
so it goes), so the next LIST no longer returns it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from k8s_dispatch.core.errors import LabelMismatch, UnknownCapability
from k8s_dispatch.delivery import cleanup, records, terminal
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.disruptions import DisruptionEvent, record_disruptions
from k8s_dispatch.store.models import TERMINAL_STATES
from k8s_dispatch.workers import failure_detail
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.capability import DEFAULT_MAX_DISRUPTIONS
from k8s_dispatch.workers.types import DispatchRef

log = logging.getLogger(__name__)

FAILED_PODS = "status.phase=Failed"


def scan(rt: Runtime, namespace: str) -> list[str]:
    """The look for disruptions in `namespace` (beat's `cleanup` task): ONE LIST (per page) of
    our failed Pods, the disrupted ones recorded (`record_pods`); the dispatches failed as Disrupted.

    Raises:
        Transient: the API or the database is unavailable (the next cleanup looks again).
    """
    pods: list[dict[str, Any]] = []
    for page in rt.kube.iter_pods(
        namespace,
        label_selector=job_labels.selector(rt.settings.effective_deployment),
        field_selector=FAILED_PODS,
        page_size=rt.settings.poll_page_size,
    ):
        pods += page
    return record_pods(rt, namespace, pods)


def record_pods(rt: Runtime, namespace: str, pods: Sequence[Mapping[str, Any]], *, enforce: bool = True) -> list[str]:
    """Record the disrupted Pods among `pods` (one transaction), each once, for the dispatch its
    labels name if the database agrees; with `enforce`, fail each dispatch now disrupted more
    than its `maxDisruptions` (reason Disrupted, its Job deleted); then free the recorded Pods of
    our finalizer. The ids of the dispatches failed.

    Raises:
        Transient: the API or the database is unavailable.
    """
    found = _disrupted(pods)
    if not found:
        return []
    found_records = records.load_records(rt, sorted({ref.dispatch_id for ref, _, _ in found}))
    events: list[DisruptionEvent] = []
    pods_of: dict[str, list[tuple[failure_detail.Disruption, Mapping[str, Any]]]] = {}
    for ref, disruption, pod in found:
        record = found_records.get(ref.dispatch_id)
        if record is None or record.ref != ref:
            log.warning("disrupted pod %s/%s is no dispatch of ours; left alone", namespace, disruption.pod_name)
            continue
        events.append(DisruptionEvent(ref.dispatch_id, disruption.payload()))
        pods_of.setdefault(ref.dispatch_id, []).append((disruption, pod))
    if not events:
        return []
    with transaction(rt.sessions) as session:
        counted = record_disruptions(session, events)
    for dispatch_id, disrupted in counted.items():
        for uid in disrupted.new:
            (disruption,) = [d for d, _ in pods_of[dispatch_id] if d.pod_uid == uid]
            log.info(
                "dispatch %s: pod %s disrupted (%s on node %s); replaced (%d disruption(s))",
                dispatch_id, disruption.pod_name, disruption.reason, disruption.node, disrupted.total,
            )  # fmt: skip
    failed = []
    if enforce:
        for dispatch_id, disrupted in sorted(counted.items()):
            record = found_records[dispatch_id]
            limit = _max_disruptions(rt, record.capability)
            if disrupted.state in TERMINAL_STATES or disrupted.total <= limit:
                continue
            if _fail_disrupted(rt, record, [d for d, _ in pods_of[dispatch_id]], total=disrupted.total, limit=limit):
                failed.append(dispatch_id)
            cleanup.cleanup_job(rt, *records.job_location(rt, record))
    cleanup.release_pods(rt, namespace, [pod for dispatch_id in counted for _, pod in pods_of[dispatch_id]])
    return failed


def _disrupted(
    pods: Iterable[Mapping[str, Any]],
) -> list[tuple[DispatchRef, failure_detail.Disruption, Mapping[str, Any]]]:
    found = []
    for pod in pods:
        disrupted = failure_detail.disruptions([pod])
        if not disrupted:
            continue
        metadata = pod.get("metadata") or {}
        try:
            ref = job_labels.decode(metadata.get("labels"), metadata.get("annotations"))
        except LabelMismatch:
            continue
        found.append((ref, disrupted[0], pod))
    return found


def _max_disruptions(rt: Runtime, capability: str) -> int:
    try:
        return rt.resolver.spec(capability).max_disruptions
    except UnknownCapability:
        return DEFAULT_MAX_DISRUPTIONS


def _fail_disrupted(
    rt: Runtime, record: Any, disrupted: list[failure_detail.Disruption], *, total: int, limit: int
) -> bool:
    message = f"disrupted {total} times, more than the capability's maxDisruptions of {limit}"
    last = max(disrupted, key=lambda d: d.at or "")
    log.warning("dispatch %s: %s (the last: %s on node %s)", record.dispatch_id, message, last.reason, last.node)
    detail = {"disruptions": total, "last_disruption": last.payload()}
    return terminal.fail_dispatch(
        rt, record.dispatch_id, reason=failure_detail.DISRUPTED, message=message, detail=detail
    )
