"""The one serialisation of inputs, outputs and event payloads: canonical JSON (compact, keys
sorted, UTF-8, no NaN, bounded nesting). Sizes are measured on it; the store, the Job manifest
and the reader of a Job's result all use it, so what one accepts the others can keep.
"""

from __future__ import annotations

import json
from typing import Any

from k8s_dispatch.core.errors import InputNotSerialisable, InputTooLarge

# Arrays and objects nested deeper than this are refused. Python's json reads and writes nesting
# by recursion, so how deep it can go depends on how deep the caller's stack already is: a value
# written from a shallow stack could fail to be read back (every page of the sweep holding its
# row) from a deeper one. 100 levels leave hundreds of frames to spare.
MAX_DEPTH = 100


def canonical_json(value: Any, *, what: str = "input") -> str:
    """The canonical JSON text of `value`: compact, keys sorted, no NaN or Infinity.

    Strict where `json.dumps` is lenient: object keys must be strings (not coerced), the
    text must be valid UTF-8 (no lone surrogates), and nesting at most MAX_DEPTH deep.

    Raises:
        InputNotSerialisable: naming `what` and the cause.
    """
    try:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        text.encode("utf-8")
    except (TypeError, ValueError, RecursionError) as e:  # UnicodeEncodeError is a ValueError
        raise InputNotSerialisable(f"{what} is not JSON-serialisable: {e}") from e
    _check_keys_and_depth(value, what=what)  # after dumps, which has ruled out cycles
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


def _check_keys_and_depth(value: Any, *, what: str) -> None:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list, tuple)) and depth > MAX_DEPTH:
            raise InputNotSerialisable(f"{what} is nested more than {MAX_DEPTH} deep")
        if isinstance(item, dict):
            for key, child in item.items():
                if not isinstance(key, str):
                    raise InputNotSerialisable(f"{what} has a non-string object key {key!r}")
                stack.append((child, depth + 1))
        elif isinstance(item, (list, tuple)):
            stack.extend((child, depth + 1) for child in item)
