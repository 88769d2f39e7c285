"""Table tests of `context_from_job`: a Job is delivered only if its labels agree with the DB."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

import pytest

from k8s_dispatch.core.errors import LabelMismatch, TenancyMismatch, UnknownDispatch
from k8s_dispatch.delivery.reconstruct import DispatchRecord, context_from_job
from k8s_dispatch.store.models import DispatchState
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.manifest import FINALIZER, job_name
from k8s_dispatch.workers.types import DispatchRef

DISPATCH_ID = "0b8e4c52-6b1f-4d5e-9a57-3f2d1c0e9b7a"
OTHER_ID = "5d0c0a4e-2f3b-4c1d-8e9f-a0b1c2d3e4f5"
LONG_KEY = "order/" + "x" * 200  # not a label value: carried hashed, in full in an annotation

RECORD = DispatchRecord(
    dispatch_id=DISPATCH_ID,
    case_id="case-1",
    tenancy_id="tenant-a",
    capability="demo.wordcount",
    worker_name="demo-text",
    idempotency_key=LONG_KEY,
    state=DispatchState.CREATED,
    input={"text": "a b"},
    job_name=job_name(DISPATCH_ID),
    job_namespace="jobs",
    attempts=0,
)


def job_for(
    ref: DispatchRef,
    *,
    name: str | None = None,
    namespace: str = "jobs",
    finalizers: list[str] | None = None,
    extra_annotations: dict[str, str] | None = None,
    label_overrides: dict[str, str] | None = None,
    deleting: bool = False,
) -> dict[str, Any]:
    labels, annotations = job_labels.encode(ref)
    labels.update(label_overrides or {})
    annotations.update(extra_annotations or {})
    metadata: dict[str, Any] = {
        "name": name or job_name(ref.dispatch_id),
        "namespace": namespace,
        "labels": labels,
        "annotations": annotations,
        "finalizers": [FINALIZER] if finalizers is None else finalizers,
    }
    if deleting:
        metadata["deletionTimestamp"] = "2024-11-29T10:00:00Z"
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata}


def test_a_matching_job_gives_the_full_context():
    job = job_for(RECORD.ref, extra_annotations={job_labels.ATTEMPT_KEY: "2"})
    context = context_from_job(job, RECORD)
    assert context.ref == RECORD.ref
    assert context.dispatch_id == DISPATCH_ID
    assert context.record is RECORD
    assert (context.namespace, context.job_name) == ("jobs", job_name(DISPATCH_ID))
    assert context.attempt == 2
    assert context.has_finalizer and not context.deleting
    # The hashed idempotency key came back whole from its annotation.
    assert context.ref.idempotency_key == LONG_KEY


def test_a_job_without_our_finalizer_being_deleted_is_still_matched():
    context = context_from_job(job_for(RECORD.ref, finalizers=["other/x"], deleting=True), RECORD)
    assert not context.has_finalizer and context.deleting


def test_namespace_unrecorded_falls_back_to_the_expected_one():
    record = replace(RECORD, job_namespace=None, job_name=None, state=DispatchState.SCHEDULED)
    assert (
        context_from_job(job_for(RECORD.ref, namespace="jobs"), record, expected_namespace="jobs").namespace == "jobs"
    )
    with pytest.raises(LabelMismatch, match="not in namespace 'jobs'"):
        context_from_job(job_for(RECORD.ref, namespace="elsewhere"), record, expected_namespace="jobs")
    # Nothing recorded and nothing expected: any namespace the poll lists is accepted.
    assert context_from_job(job_for(RECORD.ref, namespace="elsewhere"), record).namespace == "elsewhere"


def test_a_job_without_a_namespace_is_refused_when_none_is_recorded_or_expected():
    record = replace(RECORD, job_namespace=None, job_name=None, state=DispatchState.SCHEDULED)
    job = job_for(RECORD.ref)
    del job["metadata"]["namespace"]
    with pytest.raises(LabelMismatch, match="has no namespace"):
        context_from_job(job, record)


# (what the Job's labels claim, how the Job differs, the error, a fragment of its message)
REFUSALS = [
    ("tenancy differs", job_for(replace(RECORD.ref, tenancy_id="tenant-b")), TenancyMismatch, "tenancy 'tenant-b'"),
    ("tenancy differs in case only", job_for(replace(RECORD.ref, tenancy_id="Tenant-A")), TenancyMismatch, "Tenant-A"),
    ("case differs", job_for(replace(RECORD.ref, case_id="case-2")), LabelMismatch, "case_id 'case-2'"),
    ("capability differs", job_for(replace(RECORD.ref, capability="demo.sha256")), LabelMismatch, "capability"),
    ("worker differs", job_for(replace(RECORD.ref, worker_name="demo-math")), LabelMismatch, "worker_name"),
    (
        "idempotency key differs",
        job_for(replace(RECORD.ref, idempotency_key="other")),
        LabelMismatch,
        "idempotency_key",
    ),
    (
        "names another dispatch",
        job_for(replace(RECORD.ref, dispatch_id=OTHER_ID), name=job_name(DISPATCH_ID)),
        LabelMismatch,
        OTHER_ID,
    ),
    ("not the dispatch's job name", job_for(RECORD.ref, name="kd-copy"), LabelMismatch, "kd-copy"),
    (
        "another namespace than recorded",
        job_for(RECORD.ref, namespace="default"),
        LabelMismatch,
        "not in namespace 'jobs'",
    ),
    (
        "not managed by us",
        job_for(RECORD.ref, label_overrides={job_labels.MANAGED_BY_LABEL: "helm"}),
        LabelMismatch,
        "managed-by",
    ),
    (
        "hashed label without its annotation",
        {**job_for(RECORD.ref), "metadata": {**job_for(RECORD.ref)["metadata"], "annotations": {}}},
        LabelMismatch,
        "annotation",
    ),
    (
        "annotation disagrees with its hashed label",
        job_for(RECORD.ref, extra_annotations={job_labels.IDEMPOTENCY_KEY_KEY: "forged"}),
        LabelMismatch,
        "not the hash",
    ),
    (
        "plain label disagrees with an annotation",
        job_for(RECORD.ref, extra_annotations={job_labels.TENANCY_ID_KEY: "tenant-b"}),
        LabelMismatch,
        "disagrees",
    ),
    (
        "no labels at all",
        {"metadata": {"name": job_name(DISPATCH_ID), "namespace": "jobs"}},
        LabelMismatch,
        "managed-by",
    ),
    (
        "bad attempt annotation",
        job_for(RECORD.ref, extra_annotations={job_labels.ATTEMPT_KEY: "-1"}),
        LabelMismatch,
        "attempt",
    ),
]


@pytest.mark.parametrize(("job", "error", "fragment"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_a_job_disagreeing_with_the_db_is_refused(job, error, fragment):
    with pytest.raises(error) as raised:
        context_from_job(job, RECORD)
    assert fragment in str(raised.value)
    assert raised.value.reason == error.reason


def test_a_job_whose_dispatch_does_not_exist_is_refused():
    with pytest.raises(UnknownDispatch, match=DISPATCH_ID):
        context_from_job(job_for(RECORD.ref), None)


def test_record_from_row_reads_every_field():
    class Row:  # the attributes of store.models.Dispatch
        dispatch_id = DISPATCH_ID
        case_id = "case-1"
        tenancy_id = "tenant-a"
        capability = "demo.wordcount"
        worker_name = "demo-text"
        idempotency_key = LONG_KEY
        state = "COMPLETED"
        input: ClassVar[dict[str, str]] = {"text": "a b"}
        job_name = job_name(DISPATCH_ID)
        job_namespace = "jobs"
        attempts = 1
        notified_at = None

    record = DispatchRecord.from_row(Row())
    assert record.state is DispatchState.COMPLETED and record.terminal
    assert record.ref == RECORD.ref
    assert (record.attempts, record.notified) == (1, False)
