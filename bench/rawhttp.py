"""A bare HTTP/1.1 keep-alive client for the Jobs API: what the server can do, with no client
library in the way. Used to measure localcluster itself and to fill it quickly for the other
benchmarks; the project's own client (`workers.kube.KubeClient`) is measured next to it.
"""

from __future__ import annotations

import http.client
import json
import threading
import urllib.parse
from collections.abc import Sequence
from typing import Any

from bench.services import Cluster
from bench.timing import Stopwatch

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
        self._conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=30)
        self._headers = {"Authorization": f"Bearer {cluster.token}", "Accept": "application/json"}
        self.http_seconds = 0.0

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> RawApi:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create_job(self, namespace: str, body: JsonDict | str) -> None:
        """Create a Job from its manifest (a dict, or already serialised JSON)."""
        text = body if isinstance(body, str) else json.dumps(body)
        self._request("POST", f"/apis/batch/v1/namespaces/{namespace}/jobs", text, expect=201)

    def list_jobs_page(
        self, namespace: str, *, label_selector: str, limit: int, continue_token: str | None
    ) -> JsonDict:
        query = {"labelSelector": label_selector, "limit": str(limit)}
        if continue_token:
            query["continue"] = continue_token
        path = f"/apis/batch/v1/namespaces/{namespace}/jobs?{urllib.parse.urlencode(query)}"
        return json.loads(self._request("GET", path, None, expect=200))

    def count_jobs(self, namespace: str, *, label_selector: str, page_size: int) -> int:
        """List every matching Job page by page, decoding each page; how many there were."""
        count, token = 0, None
        while True:
            page = self.list_jobs_page(namespace, label_selector=label_selector, limit=page_size, continue_token=token)
            count += len(page["items"])
            token = page["metadata"].get("continue")
            if not token:
                return count

    def _request(self, method: str, path: str, body: str | None, *, expect: int) -> bytes:
        headers = dict(self._headers)
        if body is not None:
            headers["Content-Type"] = "application/json"
        with Stopwatch() as sw:
            self._conn.request(method, path, body, headers)
            response = self._conn.getresponse()
            data = response.read()
        self.http_seconds += sw.seconds
        if response.status != expect:
            raise ApiError(f"{method} {path}: {response.status} {data[:300]!r}")
        return data


def create_jobs(cluster: Cluster, namespace: str, bodies: Sequence[JsonDict], *, clients: int) -> float:
    """Create `bodies` from `clients` threads, each with its own connection; the seconds it took
    from the first request to the last answer (bodies are serialised and connections opened
    before the clock starts)."""
    texts = [json.dumps(body) for body in bodies]
    shares = [texts[i::clients] for i in range(clients)]
    apis = [RawApi(cluster) for _ in shares]
    errors: list[BaseException] = []
    start = threading.Barrier(len(shares) + 1)

    def run(api: RawApi, share: Sequence[str]) -> None:
        start.wait()
        try:
            for body in share:
                api.create_job(namespace, body)
        except (ApiError, OSError, http.client.HTTPException) as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(api, share)) for api, share in zip(apis, shares)]
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
