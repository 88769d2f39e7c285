"""A dispatch's row as delivery reads it (a snapshot, no ORM object), and where its Job is."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from k8s_dispatch.core.errors import LabelMismatch, Permanent, TenancyMismatch, UnknownCapability, UnknownDispatch
from k8s_dispatch.delivery import stats
from k8s_dispatch.delivery.reconstruct import DeliveryContext, DispatchRecord, context_from_job
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.store import dispatches
from k8s_dispatch.store.db import transaction
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.manifest import job_name

log = logging.getLogger(__name__)


def load_record(rt: Runtime, dispatch_id: str) -> DispatchRecord | None:
    """The dispatch's row as a snapshot, or None if there is no such dispatch."""
    return load_records(rt, [dispatch_id]).get(dispatch_id)


def load_records(rt: Runtime, dispatch_ids: Sequence[str]) -> dict[str, DispatchRecord]:
    """Snapshots of the dispatches among `dispatch_ids` that exist, by id: one query (per
    QUERY_BATCH ids) of plain rows, no ORM objects."""
    with transaction(rt.sessions) as session:
        return {d: DispatchRecord.from_row(row) for d, row in dispatches.dispatch_rows(session, dispatch_ids).items()}


def job_location(rt: Runtime, record: DispatchRecord) -> tuple[str, str]:
    """(namespace, name) of the dispatch's Job: recorded, else where it would be created."""
    if record.job_namespace is not None:
        return record.job_namespace, record.job_name or job_name(record.dispatch_id)
    try:
        namespace = rt.namespace_for(record.capability)
    except UnknownCapability:
        namespace = rt.settings.namespace
    return namespace, job_name(record.dispatch_id)


def refuse_job(rt: Runtime, job: Mapping[str, Any], error: Permanent) -> None:
    """A Job that is never delivered (labels unreadable or disagreeing with the database): logged and counted."""
    metadata = job.get("metadata") or {}
    log.warning(
        "never delivering job %s/%s: %s: %s", metadata.get("namespace"), metadata.get("name"), error.reason, error
    )
    rt.stats.incr(stats.JOBS_REFUSED)


def contexts_of(rt: Runtime, jobs: Sequence[Mapping[str, Any]]) -> list[DeliveryContext | None]:
    """Each Job matched to its dispatch (the rows read with one query), or None (logged and
    counted) where it must not be delivered."""
    refs: list[Any] = []
    for job in jobs:
        metadata = job.get("metadata") or {}
        try:
            refs.append(job_labels.decode(metadata.get("labels"), metadata.get("annotations")))
        except LabelMismatch as e:
            refs.append(e)
    records = load_records(rt, [ref.dispatch_id for ref in refs if not isinstance(ref, LabelMismatch)])
    contexts: list[DeliveryContext | None] = []
    for job, ref in zip(jobs, refs, strict=True):
        try:
            if isinstance(ref, LabelMismatch):
                raise ref
            record = records.get(ref.dispatch_id)
            expected = None
            if record is not None and record.job_namespace is None:
                expected = job_location(rt, record)[0]
            contexts.append(context_from_job(job, record, expected_namespace=expected))
        except (LabelMismatch, TenancyMismatch, UnknownDispatch) as e:
            refuse_job(rt, job, e)
            contexts.append(None)
    return contexts
