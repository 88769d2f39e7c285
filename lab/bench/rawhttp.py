"""A bare HTTP/1.1 keep-alive client for the Jobs API: what the server can do, with no client
library in the way. Used to measure localcluster itself and to fill it quickly for the other
benchmarks; the project's own client (`workers.kube.KubeClient`) is measured next to it.

Requests are written and answers read on a plain socket (TLS-wrapped for the real kube-apiserver;
Content-Length or chunked bodies): about 50 us of client CPU per request where http.client took
about 180 us, and the client shares the machine's cores with the server it measures.
"""

from __future__ import annotations

import json
import socket
import threading
import urllib.parse
from collections.abc import Sequence
from typing import Any

from k8s_dispatch.lab.bench.services import BENCH_USER_AGENT, Cluster
from k8s_dispatch.lab.bench.timing import Stopwatch

JsonDict = dict[str, Any]


class ApiError(RuntimeError):
    pass


class RawApi:
    """One keep-alive connection to the API server (one per thread).

    `http_seconds` adds up the time spent from sending each request to reading the last byte
    of its answer: the server's time plus the transfer, without decoding the JSON.
    """

    def __init__(self, cluster: Cluster) -> None:
        parsed = urllib.parse.urlsplit(cluster.url)
        if parsed.scheme not in ("http", "https") or parsed.hostname is None or parsed.port is None:
            raise ApiError(f"RawApi speaks http(s) to host:port, not {cluster.url}")
        self._address = (parsed.hostname, parsed.port)
        self._tls = cluster.ssl_context()  # the real server's https, verified with its CA
        self._head = (
            f"Host: {parsed.hostname}:{parsed.port}\r\nAuthorization: Bearer {cluster.token}\r\n"
            f"Accept: application/json\r\nUser-Agent: {BENCH_USER_AGENT}\r\n"
        ).encode()
        self._sock: socket.socket | None = None
        self._buffer = bytearray()
        self.http_seconds = 0.0

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> RawApi:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create_job(self, namespace: str, body: JsonDict | str, *, exist_ok: bool = False) -> None:
        """Create a Job from its manifest (a dict, or already serialised JSON); with `exist_ok`, a
        409 (one of that name exists) is taken as done."""
        text = body if isinstance(body, str) else json.dumps(body)
        self._request(
            "POST", f"/apis/batch/v1/namespaces/{namespace}/jobs", text, expect=(201, 409) if exist_ok else 201
        )

    def list_jobs_page(
        self, namespace: str, *, label_selector: str, limit: int, continue_token: str | None
    ) -> JsonDict:
        query = {"labelSelector": label_selector, "limit": str(limit)}
        if continue_token:
            query["continue"] = continue_token
        path = f"/apis/batch/v1/namespaces/{namespace}/jobs?{urllib.parse.urlencode(query)}"
        page: dict[str, Any] = json.loads(self._request("GET", path, None, expect=200))
        return page

    def count_jobs(self, namespace: str, *, label_selector: str, page_size: int) -> int:
        """List every matching Job page by page, decoding each page; how many there were."""
        count, token = 0, None
        while True:
            page = self.list_jobs_page(namespace, label_selector=label_selector, limit=page_size, continue_token=token)
            count += len(page["items"])
            token = page["metadata"].get("continue")
            if not token:
                return count

    def _request(self, method: str, path: str, body: str | None, *, expect: int | tuple[int, ...]) -> bytes:
        head = f"{method} {path} HTTP/1.1\r\n".encode() + self._head
        data = body.encode() if body is not None else b""
        if body is not None:
            head += b"Content-Type: application/json\r\nContent-Length: " + str(len(data)).encode() + b"\r\n"
        with Stopwatch() as sw:
            if self._sock is None:
                sock = socket.create_connection(self._address, timeout=30)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._sock = self._tls.wrap_socket(sock, server_hostname=self._address[0]) if self._tls else sock
            self._sock.sendall(head + b"\r\n" + data)
            status, headers = self._read_head()
            answer = self._read_body(headers)
        self.http_seconds += sw.seconds
        if headers.get("connection", "").lower() == "close":
            self.close()
        if status not in (expect if isinstance(expect, tuple) else (expect,)):
            raise ApiError(f"{method} {path}: {status} {answer[:300]!r}")
        return answer

    # --- reading an answer ------------------------------------------------------------

    def _fill(self) -> None:
        assert self._sock is not None
        chunk = self._sock.recv(65536)
        if not chunk:
            self.close()
            raise ApiError("the server closed the connection")
        self._buffer += chunk

    def _take_until(self, marker: bytes) -> bytes:
        while (end := self._buffer.find(marker)) < 0:
            self._fill()
        taken = bytes(self._buffer[:end])
        del self._buffer[: end + len(marker)]
        return taken

    def _take(self, n: int) -> bytes:
        while len(self._buffer) < n:
            self._fill()
        taken = bytes(self._buffer[:n])
        del self._buffer[:n]
        return taken

    def _read_head(self) -> tuple[int, dict[str, str]]:
        lines = self._take_until(b"\r\n\r\n").decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
            raise ApiError(f"not an HTTP/1.x answer: {lines[0]!r}")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        return int(parts[1]), headers

    def _read_body(self, headers: dict[str, str]) -> bytes:
        if "chunked" in headers.get("transfer-encoding", "").lower():
            out = []
            while size := int(self._take_until(b"\r\n").split(b";", 1)[0], 16):
                out.append(self._take(size))
                self._take(2)
            while self._take_until(b"\r\n"):  # trailers, up to the empty line
                pass
            return b"".join(out)
        return self._take(int(headers.get("content-length", "0")))


def create_jobs(
    cluster: Cluster, namespace: str, bodies: Sequence[JsonDict], *, clients: int, exist_ok: bool = False
) -> float:
    """Create `bodies` from `clients` threads, each with its own connection; the seconds it took
    from the first request to the last answer (bodies are serialised and connections opened
    before the clock starts). `exist_ok`: a Job already there under its name counts as created."""
    texts = [json.dumps(body) for body in bodies]
    shares = [texts[i::clients] for i in range(clients)]
    apis = [RawApi(cluster) for _ in shares]
    errors: list[BaseException] = []
    start = threading.Barrier(len(shares) + 1)

    def run(api: RawApi, share: Sequence[str]) -> None:
        start.wait()
        try:
            for body in share:
                api.create_job(namespace, body, exist_ok=exist_ok)
        except (ApiError, OSError, ValueError) as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(api, share)) for api, share in zip(apis, shares, strict=True)]
    try:
        for thread in threads:
            thread.start()
        with Stopwatch() as sw:
            start.wait()
            for thread in threads:
                thread.join()
    finally:
        for api in apis:
            api.close()
    if errors:
        raise ApiError(f"{len(errors)} client(s) failed; first: {errors[0]}") from errors[0]
    return sw.seconds
