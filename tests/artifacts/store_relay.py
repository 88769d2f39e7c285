"""A TCP relay in front of the real SeaweedFS: the processes under test are given its address as
their object store, so the test sees every request they make (method and path, in order) and can
hold one in flight, to kill its sender while it waits. It forwards bytes unchanged (SigV4 signs
the Host header the client sent, which is the relay's, so signatures still verify); it never
answers for the store."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
from dataclasses import dataclass

REQUEST_LINE = re.compile(rb"(GET|HEAD|PUT|POST|DELETE) (/[^ \r\n]*) HTTP/1\.[01]\r\n")
CARRY = 4096  # bytes kept from a chunk's end, so a request line cut between two reads is still seen


@dataclass(frozen=True)
class Seen:
    method: str
    path: str


class Listener:
    """A loopback listener handing each connection it accepts to `_serve`, on a thread of its own,
    until `close`: what every relay of these tests shares."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        raise NotImplementedError


class StoreRelay(Listener):
    def __init__(self, upstream_endpoint: str) -> None:
        host, _, port = upstream_endpoint.removeprefix("http://").partition(":")
        self._upstream = (host, int(port))
        self._lock = threading.Lock()
        self._seen: list[Seen] = []
        self._hold: tuple[str, int] | None = None
        self.holding = threading.Event()  # set once the request to hold has arrived (not forwarded)
        self._released = threading.Event()
        super().__init__()
        self.endpoint = self.url

    def seen(self, method: str | None = None) -> list[Seen]:
        with self._lock:
            return [s for s in self._seen if method is None or s.method == method]

    def hold(self, method: str, nth: int) -> None:
        """Hold the `nth` request of `method` from now on, unsent, until `release` (which drops it)."""
        with self._lock:
            self._hold = (method, len([s for s in self._seen if s.method == method]) + nth)

    def release(self) -> None:
        """Drop the held request and close its connection: it never reaches the store."""
        self._released.set()

    def close(self) -> None:
        self._released.set()
        super().close()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self._upstream, timeout=10)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        threading.Thread(target=self._responses, args=(upstream, client), daemon=True).start()
        self._requests(client, upstream)

    def _requests(self, client: socket.socket, upstream: socket.socket) -> None:
        carry, offset, seen_to = b"", 0, 0  # offset: the stream position where `carry` starts
        try:
            while chunk := client.recv(1 << 16):
                window = carry + chunk
                held = False
                for match in REQUEST_LINE.finditer(window):
                    at = offset + match.start()
                    if at < seen_to:
                        continue  # seen in the previous window's carry
                    seen_to = offset + match.end()
                    with self._lock:
                        self._seen.append(Seen(match.group(1).decode(), match.group(2).decode()))
                        count = len([s for s in self._seen if s.method == match.group(1).decode()])
                        held = held or self._hold == (match.group(1).decode(), count)
                if held:
                    self.holding.set()
                    self._released.wait()
                    return  # dropped: the connection is closed below
                upstream.sendall(chunk)
                offset += len(window) - min(len(window), CARRY)
                carry = window[-CARRY:]
        except OSError:
            pass
        finally:
            _close(client, upstream)

    def _responses(self, upstream: socket.socket, client: socket.socket) -> None:
        try:
            while chunk := upstream.recv(1 << 16):
                client.sendall(chunk)
        except OSError:
            pass
        finally:
            _close(client, upstream)


def _close(*sockets: socket.socket) -> None:
    for s in sockets:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        s.close()
