"""The reference a Job's termination message carries for a result in the object store (pure):
built by the runner (`container.contract.result_reference`), parsed and checked here, and
recorded, canonical, as the dispatch's output."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from k8s_dispatch.artifacts.errors import InvalidResultReference
from k8s_dispatch.container.contract import REFERENCE_FIELD, REFERENCE_VERSION

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
MAX_KEY_LENGTH = 1024  # S3's limit on a key, in UTF-8 bytes


@dataclass(frozen=True)
class ResultReference:
    key: str
    size: int
    sha256: str

    def to_output(self) -> dict[str, Any]:
        """The output recorded in the terminal event (and read back by `parse_reference`)."""
        return {REFERENCE_FIELD: {"v": REFERENCE_VERSION, "key": self.key, "size": self.size, "sha256": self.sha256}}


def is_reference(output: object) -> bool:
    """Whether a recorded output is (meant as) a reference, valid or not."""
    return isinstance(output, dict) and REFERENCE_FIELD in output


def parse_reference(output: object) -> ResultReference:
    """The reference in a termination message's (or a recorded output's) JSON value.

    Raises:
        InvalidResultReference: naming what is wrong.
    """
    if not isinstance(output, dict) or set(output) != {REFERENCE_FIELD}:
        raise InvalidResultReference(f"the result is not a reference to a stored object: {_short(output)}")
    body = output[REFERENCE_FIELD]
    if not isinstance(body, dict) or set(body) != {"v", "key", "size", "sha256"}:
        raise InvalidResultReference(f"the reference must hold exactly v, key, size and sha256: {_short(body)}")
    version, key, size, sha256 = body["v"], body["key"], body["size"], body["sha256"]
    if version != REFERENCE_VERSION or isinstance(version, bool):
        raise InvalidResultReference(f"reference version {version!r} is not {REFERENCE_VERSION}")
    if not isinstance(key, str) or not key or len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_LENGTH:
        raise InvalidResultReference(f"reference key {_short(key)} is not an object key")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise InvalidResultReference(f"reference size {size!r} is not a byte count")
    if not isinstance(sha256, str) or not _SHA256.match(sha256):
        raise InvalidResultReference(f"reference sha256 {_short(sha256)} is not 64 lowercase hex digits")
    return ResultReference(key=key, size=size, sha256=sha256)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."
