"""Rebuild a delivery's context from a Job and its dispatch row, trusting neither blindly (pure).

After any restart the Job's labels say which dispatch it ran; the database says what that
dispatch is. `context_from_job` accepts the Job only if both agree on everything the labels
carry (dispatch id, tenancy, case, capability, worker, idempotency key) and on where the Job
is; otherwise it refuses with a typed error, and such a Job is never delivered.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from k8s_dispatch.core.errors import LabelMismatch, TenancyMismatch, UnknownDispatch
from k8s_dispatch.store.models import TERMINAL_STATES, DispatchState
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.indexed import is_map_job, item_indexes
from k8s_dispatch.workers.manifest import FINALIZER, job_name
from k8s_dispatch.workers.types import (
    CapabilityName,
    CaseId,
    DispatchId,
    DispatchRef,
    IdempotencyKey,
    TenancyId,
    WorkerName,
)


@dataclass(frozen=True)
class DispatchRecord:
    """What delivery needs of a `dispatches` row, read in one transaction and used after it."""

    dispatch_id: str
    case_id: str
    tenancy_id: str
    capability: str
    worker_name: str
    idempotency_key: str
    state: DispatchState
    input: Any = None
    job_name: str | None = None
    job_namespace: str | None = None
    attempts: int = 0
    notified: bool = False

    @classmethod
    def from_row(cls, row: Any) -> DispatchRecord:
        """From an `store.models.Dispatch` (or anything with its attributes).

        Field by field, like store/dispatches._dispatch_row in the other direction: each field
        says how the row's value becomes the record's (the state parsed, attempts defaulted,
        `notified` from a time)."""
        return cls(
            dispatch_id=row.dispatch_id,
            case_id=row.case_id,
            tenancy_id=row.tenancy_id,
            capability=row.capability,
            worker_name=row.worker_name,
            idempotency_key=row.idempotency_key,
            state=DispatchState(row.state),
            input=row.input,
            job_name=row.job_name,
            job_namespace=row.job_namespace,
            attempts=row.attempts or 0,
            notified=getattr(row, "notified_at", None) is not None,
        )

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def ref(self) -> DispatchRef:
        return DispatchRef(
            dispatch_id=DispatchId(self.dispatch_id),
            case_id=CaseId(self.case_id),
            tenancy_id=TenancyId(self.tenancy_id),
            capability=CapabilityName(self.capability),
            worker_name=WorkerName(self.worker_name),
            idempotency_key=IdempotencyKey(self.idempotency_key),
        )


@dataclass(frozen=True)
class DeliveryContext:
    """A Job matched to its dispatch: everything the completion path needs."""

    ref: DispatchRef
    record: DispatchRecord
    namespace: str
    job_name: str
    attempt: int
    has_finalizer: bool
    deleting: bool

    @property
    def dispatch_id(self) -> str:
        return self.ref.dispatch_id


def context_from_job(
    job: Mapping[str, Any],
    record: DispatchRecord | None,
    *,
    expected_namespace: str | None = None,
) -> DeliveryContext:
    """Match a Job (API dict) with the row of the dispatch its labels name.

    `record` is the row for the dispatch id the labels carry (None: no such row).
    `expected_namespace` is where the dispatch's Job belongs when the row has not recorded
    it yet (the capability's namespace).

    Raises:
        LabelMismatch: the labels are unreadable or disagree with the row (dispatch id, case,
            capability, worker, idempotency key), or the Job is not where the dispatch's Job
            is (another name or namespace: a copy), or a map's Job's item indexes are
            unreadable.
        UnknownDispatch: no dispatch has the id the labels carry.
        TenancyMismatch: the labels' tenancy is not the dispatch's.
    """
    metadata = job.get("metadata") or {}
    ref = job_labels.decode(metadata.get("labels"), metadata.get("annotations"))
    if record is None:
        raise UnknownDispatch(f"job {_where(metadata)} names dispatch {ref.dispatch_id}, which does not exist")
    if ref.dispatch_id != record.dispatch_id:
        raise LabelMismatch(f"job {_where(metadata)} names dispatch {ref.dispatch_id}, not {record.dispatch_id}")
    if ref.tenancy_id != record.tenancy_id:
        # Exact comparison: "Tenant-A" and "tenant-a" are different tenancies.
        raise TenancyMismatch(
            f"job {_where(metadata)} carries tenancy {ref.tenancy_id!r}; dispatch {record.dispatch_id} "
            f"belongs to {record.tenancy_id!r}"
        )
    for field in ("case_id", "capability", "worker_name", "idempotency_key"):
        carried, recorded = getattr(ref, field), getattr(record, field)
        if carried != recorded:
            raise LabelMismatch(
                f"job {_where(metadata)} carries {field} {carried!r}; dispatch {record.dispatch_id} has {recorded!r}"
            )
    name, namespace = metadata.get("name"), metadata.get("namespace")
    if name != job_name(record.dispatch_id):
        raise LabelMismatch(
            f"job {_where(metadata)} is not dispatch {record.dispatch_id}'s Job ({job_name(record.dispatch_id)})"
        )
    belongs_in = record.job_namespace or expected_namespace
    if belongs_in is not None and namespace != belongs_in:
        raise LabelMismatch(
            f"job {_where(metadata)} is not in namespace {belongs_in!r}, where dispatch {record.dispatch_id}'s Job is"
        )
    if not isinstance(namespace, str) or not namespace:  # nothing says where its Pods are, nor to release it
        raise LabelMismatch(f"job {_where(metadata)} has no namespace")
    if is_map_job(job):
        item_indexes(job)  # which item each Pod runs must be readable: it says whose result a Pod's is
    return DeliveryContext(
        ref=ref,
        record=record,
        namespace=namespace,
        job_name=name,
        attempt=job_labels.decode_attempt(metadata.get("annotations")),
        has_finalizer=FINALIZER in (metadata.get("finalizers") or []),
        deleting=metadata.get("deletionTimestamp") is not None,
    )


def _where(metadata: Mapping[str, Any]) -> str:
    return f"{metadata.get('namespace')}/{metadata.get('name')}"
