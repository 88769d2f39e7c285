"""Functions the runner calls in these tests (`python -m k8s_dispatch.container.runner tests.artifacts.funcs:NAME`)."""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path
from typing import Any


def random_bytes(spec: dict[str, Any]) -> bytes:
    """`size` bytes, the same for the same `seed`: the test knows their SHA-256 in advance."""
    out = bytearray()
    block = hashlib.sha256(str(spec["seed"]).encode()).digest()
    while len(out) < spec["size"]:
        block = hashlib.sha256(block).digest()
        out += block * 64
    return bytes(out[: spec["size"]])


def rows(spec: dict[str, Any]) -> list[dict[str, int]]:
    """A JSON result far larger than a termination message holds."""
    return [{"i": i, "square": i * i} for i in range(spec["n"])]


def file_of(spec: dict[str, Any]) -> Path:
    """A result written to a file (a model, a report): the runner streams the file itself."""
    path = Path(tempfile.mkdtemp()) / "result.bin"
    path.write_bytes(random_bytes(spec))
    return path
