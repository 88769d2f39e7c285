"""workers/labels.py: a dispatch's identity as labels and annotations, and refusing tampering."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from k8s_dispatch.core.errors import InvalidInput, LabelMismatch
from k8s_dispatch.core.names import is_label_value, is_qualified_name
from k8s_dispatch.workers import labels
from k8s_dispatch.workers.types import DispatchRef, check_ref
from tests.workers import strategies as S

REF = DispatchRef(
    dispatch_id="0b8e2f1c-4f5a-4d0e-9a3b-2c1d0e9f8a7b",
    case_id="case-42",
    tenancy_id="acme",
    capability="demo.wordcount",
    worker_name="demo-text",
    idempotency_key="order-1001",
)


@pytest.mark.parametrize(
    ("field", "value", "hashed"),
    [
        ("case_id", "case-42", False),
        ("case_id", "a" * 63, False),
        ("case_id", "a" * 64, True),  # too long for a label value
        ("tenancy_id", "acme corp", True),  # space
        ("tenancy_id", "-acme", True),  # must start alphanumeric
        ("tenancy_id", "acme-", True),  # must end alphanumeric
        ("tenancy_id", "Ünïcode", True),
        ("capability", "billing/invoice:render", True),  # valid config name, not a label value
        ("idempotency_key", "order_1001.v2", False),
        ("idempotency_key", "k" * 256, True),
        ("idempotency_key", "h-" + "0" * 40, True),  # looks like a hash: never taken as one
        ("idempotency_key", "h-" + "0" * 39, False),  # not hash-shaped: a plain label
    ],
)
def test_encode_hashes_exactly_the_values_that_cannot_be_labels(field: str, value: str, hashed: bool) -> None:
    ref = replace(REF, **{field: value})
    key = labels.FIELD_KEYS[field]
    encoded_labels, annotations = labels.encode(ref)
    assert all(is_label_value(v) for v in encoded_labels.values())
    if hashed:
        assert encoded_labels[key] == labels.value_hash(value)
        assert labels.is_hashed(encoded_labels[key])
        assert annotations == {key: value}
    else:
        assert encoded_labels[key] == value
        assert annotations == {}
    assert labels.decode(encoded_labels, annotations) == ref


def test_encode_carries_every_field_and_managed_by() -> None:
    encoded_labels, annotations = labels.encode(REF)
    assert encoded_labels == {
        "app.kubernetes.io/managed-by": "k8s-dispatch",
        "k8s-dispatch.io/dispatch-id": REF.dispatch_id,
        "k8s-dispatch.io/case-id": "case-42",
        "k8s-dispatch.io/tenancy-id": "acme",
        "k8s-dispatch.io/capability": "demo.wordcount",
        "k8s-dispatch.io/worker": "demo-text",
        "k8s-dispatch.io/idempotency-key": "order-1001",
    }
    assert annotations == {}
    assert labels.selector() == "app.kubernetes.io/managed-by=k8s-dispatch"


def test_hash_is_stable_and_fits_a_label() -> None:
    value = "x" * 300
    assert labels.value_hash(value) == labels.value_hash(value)
    assert labels.value_hash(value) != labels.value_hash(value + "y")
    assert len(labels.value_hash(value)) == 42 and is_label_value(labels.value_hash(value))


LONG = "tenant with spaces " * 5
GOOD_LABELS, GOOD_ANNOTATIONS = labels.encode(replace(REF, tenancy_id=LONG))
TENANCY = labels.TENANCY_ID_KEY


def _without(mapping: dict[str, str], key: str) -> dict[str, str]:
    return {k: v for k, v in mapping.items() if k != key}


@pytest.mark.parametrize(
    ("case", "job_labels", "job_annotations", "complaint"),
    [
        ("no labels at all", None, None, "managed-by"),
        ("not ours", {**GOOD_LABELS, labels.MANAGED_BY_LABEL: "helm"}, GOOD_ANNOTATIONS, "managed-by"),
        ("label missing", _without(GOOD_LABELS, labels.CASE_ID_KEY), GOOD_ANNOTATIONS, "case-id is missing"),
        ("label empty", {**GOOD_LABELS, labels.CASE_ID_KEY: ""}, GOOD_ANNOTATIONS, "case-id is missing"),
        ("label not a string", {**GOOD_LABELS, labels.CASE_ID_KEY: 42}, GOOD_ANNOTATIONS, "case-id is missing"),
        ("hash without annotation", GOOD_LABELS, {}, "annotation k8s-dispatch.io/tenancy-id is missing"),
        ("annotation edited", GOOD_LABELS, {TENANCY: LONG + "!"}, "not the hash"),
        ("label edited", {**GOOD_LABELS, TENANCY: labels.value_hash("other")}, GOOD_ANNOTATIONS, "not the hash"),
        ("annotation not a string", GOOD_LABELS, {TENANCY: 7}, "not a string"),
        (
            "annotation disagrees with a plain label",
            GOOD_LABELS,
            {**GOOD_ANNOTATIONS, labels.CASE_ID_KEY: "case-43"},
            "disagrees",
        ),
        ("dispatch id not a uuid", {**GOOD_LABELS, labels.DISPATCH_ID_KEY: "job-1"}, GOOD_ANNOTATIONS, "dispatch_id"),
        (
            "dispatch id in capitals",
            {**GOOD_LABELS, labels.DISPATCH_ID_KEY: REF.dispatch_id.upper()},
            GOOD_ANNOTATIONS,
            "dispatch_id",
        ),
        (
            "annotated value not printable",
            {**GOOD_LABELS, TENANCY: labels.value_hash("a\tb")},
            {TENANCY: "a\tb"},
            "tenancy_id",
        ),
        (
            "annotated key too long",
            {**GOOD_LABELS, labels.IDEMPOTENCY_KEY_KEY: labels.value_hash("k" * 257)},
            {**GOOD_ANNOTATIONS, labels.IDEMPOTENCY_KEY_KEY: "k" * 257},
            "idempotency_key",
        ),
    ],
)
def test_decode_refuses(case: str, job_labels: object, job_annotations: object, complaint: str) -> None:
    with pytest.raises(LabelMismatch, match=complaint):
        labels.decode(job_labels, job_annotations)  # type: ignore[arg-type]


def test_decode_accepts_an_annotation_that_agrees_with_a_plain_label() -> None:
    annotations = {**GOOD_ANNOTATIONS, labels.CASE_ID_KEY: REF.case_id}
    assert labels.decode(GOOD_LABELS, annotations) == replace(REF, tenancy_id=LONG)


def test_decode_ignores_labels_and_annotations_of_others() -> None:
    extra_labels = {**GOOD_LABELS, "team": "search", "batch.kubernetes.io/job-name": "kd-x"}
    extra_annotations = {**GOOD_ANNOTATIONS, "owner": "me"}
    assert labels.decode(extra_labels, extra_annotations) == replace(REF, tenancy_id=LONG)


@pytest.mark.parametrize(
    ("annotations", "expected"),
    [({}, 0), (None, 0), ({labels.ATTEMPT_KEY: "0"}, 0), ({labels.ATTEMPT_KEY: "3"}, 3)],
)
def test_decode_attempt(annotations: dict[str, str] | None, expected: int) -> None:
    assert labels.decode_attempt(annotations) == expected


@pytest.mark.parametrize("raw", ["-1", "x", "", "1.5", "٣", "1" * 10, 3])
def test_decode_attempt_refuses(raw: object) -> None:
    with pytest.raises(LabelMismatch, match="attempt"):
        labels.decode_attempt({labels.ATTEMPT_KEY: raw})  # type: ignore[dict-item]


@given(S.refs)
def test_valid_refs_round_trip(ref: DispatchRef) -> None:
    encoded_labels, annotations = labels.encode(ref)
    assert labels.decode(encoded_labels, annotations) == ref


@given(S.refs_any)
def test_any_ref_encodes_to_valid_metadata_and_decodes_back_iff_valid(ref: DispatchRef) -> None:
    encoded_labels, annotations = labels.encode(ref)
    assert all(is_qualified_name(k) and is_label_value(v) for k, v in encoded_labels.items())
    assert all(is_qualified_name(k) for k in annotations)
    assert set(annotations) <= set(encoded_labels)
    try:
        check_ref(ref)
    except InvalidInput:  # then decoding must refuse it
        with pytest.raises(LabelMismatch):
            labels.decode(encoded_labels, annotations)
    else:
        assert labels.decode(encoded_labels, annotations) == ref


@given(S.refs, st.sampled_from(sorted(labels.FIELD_KEYS.values())), st.text(min_size=1, max_size=80))
def test_changing_any_one_label_or_annotation_is_refused_or_changes_the_ref(
    ref: DispatchRef, key: str, new_value: str
) -> None:
    encoded_labels, annotations = labels.encode(ref)
    target = annotations if key in annotations else encoded_labels
    if target[key] == new_value:
        return
    target[key] = new_value
    try:
        decoded = labels.decode(encoded_labels, annotations)
    except LabelMismatch:
        return
    # Accepted only if the edit was a consistent plain-label rewrite: then it reads back as is.
    assert decoded != ref
    assert getattr(decoded, {v: f for f, v in labels.FIELD_KEYS.items()}[key]) == new_value
