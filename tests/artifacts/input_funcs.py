"""Functions the runner calls in the input tests: each returns a small digest of what it got, so
the test compares the function's view of its input with what was scheduled."""

from __future__ import annotations

import hashlib
from typing import Any

from k8s_dispatch.core.payloads import canonical_json


def digest(value: Any) -> dict[str, Any]:
    """The SHA-256 of the input's canonical JSON, and its top-level keys."""
    return {"sha256": hashlib.sha256(canonical_json(value).encode()).hexdigest(), "keys": sorted(value)}
