"""A dispatch's identity as Kubernetes labels and annotations, and back (pure).

Each `DispatchRef` field becomes a label under `k8s-dispatch.io/`, beside the deployment's
(`DEPLOYMENT_LABEL`), which every selector names. A value that is not a valid
label value (too long, bad characters), or that looks like one of our hashes, is carried as
`h-` + 40 hex digits of its SHA-256 instead, with the full value in an annotation under the
same key. `decode` refuses a Job whose labels are missing, malformed or disagree with it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping

from k8s_dispatch.core.errors import LabelMismatch
from k8s_dispatch.core.ids import is_dispatch_id, is_engine_id, is_idempotency_key
from k8s_dispatch.core.names import is_label_value
from k8s_dispatch.workers.types import (
    CapabilityName,
    CaseId,
    DispatchId,
    DispatchRef,
    IdempotencyKey,
    TenancyId,
    WorkerName,
)

PREFIX = "k8s-dispatch.io/"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "k8s-dispatch"

DISPATCH_ID_KEY = PREFIX + "dispatch-id"
CASE_ID_KEY = PREFIX + "case-id"
TENANCY_ID_KEY = PREFIX + "tenancy-id"
CAPABILITY_KEY = PREFIX + "capability"
WORKER_KEY = PREFIX + "worker"
IDEMPOTENCY_KEY_KEY = PREFIX + "idempotency-key"
# Which deployment (database and key prefix) made the Job: every selector names it, so two
# deployments sharing a namespace never list, deliver or delete each other's Jobs.
DEPLOYMENT_LABEL = PREFIX + "deployment"
ATTEMPT_KEY = PREFIX + "attempt"  # annotation: which re-creation of the Job this is
# Set (with our finalizer removed, in the same patch) once the Job's dispatch has its terminal
# event: nothing is left to do but delete it, which one bulk delete does for every such Job.
DELIVERED_LABEL = PREFIX + "delivered"
DELIVERED = "true"
# Set on a Pod in the patch that takes our finalizer off it: a running map's hand-off lists its
# Job's succeeded Pods without it (`delivery.items`), the ones whose item may not be recorded yet.
RELEASED_LABEL = PREFIX + "released"
RELEASED = "true"

# DispatchRef field -> label key, in a fixed order.
FIELD_KEYS: dict[str, str] = {
    "dispatch_id": DISPATCH_ID_KEY,
    "case_id": CASE_ID_KEY,
    "tenancy_id": TENANCY_ID_KEY,
    "capability": CAPABILITY_KEY,
    "worker_name": WORKER_KEY,
    "idempotency_key": IDEMPOTENCY_KEY_KEY,
}

HASH_PREFIX = "h-"
_HASH_HEX_CHARS = 40  # 160 bits of SHA-256: 42 characters in all, well under 63
_HASHED = re.compile(rf"^{HASH_PREFIX}[0-9a-f]{{{_HASH_HEX_CHARS}}}$")

_VALID = {
    "dispatch_id": is_dispatch_id,
    "case_id": is_engine_id,
    "tenancy_id": is_engine_id,
    "capability": is_engine_id,
    "worker_name": is_engine_id,
    "idempotency_key": is_idempotency_key,
}


def value_hash(value: str) -> str:
    """The label value that stands for `value` when `value` cannot be a label itself."""
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()
    return HASH_PREFIX + digest[:_HASH_HEX_CHARS]


def is_hashed(label_value: str) -> bool:
    return bool(_HASHED.match(label_value))


def needs_hash(value: str) -> bool:
    """True when `value` cannot be its own label: invalid, empty, or shaped like a hash."""
    return not value or not is_label_value(value) or is_hashed(value)


def encode(ref: DispatchRef, *, deployment: str | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """The labels and annotations that identify `ref`'s Job, made by `deployment` (None: no
    deployment label, as Jobs were before it existed).

    Values are not validated here (see `workers.types.check_ref`); any string encodes to a
    valid label value.
    """
    labels = {MANAGED_BY_LABEL: MANAGED_BY}
    if deployment is not None:
        labels[DEPLOYMENT_LABEL] = deployment
    annotations: dict[str, str] = {}
    for field, key in FIELD_KEYS.items():
        value: str = getattr(ref, field)
        if needs_hash(value):
            labels[key] = value_hash(value)
            annotations[key] = value
        else:
            labels[key] = value
    return labels, annotations


def decode(labels: Mapping[str, object] | None, annotations: Mapping[str, object] | None) -> DispatchRef:
    """Rebuild the `DispatchRef` a Job's labels and annotations carry.

    Raises:
        LabelMismatch: not managed by us; a label missing or not a string; a hashed label
            without its annotation or whose hash disagrees with it; an annotation that
            disagrees with a plain label; a value that is not a valid id.
    """
    labels = labels or {}
    annotations = annotations or {}
    if labels.get(MANAGED_BY_LABEL) != MANAGED_BY:
        raise LabelMismatch(f"label {MANAGED_BY_LABEL} is {labels.get(MANAGED_BY_LABEL)!r}, not {MANAGED_BY!r}")
    values = {field: _decode_one(key, labels, annotations) for field, key in FIELD_KEYS.items()}
    for field, value in values.items():
        if not _VALID[field](value):
            raise LabelMismatch(f"{FIELD_KEYS[field]} carries {value!r}, which is not a valid {field}")
    return DispatchRef(
        dispatch_id=DispatchId(values["dispatch_id"]),
        case_id=CaseId(values["case_id"]),
        tenancy_id=TenancyId(values["tenancy_id"]),
        capability=CapabilityName(values["capability"]),
        worker_name=WorkerName(values["worker_name"]),
        idempotency_key=IdempotencyKey(values["idempotency_key"]),
    )


def _decode_one(key: str, labels: Mapping[str, object], annotations: Mapping[str, object]) -> str:
    label = labels.get(key)
    if not isinstance(label, str) or not label:
        raise LabelMismatch(f"label {key} is missing or not a string")
    full = annotations.get(key)
    if full is not None and not isinstance(full, str):
        raise LabelMismatch(f"annotation {key} is not a string")
    if is_hashed(label):
        if full is None:
            raise LabelMismatch(f"label {key} is a hash but annotation {key} is missing")
        if value_hash(full) != label:
            raise LabelMismatch(f"label {key} ({label}) is not the hash of annotation {key}")
        return full
    if full is not None and full != label:
        raise LabelMismatch(f"label {key} ({label!r}) disagrees with annotation {key}")
    return label


def selector(deployment: str | None = None) -> str:
    """The label selector of the Jobs `deployment` made; None: of every deployment's (what a
    test or a leftover count lists, never what a deployment acts on)."""
    managed = f"{MANAGED_BY_LABEL}={MANAGED_BY}"
    return managed if deployment is None else f"{managed},{DEPLOYMENT_LABEL}={deployment}"


def undelivered_selector(deployment: str) -> str:
    """The deployment's Jobs still to be delivered or cleaned up: what poll and the sweep list."""
    return f"{selector(deployment)},!{DELIVERED_LABEL}"


def delivered_selector(deployment: str) -> str:
    """The deployment's Jobs whose dispatch is recorded as ended: what the bulk delete removes."""
    return f"{selector(deployment)},{DELIVERED_LABEL}={DELIVERED}"


def unlabelled_selector() -> str:
    """Our Jobs made before the deployment label existed, whoever made them: what the sweep
    adopts when their dispatch is its own (and otherwise only reports, never deletes)."""
    return f"{selector()},!{DEPLOYMENT_LABEL}"


def named_dispatch_ids(labels: Mapping[str, object] | None, annotations: Mapping[str, object] | None) -> list[str]:
    """The dispatch ids an object's labels and annotations may name, unchecked (the label's
    value, then the annotation's when it holds the full value): what to look a dispatch up or
    show it by, cheaply. Whether they agree is `decode`'s to say."""
    found: list[str] = []
    for source in (labels, annotations):
        value = source.get(DISPATCH_ID_KEY) if isinstance(source, Mapping) else None
        if isinstance(value, str) and value not in found:
            found.append(value)
    return found


def deployment_of(labels: Mapping[str, object] | None) -> str | None:
    """The deployment a Job's labels name; None for a Job made before the label existed."""
    value = (labels or {}).get(DEPLOYMENT_LABEL)
    return value if isinstance(value, str) else None


def is_delivered(labels: Mapping[str, object] | None) -> bool:
    return (labels or {}).get(DELIVERED_LABEL) == DELIVERED


def is_hidden(labels: Mapping[str, object] | None, deployment: str) -> bool:
    """Whether a Job with these labels is out of the deployment's undelivered selector (what poll
    and the sweep list): `delivered=true`, or no or another deployment label."""
    return is_delivered(labels) or deployment_of(labels) != deployment


def decode_attempt(annotations: Mapping[str, object] | None) -> int:
    """Which re-creation of its Job this is (0 for the first; absent means 0).

    Raises:
        LabelMismatch: the annotation is not a non-negative decimal integer.
    """
    raw = (annotations or {}).get(ATTEMPT_KEY)
    if raw is None:
        return 0
    if not isinstance(raw, str) or not raw.isascii() or not raw.isdigit() or len(raw) > 9:
        raise LabelMismatch(f"annotation {ATTEMPT_KEY} is {raw!r}, not a small non-negative integer")
    return int(raw)
