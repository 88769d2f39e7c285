"""The functions the chaos run's object-store capabilities call in exec mode
(`python -m k8s_dispatch.container.runner k8s_dispatch.lab.chaos.functions:NAME`): each result is a
function of its input alone, so the run knows it in advance."""

from __future__ import annotations

import hashlib
from typing import Any

from k8s_dispatch.core.payloads import canonical_json


def stored_bytes(spec: dict[str, Any]) -> bytes:
    """`size` random bytes of `stream` (`workload.stored_bytes`): the runner uploads them through
    the attempt's presigned URL and writes only their reference as the termination message."""
    from k8s_dispatch.lab.chaos.workload import stored_bytes as draw

    return draw(str(spec["stream"]), int(spec["size"]))


def secret_digest(value: Any) -> dict[str, str]:
    """The SHA-256 of a secret input's canonical JSON: proof the Pod got it, without the input."""
    return {"sha256": hashlib.sha256(canonical_json(value).encode()).hexdigest()}
