"""A watch stream's slices, on a response whose bytes the test hands over one read at a time
(what a slice takes must not depend on when the server's bytes arrived; the clusters' own
watches are in tests/recovery/test_jobwatch.py)."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace
from typing import Any, cast

import pytest
import urllib3

from k8s_dispatch.core.errors import ApiUnavailable
from k8s_dispatch.workers import kube, watch_stream


class Response:
    """Stands in for urllib3's streamed response: each `read1` returns the next chunk handed
    over, and blocks until one is (or the stream is shut, as closing shuts the socket down);
    `reads` counts the calls."""

    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = list(chunks)
        self._more = threading.Condition()
        self._shut = False
        self.reads = 0
        self.connection = SimpleNamespace(sock=SimpleNamespace(shutdown=lambda _how: self.shut()))

    def read1(self, _size: int) -> bytes:
        with self._more:
            self.reads += 1
            self._more.notify_all()
            self._more.wait_for(lambda: self._chunks or self._shut)
            return self._chunks.pop(0) if self._chunks else b""

    def send(self, chunk: bytes) -> None:
        """Hand over one more chunk (the server sent it)."""
        with self._more:
            self._chunks.append(chunk)
            self._more.notify_all()

    def wait_reads(self, n: int) -> None:
        """Until the reader has asked for its n-th chunk: everything before it is queued."""
        with self._more:
            assert self._more.wait_for(lambda: self.reads >= n, timeout=5)

    def shut(self) -> None:
        with self._more:
            self._shut = True
            self._more.notify_all()

    def close(self) -> None:
        self.shut()

    def release_conn(self) -> None:
        pass


def event(kind: str, version: int, name: str = "") -> bytes:
    meta: dict[str, Any] = {"resourceVersion": str(version)}
    if name:
        meta["name"] = name
    return json.dumps({"type": kind, "object": {"metadata": meta}}).encode() + b"\n"


def stream_of(response: Response) -> watch_stream.WatchStream:
    raw = cast(urllib3.BaseHTTPResponse, response)
    return watch_stream.WatchStream(raw, what="watch jobs", version="1", idle_s=60, decode=kube._decoded)


def test_a_slice_reads_on_past_a_bookmark_what_is_queued_behind_it() -> None:
    """kube-apiserver sends a bookmark 2 s before a watch's timeout: a slice that stopped there
    would leave the events after it to the next poll, a poll interval late."""
    response = Response([event("BOOKMARK", 5), event("MODIFIED", 6, "a") + event("MODIFIED", 7, "b")])
    stream = stream_of(response)
    try:
        response.wait_reads(3)  # both chunks decoded and queued
        got = stream.slice(bound_s=5, quiet_s=1)
        assert [e["type"] for e in got.events] == ["BOOKMARK", "MODIFIED", "MODIFIED"]
        assert stream.reached == "7" and not got.ended
    finally:
        stream.close()


def test_after_a_bookmark_a_slice_waits_for_nothing_more() -> None:
    """A bookmark means caught up: the slice takes what is queued and does not wait out its quiet."""
    response = Response([event("MODIFIED", 2, "a") + event("BOOKMARK", 3)])
    stream = stream_of(response)
    try:
        response.wait_reads(2)
        started = time.monotonic()
        got = stream.slice(bound_s=30, quiet_s=30)  # without the bookmark: 30 s of quiet
        assert time.monotonic() - started < 5
        assert [e["type"] for e in got.events] == ["MODIFIED", "BOOKMARK"] and stream.reached == "3"
    finally:
        stream.close()


def test_a_slice_takes_the_events_before_the_end_and_says_it_ended() -> None:
    response = Response([event("MODIFIED", 2, "a")])
    stream = stream_of(response)
    response.wait_reads(2)
    response.shut()  # the server ended the watch
    got = stream.slice(bound_s=5, quiet_s=1)
    assert [e["object"]["metadata"]["name"] for e in got.events] == ["a"]
    assert got.ended and not stream.usable
    stream.close()


def error(code: int) -> bytes:
    status = {"kind": "Status", "status": "Failure", "code": code, "reason": "InternalError", "message": "etcd down"}
    return json.dumps({"type": "ERROR", "object": status}).encode() + b"\n"


def test_an_error_after_events_ends_the_slice_with_them() -> None:
    """The slice has moved `reached` past the events it read: raising would drop them, and the
    next stream, opened from `reached`, would never send them again."""
    response = Response([event("MODIFIED", 2, "a") + event("MODIFIED", 3, "b") + error(500)])
    stream = stream_of(response)
    try:
        response.wait_reads(2)
        got = stream.slice(bound_s=5, quiet_s=1)
        assert [e["object"]["metadata"]["name"] for e in got.events] == ["a", "b"]
        assert got.ended and not got.expired and stream.reached == "3" and not stream.usable
    finally:
        stream.close()


def test_an_error_before_any_event_still_fails_the_slice() -> None:
    response = Response([error(500)])
    stream = stream_of(response)
    try:
        response.wait_reads(2)
        with pytest.raises(ApiUnavailable, match="etcd down"):
            stream.slice(bound_s=5, quiet_s=1)
        assert stream.reached == "1"
    finally:
        stream.close()


def test_a_stream_every_slice_reads_is_not_idle_when_nothing_came() -> None:
    """An idle namespace's kept stream: slices find nothing for longer than `idle_s`, then a
    bookmark comes. The slices read it all along, so the reader keeps it open."""
    response = Response([])
    raw = cast(urllib3.BaseHTTPResponse, response)
    stream = watch_stream.WatchStream(raw, what="watch jobs", version="1", idle_s=0.3, decode=kube._decoded)
    try:
        response.wait_reads(1)
        started = time.monotonic()
        while time.monotonic() - started < 0.8:
            assert stream.slice(bound_s=0.05, quiet_s=0.05).events == []
        response.send(event("BOOKMARK", 9))
        response.wait_reads(2)
        got = stream.slice(bound_s=1, quiet_s=0.2)
        assert [e["type"] for e in got.events] == ["BOOKMARK"] and not got.ended and stream.usable
    finally:
        stream.close()
