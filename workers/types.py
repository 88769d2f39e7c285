"""The words of the workers domain: typed ids, the dispatch reference, and their syntax.

A `DispatchRef` is everything needed to identify a dispatch; it travels from the engine into
a Job's labels and back. The `is_*` predicates are the one definition of which strings each
id may be; `check_ref` applies them and raises the engine's typed errors.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import NewType

from k8s_dispatch.core.errors import InvalidId, InvalidIdempotencyKey
from k8s_dispatch.core.ids import (
    MAX_ID_LENGTH,
    MAX_IDEMPOTENCY_KEY_LENGTH,
    is_dispatch_id,
    is_engine_id,
    is_idempotency_key,
)
from k8s_dispatch.core.names import is_dns1123_label

DispatchId = NewType("DispatchId", str)
CaseId = NewType("CaseId", str)
TenancyId = NewType("TenancyId", str)
CapabilityName = NewType("CapabilityName", str)
WorkerName = NewType("WorkerName", str)
IdempotencyKey = NewType("IdempotencyKey", str)

# The syntax of the engine's ids is the engine's (core/ids.py): one definition for the
# store, which checks them at schedule time, and the label codec, which reads them back.
ENGINE_ID_MAX = MAX_ID_LENGTH
IDEMPOTENCY_KEY_MAX = MAX_IDEMPOTENCY_KEY_LENGTH
CAPABILITY_NAME_MAX = 128

# A capability name in config: letters, digits and `-_.:/`, starting and ending with a letter
# or digit. No comma (a worker lists its capabilities comma-separated) and no whitespace.
_CAPABILITY_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.:/]*[A-Za-z0-9])?$")


@dataclass(frozen=True)
class DispatchRef:
    """Identifies one dispatch: what a Job's labels carry and `labels.decode` rebuilds."""

    dispatch_id: DispatchId
    case_id: CaseId
    tenancy_id: TenancyId
    capability: CapabilityName
    worker_name: WorkerName
    idempotency_key: IdempotencyKey


def new_dispatch_id() -> DispatchId:
    return DispatchId(str(uuid.uuid4()))


def is_capability_name(value: object) -> bool:
    """The stricter rule for capability names declared in config (see `_CAPABILITY_NAME`)."""
    return isinstance(value, str) and len(value) <= CAPABILITY_NAME_MAX and bool(_CAPABILITY_NAME.match(value))


def is_worker_name(value: object) -> bool:
    """Worker names are DNS-1123 labels, so they fit anywhere Kubernetes takes a name."""
    return isinstance(value, str) and is_dns1123_label(value)


def check_ref(ref: DispatchRef) -> DispatchRef:
    """Return `ref` if every field has its syntax.

    Raises:
        InvalidId: naming the first malformed id field.
        InvalidIdempotencyKey: the key is empty, too long or not printable.
    """
    if not is_dispatch_id(ref.dispatch_id):
        raise InvalidId(f"dispatch_id {ref.dispatch_id!r} is not a lowercase canonical UUID")
    for field in ("case_id", "tenancy_id", "capability", "worker_name"):
        value = getattr(ref, field)
        if not is_engine_id(value):
            raise InvalidId(f"{field} {value!r} must be 1..{ENGINE_ID_MAX} printable characters")
    if not is_idempotency_key(ref.idempotency_key):
        raise InvalidIdempotencyKey(
            f"idempotency_key {ref.idempotency_key!r} must be 1..{IDEMPOTENCY_KEY_MAX} printable characters"
        )
    return ref
