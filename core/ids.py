"""The syntax of the ids a dispatch carries: case and tenancy ids, dispatch ids, idempotency
keys. One definition, used by the store (at schedule time) and by the workers' label codec
(when a Job is read back), so both sides agree on what a valid id is.
"""

from __future__ import annotations

import uuid
from typing import TypeGuard

from k8s_dispatch.core.errors import InvalidId, InvalidIdempotencyKey

MAX_ID_LENGTH = 128  # case and tenancy ids (the engine's), capability and worker names in a ref
MAX_IDEMPOTENCY_KEY_LENGTH = 256


def is_engine_id(value: object) -> TypeGuard[str]:
    """1..128 printable characters (`str.isprintable`: any script, no control characters).

    Ids that are not valid label values (spaces, other scripts, too long) still work: the
    label codec hashes them and keeps the full value in an annotation.
    """
    return isinstance(value, str) and 1 <= len(value) <= MAX_ID_LENGTH and value.isprintable()


def is_dispatch_id(value: object) -> TypeGuard[str]:
    """A UUID in canonical text form (lower case, hyphenated, 36 characters)."""
    if not isinstance(value, str):
        return False
    try:
        return str(uuid.UUID(value)) == value
    except ValueError:
        return False


def is_idempotency_key(value: object) -> TypeGuard[str]:
    """1..256 printable characters (any script, no control characters)."""
    return isinstance(value, str) and 1 <= len(value) <= MAX_IDEMPOTENCY_KEY_LENGTH and value.isprintable()


def check_id(name: str, value: object) -> str:
    """`value` if it is a valid case or tenancy id (see `is_engine_id`).

    Raises:
        InvalidId: naming `name` and what is wrong.
    """
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_ID_LENGTH:
        raise InvalidId(f"{name} must be a string of 1 to {MAX_ID_LENGTH} characters, got {show_value(value)}")
    if not is_engine_id(value):
        raise InvalidId(f"{name} {show_value(value)} contains a non-printable character")
    return value


def check_dispatch_id(value: object) -> str:
    """`value` if it is a UUID in canonical text form.

    Raises:
        InvalidId
    """
    if not is_dispatch_id(value):
        raise InvalidId(f"dispatch_id must be a UUID in canonical form, got {show_value(value)}")
    return value


def check_idempotency_key(value: object) -> str:
    """`value` if it is a valid idempotency key (see `is_idempotency_key`).

    Raises:
        InvalidIdempotencyKey
    """
    if not is_idempotency_key(value):
        raise InvalidIdempotencyKey(
            f"idempotency_key must be 1 to {MAX_IDEMPOTENCY_KEY_LENGTH} printable characters, got {show_value(value)}"
        )
    return value


def show_value(value: object) -> str:
    """`repr(value)`, cut to 80 characters: safe to put in an error message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
