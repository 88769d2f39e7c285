"""Stored inputs against a real S3 store (SeaweedFS): a map's packed object is read item by item
with ranged GETs of its presigned URL (SeaweedFS answers 206 with exactly the range), a changed
or cut object fails the item typed; an input or packed object the store holds already is not
written again (one HEAD), a changed one is; a map's objects go with its dispatch's others."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from objectstore import ObjectStoreServer
from records import end, schedule
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from k8s_dispatch.artifacts import Artifacts, keys
from k8s_dispatch.artifacts.cleanup import clean
from k8s_dispatch.artifacts.inputs import input_download, items_download
from k8s_dispatch.artifacts.store import S3Store
from k8s_dispatch.container import runner
from k8s_dispatch.container.contract import INPUT_MISMATCH, INPUT_UNREADABLE, ITEMS_REF_ENV, ITEMS_URL_ENV
from k8s_dispatch.core.payloads import canonical_json
from k8s_dispatch.core.settings import load_settings
from k8s_dispatch.store.db import make_sessionmaker
from k8s_dispatch.store.models import EventType
from k8s_dispatch.workers.resolver import demo_resolver

SPEC = demo_resolver().spec("demo.wordcount")
DISPATCH = "0b8e2f1c-4f5a-4d0e-9a3b-2c1d0e9f8a7b"
ITEMS: list[Any] = [{"text": f"item {i} " + "w " * (i * 7), "i": i} for i in range(60)]


class CountingS3Store(S3Store):
    """The real store, counting the PUTs made through it."""

    puts: list[str]

    def put(self, key: str, data: bytes) -> None:
        self.puts.append(key)
        super().put(key, data)


@pytest.fixture
def artifacts(object_store: ObjectStoreServer, unique_prefix: str) -> Artifacts:
    built = Artifacts.from_settings(load_settings(object_store.env(unique_prefix)))
    assert built is not None and isinstance(built.store, S3Store)
    counting = CountingS3Store(built.store.client, built.store.bucket)
    counting.puts = []
    return replace(built, store=counting, orphan_grace_s=0)


def _puts(artifacts: Artifacts) -> list[str]:
    assert isinstance(artifacts.store, CountingS3Store)
    return artifacts.store.puts


def test_seaweedfs_answers_a_ranged_presigned_get_with_the_range_only(artifacts: Artifacts) -> None:
    key = f"{artifacts.prefix}/probe"
    data = bytes(range(256)) * 8
    artifacts.store.put(key, data)
    url = artifacts.store.read_url(key, 300)
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Range": "bytes=100-199"})) as r:
        assert (r.status, r.headers["Content-Range"], r.read()) == (206, f"bytes 100-199/{len(data)}", data[100:200])
    with pytest.raises(urllib.error.HTTPError) as past_the_end:
        urllib.request.urlopen(urllib.request.Request(url, headers={"Range": f"bytes={len(data)}-{len(data) + 9}"}))
    with past_the_end.value as e:
        assert e.code == 416


def _environ(download: Any, index: int) -> dict[str, str]:
    return {ITEMS_URL_ENV: download.url, ITEMS_REF_ENV: download.reference(), runner.INDEX_ENV: str(index)}


def test_each_index_reads_its_own_item_through_the_presigned_url(artifacts: Artifacts) -> None:
    download = items_download(artifacts, SPEC, dispatch_id=DISPATCH, inputs=ITEMS)
    assert download is not None and download.url.startswith("http")
    assert [runner.read_input(_environ(download, j)) for j in range(len(ITEMS))] == ITEMS


@pytest.mark.parametrize("change", ["other bytes", "cut"])
def test_a_changed_or_cut_object_fails_the_item_typed(artifacts: Artifacts, change: str) -> None:
    download = items_download(artifacts, SPEC, dispatch_id=DISPATCH, inputs=ITEMS)
    assert download is not None
    data = b"".join(artifacts.store.read(download.key))
    last = canonical_json(ITEMS[-1]).encode()
    assert data.endswith(last)
    changed = data[: -len(last)] + last.replace(b'"i":59', b'"i":58') if change == "other bytes" else data[:-100]
    artifacts.store.put(download.key, changed)
    with pytest.raises(runner.RunnerError) as raised:
        runner.read_input(_environ(download, len(ITEMS) - 1))
    assert raised.value.reason == INPUT_MISMATCH, raised.value
    assert runner.read_input(_environ(download, 0)) == ITEMS[0]  # the others still read their own
    artifacts.store.delete(download.key)
    with pytest.raises(runner.RunnerError) as raised:
        runner.read_input(_environ(download, 0))
    assert raised.value.reason == INPUT_UNREADABLE


def test_a_later_attempt_does_not_put_the_input_again_and_a_changed_one_is_rewritten(artifacts: Artifacts) -> None:
    text = canonical_json({"blob": "x" * 50_000})
    first = input_download(artifacts, SPEC, dispatch_id=DISPATCH, text=text, max_inline_bytes=1000)
    assert first is not None and _puts(artifacts) == [first.key]
    again = input_download(artifacts, SPEC, dispatch_id=DISPATCH, text=text, max_inline_bytes=1000)
    assert again is not None and again.sha256 == first.sha256
    assert _puts(artifacts) == [first.key]  # a HEAD, no PUT

    artifacts.store.put(first.key, text.replace("x", "y", 1).encode())  # same size, other bytes
    _puts(artifacts).clear()
    input_download(artifacts, SPEC, dispatch_id=DISPATCH, text=text, max_inline_bytes=1000)
    assert _puts(artifacts) == [first.key]
    assert b"".join(artifacts.store.read(first.key)) == text.encode()


def test_a_repeated_create_of_a_map_finds_its_packed_object_there(artifacts: Artifacts) -> None:
    first = items_download(artifacts, SPEC, dispatch_id=DISPATCH, inputs=ITEMS)
    again = items_download(artifacts, SPEC, dispatch_id=DISPATCH, inputs=ITEMS)
    assert first is not None and again is not None and first.key == again.key
    assert _puts(artifacts) == [first.key]
    artifacts.store.put(first.key, b"x" * first.size)  # same size, other bytes
    _puts(artifacts).clear()
    items_download(artifacts, SPEC, dispatch_id=DISPATCH, inputs=ITEMS)
    assert _puts(artifacts) == [first.key]
    assert runner.read_input(_environ(first, 3)) == ITEMS[3]


@pytest.fixture
def sessions(pg_url: str, engine_factory: Callable[..., Engine]) -> sessionmaker[Session]:
    return make_sessionmaker(engine_factory(pg_url))


def test_a_maps_packed_objects_go_with_its_dispatch(artifacts: Artifacts, sessions: sessionmaker[Session]) -> None:
    running, ended = schedule(sessions), schedule(sessions)
    objects = {}
    for dispatch_id in (running, ended):
        whole = items_download(artifacts, SPEC, dispatch_id=dispatch_id, inputs=ITEMS)
        remade = items_download(artifacts, SPEC, dispatch_id=dispatch_id, inputs=ITEMS[10:])  # its open items
        assert whole is not None and remade is not None
        assert keys.dispatch_of(artifacts.prefix, whole.key) == dispatch_id
        objects[dispatch_id] = {whole.key, remade.key}
    end(sessions, ended, EventType.WORKER_COMPLETED, {"output": {"map": "done"}})

    report = clean(artifacts, sessions)
    assert set(report.deleted_keys) == objects[ended]
    assert all(artifacts.store.size(key) is not None for key in objects[running])
