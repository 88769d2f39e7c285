"""A map's inputs packed in one object (pure, `container.packing`) and read item by item as a Pod
reads them (`container.runner`, through file:// URLs here; SeaweedFS in test_item_objects.py):
the root is RFC 6962's tree hash, every item reads back alone, and no change to the object ever
gives an item other bytes than its own (other bytes, a short object, another index's record:
a typed failure). The create step's side (`artifacts.inputs`) with the demo's directory store,
the Indexed Job it builds, and the map input limits."""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k8s_dispatch.artifacts import keys
from k8s_dispatch.artifacts.inputs import MAP_INLINE_BYTES, items_download, put_unless_held
from k8s_dispatch.artifacts.service import Artifacts
from k8s_dispatch.artifacts.store import DirectoryStore
from k8s_dispatch.container import packing, runner
from k8s_dispatch.container.contract import (
    INPUT_MISMATCH,
    INPUT_UNREADABLE,
    ITEMS_REF_ENV,
    ITEMS_URL_ENV,
    ItemsDownload,
)
from k8s_dispatch.core.errors import InputTooLarge, InvalidManifest
from k8s_dispatch.core.payloads import canonical_json
from k8s_dispatch.store import maps
from k8s_dispatch.workers import indexed
from k8s_dispatch.workers.manifest import build_job
from k8s_dispatch.workers.resolver import demo_resolver
from k8s_dispatch.workers.types import (
    CapabilityName,
    CaseId,
    DispatchId,
    DispatchRef,
    IdempotencyKey,
    TenancyId,
    WorkerName,
)

DISPATCH = "0b8e2f1c-4f5a-4d0e-9a3b-2c1d0e9f8a7b"
SPEC = demo_resolver().spec("demo.wordcount")


def _mth(leaves: list[bytes]) -> bytes:
    """RFC 6962's Merkle tree hash, by its recursive definition (split at the largest power of two
    below n), over leaf hashes."""
    if len(leaves) == 1:
        return leaves[0]
    k = 1
    while k * 2 < len(leaves):
        k *= 2
    return packing.node_hash(_mth(leaves[:k]), _mth(leaves[k:]))


def _read(data: bytes, index: int, count: int, root: str) -> bytes | None:
    """What a Pod at `index` reads of object `data`: its entry, then the record it names."""
    first, length = packing.entry_range(index)
    entry = data[first : first + length]
    if len(entry) != packing.ENTRY_BYTES:
        return None
    start, size = packing.parse_entry(entry)
    return packing.item_of_record(index, count, data[start : start + size], root)


items_st = st.lists(st.binary(min_size=1, max_size=40), min_size=1, max_size=70)


@given(items_st)
def test_the_root_is_rfc_6962s_and_every_item_reads_back_alone(items: list[bytes]) -> None:
    packed = packing.pack(items)
    leaves = [packing.leaf_hash(j, item) for j, item in enumerate(items)]
    assert packed.root == _mth(leaves).hex() and packed.count == len(items)
    for j, item in enumerate(items):
        assert _read(packed.data, j, len(items), packed.root) == item


@settings(max_examples=300)
@given(items_st, st.data())
def test_no_change_to_the_object_gives_an_item_other_bytes(items: list[bytes], data: st.DataObject) -> None:
    """A flipped byte, a cut, bytes added: each item reads as its own bytes or not at all."""
    packed = packing.pack(items)
    blob = bytearray(packed.data)
    change = data.draw(st.sampled_from(["flip", "cut", "append"]))
    if change == "flip":
        at = data.draw(st.integers(0, len(blob) - 1))
        blob[at] ^= data.draw(st.integers(1, 255))
    elif change == "cut":
        del blob[data.draw(st.integers(0, len(blob) - 1)) :]
    else:
        blob += data.draw(st.binary(min_size=1, max_size=64))
    for j, item in enumerate(items):
        assert _read(bytes(blob), j, len(items), packed.root) in (item, None)


def test_a_record_never_passes_for_another_index_or_another_tree() -> None:
    items = [b'{"n":1}', b'{"n":1}', b'{"n":2}']  # two equal items: only the index tells them apart
    packed = packing.pack(items)
    start, length = packing.parse_entry(packed.data[0:16])
    record0 = packed.data[start : start + length]
    assert packing.item_of_record(0, 3, record0, packed.root) == b'{"n":1}'
    assert packing.item_of_record(1, 3, record0, packed.root) is None
    assert packing.item_of_record(0, 3, record0, packing.pack(items[:2]).root) is None
    assert packing.item_of_record(3, 3, record0, packed.root) is None


@pytest.mark.parametrize(("count", "worst"), [(1, 0), (2, 1), (3, 2), (1000, 10), (100_000, 17)])
def test_an_items_path_is_one_hash_per_level(count: int, worst: int) -> None:
    assert max(packing.path_length(j, count) for j in {0, count // 2, count - 1}) == worst


# --- the runner's side, through file:// URLs (the demo's directory store) -------------------


def _stored(tmp_path: Path, values: list[Any]) -> tuple[Path, ItemsDownload]:
    packed = packing.pack([canonical_json(v).encode() for v in values])
    path = tmp_path / "items"
    path.write_bytes(packed.data)
    return path, ItemsDownload(
        key="p/d/items/r", items=packed.count, size=len(packed.data), root=packed.root, url=path.as_uri()
    )


def _environ(download: ItemsDownload, index: int) -> dict[str, str]:
    return {ITEMS_URL_ENV: download.url, ITEMS_REF_ENV: download.reference(), runner.INDEX_ENV: str(index)}


def test_the_runner_reads_each_index_its_own_item(tmp_path: Path) -> None:
    values: list[Any] = [{"text": "a b"}, {"text": "$(HOME) \u00e9"}, 3, None, ["x"] * 50]
    _, download = _stored(tmp_path, values)
    assert [runner.read_input(_environ(download, j)) for j in range(len(values))] == values


@pytest.mark.parametrize("change", ["other bytes", "short", "entry elsewhere"])
def test_a_changed_object_fails_the_item_typed(tmp_path: Path, change: str) -> None:
    path, download = _stored(tmp_path, [{"n": i} for i in range(5)])
    blob = bytearray(path.read_bytes())
    if change == "other bytes":
        blob[-2] = ord("7")  # item 4's {"n":4} becomes {"n":7}: same size
    elif change == "short":
        del blob[-3:]
    else:  # item 4's entry names item 3's record
        blob[64:80] = blob[48:64]
    path.write_bytes(bytes(blob))
    with pytest.raises(runner.RunnerError) as raised:
        runner.read_input(_environ(download, 4))
    assert raised.value.reason == INPUT_MISMATCH and "the function was not called" in str(raised.value)
    assert runner.read_input(_environ(download, 1)) == {"n": 1}  # the others still read their own


def test_a_missing_object_or_index_is_no_item(tmp_path: Path) -> None:
    path, download = _stored(tmp_path, [1, 2])
    with pytest.raises(runner.RunnerError) as raised:
        runner.read_input(_environ(download, 2))
    assert raised.value.reason is None and "no item 2" in str(raised.value)
    path.unlink()
    with pytest.raises(runner.RunnerError) as raised:
        runner.read_input(_environ(download, 0))
    assert raised.value.reason == INPUT_UNREADABLE


# --- the create step's side ------------------------------------------------------------------


@pytest.fixture
def directory_store(tmp_path: Path) -> Artifacts:
    return Artifacts(store=DirectoryStore(tmp_path / "store", "bucket"), prefix="p")


def test_small_maps_keep_the_env_array_and_large_ones_are_packed_once(directory_store: Artifacts) -> None:
    small = [{"n": i} for i in range(10)]
    assert items_download(directory_store, SPEC, dispatch_id=DISPATCH, inputs=small) is None
    large: list[Any] = [{"text": "w " * 100, "n": i} for i in range(40)]
    assert len(canonical_json(large)) > MAP_INLINE_BYTES
    download = items_download(directory_store, SPEC, dispatch_id=DISPATCH, inputs=large)
    assert download is not None and download.items == 40
    assert download.key == keys.items_key("p", DISPATCH, download.root)
    assert keys.dispatch_of("p", download.key) == DISPATCH  # cleaned up with its dispatch's objects
    assert keys.is_items_key("p", download.key) and not keys.is_items_key("q", download.key)
    assert not keys.is_items_key("p", f"p/{DISPATCH}/items/{download.root[:-1]}")
    assert not keys.is_items_key("p", keys.input_key("p", DISPATCH))
    data = b"".join(directory_store.store.read(download.key))
    assert len(data) == download.size
    assert [json.loads(_read(data, j, 40, download.root) or b"") for j in range(40)] == large
    # The open items of a re-made Job: another set, another object, the first one untouched.
    again = items_download(directory_store, SPEC, dispatch_id=DISPATCH, inputs=large[5:])
    assert again is not None and again.key != download.key and again.items == 35
    assert b"".join(directory_store.store.read(download.key)) == data


def test_without_a_store_the_env_array_is_capped() -> None:
    assert items_download(None, SPEC, dispatch_id=DISPATCH, inputs=[{"text": "w " * 100}] * 40) is None
    with pytest.raises(InputTooLarge):
        items_download(None, SPEC, dispatch_id=DISPATCH, inputs=["x" * 1000] * (maps.MAX_MAP_INPUT_BYTES // 1000))


def test_an_object_held_already_is_not_written_again_and_a_changed_one_is(directory_store: Artifacts) -> None:
    store = directory_store.store
    assert put_unless_held(store, "p/k", b"0123456789") is True
    assert put_unless_held(store, "p/k", b"0123456789") is False
    store.put("p/k", b"0123456780")  # same size, other bytes
    assert put_unless_held(store, "p/k", b"0123456789") is True
    assert b"".join(store.read("p/k")) == b"0123456789"


def test_the_indexed_job_carries_the_objects_url_and_root_not_the_inputs() -> None:
    ref = DispatchRef(
        dispatch_id=DispatchId(DISPATCH), case_id=CaseId("c"), tenancy_id=TenancyId("t"),
        capability=CapabilityName("demo.wordcount"), worker_name=WorkerName("demo-text"),
        idempotency_key=IdempotencyKey("k"),
    )  # fmt: skip
    base = build_job(ref, input={"map": {"items": 2}}, spec=SPEC, namespace="ns", deployment="d")
    inputs = [{"text": "secret-ish " * 50}, {"text": "b"}]
    download = ItemsDownload(key="p/x", items=2, size=10, root="ab" * 32, url="https://store/p/x?sig")
    job = indexed.indexed_job(base, inputs=inputs, parallelism=2, max_failed_items=None, items_download=download)
    (container,) = job["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert indexed.ITEMS_ENV not in env and env[ITEMS_URL_ENV] == download.url
    assert json.loads(env[ITEMS_REF_ENV]) == {
        "k8s-dispatch.io/items": {"v": 1, "key": "p/x", "items": 2, "size": 10, "root": "ab" * 32}
    }
    assert "secret-ish" not in json.dumps(job)
    with pytest.raises(InvalidManifest):
        indexed.indexed_job(base, inputs=inputs[:1], parallelism=1, max_failed_items=None, items_download=download)


@pytest.mark.parametrize(
    ("stored", "limit"),
    [
        (None, maps.MAX_MAP_INPUT_BYTES),
        (64 * 1024 * 1024, maps.MAX_STORED_MAP_INPUT_BYTES),
        (5 * 1024**3, maps.MAX_STORED_MAP_INPUT_BYTES),
        (1024 * 1024, 1024 * 1024),
        (1024, maps.MAX_MAP_INPUT_BYTES),  # never under the env's own
    ],
)
def test_the_map_input_limit(stored: int | None, limit: int) -> None:
    assert maps.map_input_limit(max_input_bytes=32 * 1024, max_stored_input_bytes=stored) == limit


def test_the_digest_of_a_leaf_binds_its_index() -> None:
    assert packing.leaf_hash(0, b"x") != packing.leaf_hash(1, b"x")
    assert packing.leaf_hash(0, b"x") == hashlib.sha256(b"\x00" + bytes(8) + b"x").digest()


def test_with_a_store_a_map_up_to_its_limit_is_taken_and_one_over_it_refused() -> None:
    def request(items: list[Any]) -> maps.MapRequest:
        return maps.MapRequest(
            case_id="c", tenancy_id="t", capability="demo.wordcount", items=items, idempotency_key="k", parallelism=2
        )

    mib = [{"text": "w" * 1000}] * 1000  # 1 MiB: over the env's cap, each item under the env's limit
    with pytest.raises(InputTooLarge, match="a map's limit"):
        maps.prepare_map(request(mib), router=demo_resolver(), max_input_bytes=32 * 1024)
    taken = maps.prepare_map(
        request(mib), router=demo_resolver(), max_input_bytes=32 * 1024, max_stored_input_bytes=2 * 1024 * 1024
    )
    assert len(taken.inputs) == 1000
    with pytest.raises(InputTooLarge, match="a map's limit"):
        maps.prepare_map(
            request(mib + mib[:100]), router=demo_resolver(), max_input_bytes=32 * 1024, max_stored_input_bytes=1 << 20
        )
    one_large = [{"text": "w" * 100_000}]  # an item over the env's limit: stored, it is taken
    with pytest.raises(InputTooLarge):
        maps.prepare_map(request(one_large), router=demo_resolver(), max_input_bytes=32 * 1024)
    maps.prepare_map(
        request(one_large), router=demo_resolver(), max_input_bytes=32 * 1024, max_stored_input_bytes=1 << 20
    )


def test_a_store_that_ignores_range_still_gives_each_index_its_own_item(tmp_path: Path) -> None:
    """The standard library's HTTP server answers a ranged GET with 200 and the whole object: the
    runner skips to its range itself."""
    values: list[Any] = [{"n": i, "pad": "p" * i} for i in range(9)]
    path, download = _stored(tmp_path, values)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            url = f"http://127.0.0.1:{server.server_address[1]}/{path.name}"
            over_http = replace(download, url=url)
            assert [runner.read_input(_environ(over_http, j)) for j in range(len(values))] == values
        finally:
            server.shutdown()
            thread.join()
