"""A watch response read by a thread of its own, so that it can stay open between slices.

A poll reads its watch in bounded slices. Reopening the watch for every slice costs one request
per poll, which with long Jobs is a third of what a poll costs the API server. A stream read by
its own thread can be kept for the next slice, as an informer keeps its watch, while a slice
still only ever reads what the stream has already received. The thread blocks on the socket
(no socket timeouts: a timed-out read leaves a buffered reader's state undefined) and queues
what it decodes: events, the stream's end, or the error that broke it. Closing shuts the socket
down, so a blocked read returns at once.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import urllib3

from k8s_dispatch.core.errors import ApiUnavailable

log = logging.getLogger(__name__)

JsonDict = dict[str, Any]
# What the reader thread queues besides events: the stream ended (the server's timeoutSeconds,
# or closed by us), or broke off (the exception).
_END = object()
CLOSE_WAIT_S = 1.0


@dataclass(frozen=True)
class Slice:
    """What one slice read: its events in order (BOOKMARKs among them); `expired` when
    the server said the version is too old (410); `ended` when the stream is over (it ended, or
    broke off after some events) and cannot serve another slice."""

    events: list[JsonDict]
    expired: bool
    ended: bool


class WatchStream:
    """One open watch response. `reached` is the version the slices have read up to (each
    event's `resourceVersion`): the stream can serve a slice from that version only."""

    def __init__(
        self,
        response: urllib3.BaseHTTPResponse,
        *,
        what: str,
        version: str,
        idle_s: float,
        decode: Callable[[bytes, str], JsonDict],
        on_event: Callable[[JsonDict], object] | None = None,
    ) -> None:
        """Start reading `response` (a watch opened from `version`), each line an event by
        `decode` (the adapter's, raising ApiUnavailable for what is not a JSON object). The thread
        stops reading once no slice has read it for `idle_s` (a stream nobody reads is dropped,
        not buffered; an idle namespace's stream, read by every poll, is kept past its bookmarks).
        `on_event` is called by the thread with each event once it is queued for a slice (a
        doorbell: it must not block, and what it raises is logged, not the stream's end)."""
        self.what = what
        self._decode = decode
        self._on_event = on_event
        self.reached = version
        self.opened_at = time.monotonic()
        self._response = response
        self._idle_s = idle_s
        self._taken_at = time.monotonic()
        self._items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = threading.Event()
        self._over = False  # a slice saw its end or an error: no further slice
        self._thread = threading.Thread(target=self._read, name=what, daemon=True)
        self._thread.start()

    @property
    def usable(self) -> bool:
        """Whether a slice can still read something from it: not over, and either still open or
        holding what it received before it ended."""
        return not self._over and not (self._closed.is_set() and self._items.empty())

    def slice(self, *, bound_s: float, quiet_s: float) -> Slice:
        """The events received until caught up: `quiet_s` without one, or a BOOKMARK and what is
        already queued behind it; or `bound_s` in all. Each event read moves `reached`.

        A BOOKMARK does not end the slice while events wait behind it: kube-apiserver sends one
        2 s before a watch's timeout, and a slice that stopped there would leave the events of
        those last 2 s for the next poll, a poll interval late.

        A stream that breaks off (an ERROR other than 410 included) after this slice read events
        ends the slice with them (`ended`): they are past `reached` and must be handed on.

        Raises:
            ApiUnavailable: the stream broke off, or the server sent an ERROR other than 410,
                before this slice read an event (the stream is then over).
        """
        deadline = time.monotonic() + bound_s
        self._taken_at = time.monotonic()  # read by a slice, even if nothing came: not idle
        events: list[JsonDict] = []
        while (left := deadline - time.monotonic()) > 0:
            try:
                item = self._items.get(timeout=min(quiet_s, left))
            except queue.Empty:
                break  # quiet: caught up with the server
            self._taken_at = time.monotonic()
            if item is _END or isinstance(item, BaseException):
                self._over = True
                if isinstance(item, BaseException) and not events:
                    raise ApiUnavailable(f"{self.what}: {type(item).__name__}: {item}") from item
                if isinstance(item, BaseException):  # what was read stands
                    log.info("%s: the stream broke after %d events (%s)", self.what, len(events), item)
                return Slice(events, expired=False, ended=True)
            if item.get("type") == "ERROR":
                self._over = True
                status = item.get("object") or {}
                if status.get("code") == 410 or status.get("reason") in ("Expired", "Gone"):
                    return Slice(events, expired=True, ended=True)
                message = status.get("message") or status
                if not events:
                    raise ApiUnavailable(f"{self.what}: the watch broke off: {message}")
                # What was read stands, as when the stream breaks: `reached` has moved past these
                # events, so a slice that dropped them would resume after them and lose them.
                log.info("%s: the watch broke off after %d events (%s)", self.what, len(events), message)
                return Slice(events, expired=False, ended=True)
            events.append(item)
            version = (item.get("object") or {}).get("metadata", {}).get("resourceVersion")
            if version:
                self.reached = str(version)
            if item.get("type") == "BOOKMARK":
                quiet_s = 0.0  # caught up to it: only what is already queued behind it is read
        return Slice(events, expired=False, ended=False)

    def close(self) -> None:
        """Stop the stream: the socket is shut down so that the reader's blocked read returns,
        and the reader is waited for (briefly: it has nothing left to do)."""
        if not self._closed.is_set():
            self._closed.set()
            sock = getattr(getattr(self._response, "connection", None), "sock", None)
            if sock is not None:
                with contextlib.suppress(OSError):  # already closed by the server, or by the reader
                    sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=CLOSE_WAIT_S)

    def _tell(self, event: JsonDict) -> None:
        if self._on_event is None:
            return
        try:
            self._on_event(event)
        except Exception:  # a doorbell's fault is not the stream's
            log.exception("%s: on_event failed", self.what)

    def _read(self) -> None:
        buffer = b""
        try:
            while not self._closed.is_set():
                chunk = self._response.read1(65536)
                if not chunk:
                    break  # the server ended the watch
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.strip():
                        event = self._decode(line, self.what)
                        self._items.put(event)
                        self._tell(event)
                if time.monotonic() - self._taken_at > self._idle_s:
                    log.info("%s: no slice read the stream for %.0f s; closing it", self.what, self._idle_s)
                    break
        except (urllib3.exceptions.HTTPError, OSError, ApiUnavailable) as e:
            if not self._closed.is_set():
                self._items.put(e)
        finally:
            self._closed.set()
            self._items.put(_END)
            self._response.close()  # unread bytes left: the connection is not returned to the pool as is
            self._response.release_conn()
