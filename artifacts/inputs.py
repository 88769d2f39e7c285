"""Inputs in the object store, written by the create step: the Job then carries a presigned GET
URL of its own and what the bytes must be, which the runner checks before it calls the function.
The Pod holds no credentials and can read this one key, until the URL expires; the database
keeps the inputs, so an object lost or tampered with is written again by the next create.

A dispatch's input too large for the env: its canonical JSON under its dispatch's input key, the
same bytes for every attempt; the Job carries its key, size and SHA-256.

A map's item inputs, once they would make the Pod template's env array larger than
MAP_INLINE_BYTES: packed into one object per set of items (`container.packing`), named by its
Merkle root (`keys.items_key`), which the Job carries with the item count and the object's size.
Each Pod reads its own item's bytes only (two ranged GETs) and checks them against the root; no
Pod object carries another item's input. Small maps keep the env array: the object would cost a
PUT per Job and two GETs per Pod to save etcd less than the Pod weighs without it.

A create writes an object only when the store does not hold it already (same size and digest):
a later attempt, a repeated create or a re-made map Job costs a HEAD, not a PUT of the bytes.
"""

from __future__ import annotations

import hashlib

from k8s_dispatch.artifacts import keys
from k8s_dispatch.artifacts.service import Artifacts, CapabilitySpec, upload_expiry_s
from k8s_dispatch.artifacts.store import ObjectStore, S3Store, _translated
from k8s_dispatch.container import packing
from k8s_dispatch.container.contract import InputDownload, ItemsDownload
from k8s_dispatch.core.errors import InputTooLarge
from k8s_dispatch.core.payloads import canonical_json
from k8s_dispatch.store.maps import MAX_MAP_INPUT_BYTES

# A map's items as one env array up to this many bytes, in the store beyond. A map Pod weighs a
# few KiB without its inputs (its template 1.2 KiB as built here, then status and managedFields),
# and the store's URL and reference add 0.6 KiB: an array this small at most doubles the Pod, and
# saves the PUT and each Pod's two GETs.
MAP_INLINE_BYTES = 4096


def input_download(
    artifacts: Artifacts | None, spec: CapabilitySpec, *, dispatch_id: str, text: str, max_inline_bytes: int
) -> InputDownload | None:
    """For an input whose JSON `text` is larger than `max_inline_bytes`: the object written (if
    the store does not hold it already) and its InputDownload (what
    `workers.manifest.build_job(..., input_download=...)` takes); None for an input that fits the
    env (nothing is written).

    Raises:
        InputTooLarge: the input does not fit the env and no object store is configured.
        ObjectStoreUnavailable: the store did not take it (the create is tried again).
    """
    data = text.encode("utf-8")
    if len(data) <= max_inline_bytes:
        return None
    if artifacts is None:
        raise InputTooLarge(
            f"input is {len(data)} bytes as JSON, over the limit of {max_inline_bytes} a Job's env carries, "
            "and no object store is configured"
        )
    key = keys.input_key(artifacts.prefix, dispatch_id)
    put_unless_held(artifacts.store, key, data)
    url = artifacts.store.read_url(key, upload_expiry_s(spec, artifacts.url_slack_s))
    return InputDownload(key=key, size=len(data), sha256=hashlib.sha256(data).hexdigest(), url=url)


def items_download(
    artifacts: Artifacts | None, spec: CapabilitySpec, *, dispatch_id: str, inputs: list[object]
) -> ItemsDownload | None:
    """For a map's Job over `inputs` (completion-index order): with an object store and inputs
    larger than MAP_INLINE_BYTES as an env array, the packed object written (if the store does
    not hold it already) and its ItemsDownload (what `workers.indexed.indexed_job(...,
    items_download=...)` takes); None when the env array carries them.

    Raises:
        InputTooLarge: no object store, and the inputs are over `store.maps.MAX_MAP_INPUT_BYTES`
            (a map scheduled while a store was configured).
        InputNotSerialisable: an input is not JSON.
        ObjectStoreUnavailable: the store did not take it (the create is tried again).
    """
    items = [canonical_json(value, what="item input").encode("utf-8") for value in inputs]
    as_array = sum(len(item) for item in items) + len(items) + 1
    if artifacts is None:
        if as_array > MAX_MAP_INPUT_BYTES:
            raise InputTooLarge(
                f"the items are {as_array} bytes as JSON, over the {MAX_MAP_INPUT_BYTES} a map's Pods carry, "
                "and no object store is configured"
            )
        return None
    if as_array <= MAP_INLINE_BYTES:
        return None
    packed = packing.pack(items)
    key = keys.items_key(artifacts.prefix, dispatch_id, packed.root)
    put_unless_held(artifacts.store, key, packed.data)
    url = artifacts.store.read_url(key, upload_expiry_s(spec, artifacts.url_slack_s))
    return ItemsDownload(key=key, items=packed.count, size=len(packed.data), root=packed.root, url=url)


def put_unless_held(store: ObjectStore, key: str, data: bytes) -> bool:
    """Write `data` under `key` unless the store holds exactly those bytes there; whether it wrote.

    An S3 store is asked with one HEAD: the same size and an ETag equal to the bytes' MD5, which
    the store computed itself from what it holds (a single-part PUT's ETag; one that is not an
    MD5, as under SSE-KMS, only costs a rewrite). MD5 is no defence against a crafted collision,
    and need not be: the Pod checks SHA-256 (or the Merkle root) and fails typed on other bytes.
    Any other store (the demo's directory) is local: its bytes are read back through SHA-256.

    Raises:
        ObjectStoreUnavailable: the store cannot be asked or did not take the bytes.
    """
    if _holds(store, key, data):
        return False
    store.put(key, data)
    return True


def _holds(store: ObjectStore, key: str, data: bytes) -> bool:
    if isinstance(store, S3Store):
        with _translated(key, missing_ok=True):
            head = store.client.head_object(Bucket=store.bucket, Key=key)
            md5 = hashlib.md5(data, usedforsecurity=False).hexdigest()
            return head["ContentLength"] == len(data) and head.get("ETag", "").strip('"') == md5
        return False  # no such object
    if store.size(key) != len(data):
        return False
    digest = hashlib.sha256()
    for chunk in store.read(key):
        digest.update(chunk)
    return digest.digest() == hashlib.sha256(data).digest()
