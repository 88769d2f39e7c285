"""The one serialisation of inputs, outputs and event payloads: canonical JSON (compact, keys
sorted, UTF-8, no NaN). Sizes are measured on it; the store and the Job manifest both use it.
"""

from __future__ import annotations

import json
from typing import Any

from engine.errors import InputNotSerialisable, InputTooLarge


def canonical_json(value: Any, *, what: str = "input") -> str:
    """The canonical JSON text of `value`: compact, keys sorted, no NaN or Infinity.

    Strict where `json.dumps` is lenient: object keys must be strings (not coerced), and the
    text must be valid UTF-8 (no lone surrogates).

    Raises:
        InputNotSerialisable: naming `what` and the cause.
    """
    try:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        text.encode("utf-8")
    except (TypeError, ValueError, RecursionError) as e:  # UnicodeEncodeError is a ValueError
        raise InputNotSerialisable(f"{what} is not JSON-serialisable: {e}") from e
    _check_keys_are_strings(value, what=what)  # after dumps, which has ruled out cycles
    return text


def encode_input(value: Any, *, max_bytes: int) -> str:
    """`canonical_json(value)`, if its UTF-8 encoding is at most `max_bytes` long.

    Raises:
        InputNotSerialisable, InputTooLarge
    """
    text = canonical_json(value)
    size = len(text.encode("utf-8"))
    if size > max_bytes:
        raise InputTooLarge(f"input is {size} bytes as JSON, over the limit of {max_bytes}")
    return text


def _check_keys_are_strings(value: Any, *, what: str) -> None:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, child in item.items():
                if not isinstance(key, str):
                    raise InputNotSerialisable(f"{what} has a non-string object key {key!r}")
                stack.append(child)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
