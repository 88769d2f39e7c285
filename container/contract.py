"""The contract between a Job's manifest and the code in its container (pure): where the input is,
where the result goes and how large it may be. One definition, read by both sides: the manifest
builder (`workers.manifest`), the result reader (`workers.job_status`) and the runner."""

from __future__ import annotations

from dataclasses import dataclass

from k8s_dispatch.container import packing
from k8s_dispatch.core.payloads import canonical_json

INPUT_ENV = "K8S_DISPATCH_INPUT"
TERMINATION_MESSAGE_PATH = "/dev/termination-log"
MAX_RESULT_BYTES = 4096  # the kubelet keeps at most 4 KiB of a container's termination message


def encode_input(value: object) -> str:
    """The input or result as the container sees it: the engine's canonical JSON
    (`core.payloads.canonical_json`), with `$` written as `\\u0024`, so the text never holds
    the `$(VAR)` syntax that Kubernetes expands in env values (any JSON parser reads it back
    as `$`).

    Raises:
        InputNotSerialisable: not JSON (sets, bytes, NaN, cycles, non-string keys...) or
            holding strings that are not valid Unicode (lone surrogates).
    """
    return canonical_json(value, what="value").replace("$", "\\u0024")


# --- results in the object store (capabilities with `results: objectStore`) ------------------
# Where the runner uploads this attempt's result: a presigned PUT URL (or, in the demo's
# directory store, a file:// URL), written into the Job's env by the manifest builder. The Pod
# holds no credentials: the URL can write this one key until it expires, nothing else.
RESULT_URL_ENV = "K8S_DISPATCH_RESULT_URL"
RESULT_KEY_ENV = "K8S_DISPATCH_RESULT_KEY"  # the object's key, repeated in the reference
# The termination message of such a Job is then only a reference to the bytes: {REFERENCE_FIELD:
# {"key": ..., "size": ..., "sha256": ...}}; delivery verifies the object against it.
REFERENCE_FIELD = "k8s-dispatch.io/object"
REFERENCE_VERSION = 1


@dataclass(frozen=True)
class ResultUpload:
    """Where one attempt's result goes: its key, and the URL that can write it (and only it)."""

    key: str
    url: str


def result_reference(*, key: str, size: int, sha256: str) -> str:
    """The termination message naming an uploaded result (canonical JSON, far under 4 KiB)."""
    return canonical_json({REFERENCE_FIELD: {"v": REFERENCE_VERSION, "key": key, "size": size, "sha256": sha256}})


# --- inputs larger than the env carries (stored in the object store by the create step) -------
# The Job's env then holds no input, only where to read it (a presigned GET URL of this attempt,
# expiring after the capability's deadlines: read-only, this one key) and what it must be: the
# runner checks size and SHA-256 before it calls the function, and fails typed otherwise.
INPUT_URL_ENV = "K8S_DISPATCH_INPUT_URL"
INPUT_REF_ENV = "K8S_DISPATCH_INPUT_REF"  # canonical JSON {REFERENCE_FIELD: {v, key, size, sha256}}
INPUT_MISMATCH = "InputObjectMismatch"  # the first word of the termination message of such a failure
INPUT_UNREADABLE = "InputObjectUnreadable"  # the store refused the read or stayed unreachable


@dataclass(frozen=True)
class InputDownload:
    """Where one attempt reads its input: the object's key, size, SHA-256 and a URL that reads it."""

    key: str
    size: int
    sha256: str
    url: str

    def reference(self) -> str:
        return result_reference(key=self.key, size=self.size, sha256=self.sha256)


# --- a map's inputs in the object store (`container.packing`; `artifacts.inputs`) -------------
# One object per packed set of item inputs; every Pod of the map's Job reads its own item's bytes
# only (ranged GETs of a presigned URL) and checks them against the root its Job carries: other
# bytes end the item with INPUT_MISMATCH, a refused read with INPUT_UNREADABLE, as a dispatch's.
ITEMS_URL_ENV = "K8S_DISPATCH_ITEMS_URL"
ITEMS_REF_ENV = "K8S_DISPATCH_ITEMS_REF"  # canonical JSON {ITEMS_FIELD: {v, key, items, size, root}}
ITEMS_FIELD = "k8s-dispatch.io/items"


@dataclass(frozen=True)
class ItemsDownload:
    """Where a map's Pods read their items: the packed object's key, item count, size, Merkle root
    (hex) and a URL that reads it."""

    key: str
    items: int
    size: int
    root: str
    url: str

    def reference(self) -> str:
        body = {"v": packing.VERSION, "key": self.key, "items": self.items, "size": self.size, "root": self.root}
        return canonical_json({ITEMS_FIELD: body})


# --- secret inputs: from a Secret of the Job's own, never from the Job's spec -----------------
# The Secret is named for the Job, holds the input's JSON under SECRET_INPUT_KEY and is owned by
# the Job (deleted with it); the container's INPUT_ENV is a secretKeyRef to it.
SECRET_NAME_SUFFIX = "-input"
SECRET_INPUT_KEY = "input"


def secret_name(job_name: str) -> str:
    return job_name + SECRET_NAME_SUFFIX
