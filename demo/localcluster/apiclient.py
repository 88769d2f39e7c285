"""An asyncio client of any Kubernetes API server, for the node agent (demo/localcluster/node.py):
the kubeconfig as the official client reads it (server, CA, token or client certificate), JSON
requests over aiohttp, errors as `ApiStatusError` keyed on the answer's Status, and one watch
stream read event by event. It knows nothing of localcluster's store.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol, cast

import aiohttp
from kubernetes import client as kube_client
from kubernetes import config as kube_config

JSON = "application/json"
JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"
USER_AGENT = "localcluster-node/v1"


class _LoadKubeConfig(Protocol):
    """`kubernetes.config.load_kube_config`, as it is written (it carries no annotations)."""

    def __call__(
        self,
        config_file: str | None = None,
        context: str | None = None,
        client_configuration: kube_client.Configuration | None = None,
        persist_config: bool = True,
        temp_file_path: str | None = None,
    ) -> None: ...


class ApiStatusError(Exception):
    """The server answered with an error Status (its code, reason and message)."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(f"{code} {reason}: {message}")
        self.code = code
        self.reason = reason
        self.message = message

    @property
    def transient(self) -> bool:
        """Worth retrying: the server is unwell or busy, not refusing this request."""
        return self.code >= 500 or self.code == 429


def _status_error(code: int, body: bytes) -> ApiStatusError:
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    if isinstance(doc, dict) and doc.get("kind") == "Status":
        return ApiStatusError(int(doc.get("code") or code), doc.get("reason") or "", doc.get("message") or "")
    return ApiStatusError(code, "", body.decode(errors="replace")[:500])


def load_kubeconfig(path: Path, *, context: str | None = None) -> tuple[str, dict[str, str], ssl.SSLContext | bool]:
    """(server URL, auth headers, TLS context) from a kubeconfig, as the official client loads it."""
    cfg = kube_client.Configuration()
    load = cast(_LoadKubeConfig, kube_config.load_kube_config)  # unannotated in kubernetes
    load(config_file=str(path), context=context, client_configuration=cfg, persist_config=False)
    headers: dict[str, str] = {}
    bearer = cfg.auth_settings().get("BearerToken")  # the one credential the client sends in a header
    if bearer is not None and bearer["value"]:
        headers[bearer["key"]] = bearer["value"]
    tls: ssl.SSLContext | bool = True
    if cfg.host.startswith("https:"):
        ctx = ssl.create_default_context(cafile=cfg.ssl_ca_cert) if cfg.ssl_ca_cert else ssl.create_default_context()
        if not cfg.verify_ssl:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if cfg.cert_file:
            ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
        tls = ctx
    return cfg.host.rstrip("/"), headers, tls


class ApiClient:
    def __init__(self, kubeconfig: Path, *, context: str | None = None, request_timeout: float = 30.0) -> None:
        self.server, self._headers, self._tls = load_kubeconfig(kubeconfig, context=context)
        self._headers.update({"Accept": JSON, "User-Agent": USER_AGENT})
        self._timeout = aiohttp.ClientTimeout(total=request_timeout)
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers=self._headers, connector=aiohttp.TCPConnector(ssl=self._tls, limit=32)
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        body: Any = None,
        content_type: str = JSON,
    ) -> dict[str, Any]:
        """One request; the decoded JSON answer. Raises ApiStatusError, or aiohttp.ClientError /
        TimeoutError when the server cannot be reached."""
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": content_type} if data is not None else None
        async with self._http().request(
            method, self.server + path, params=params, data=data, headers=headers, timeout=self._timeout
        ) as resp:
            raw = await resp.read()
            if resp.status >= 400:
                raise _status_error(resp.status, raw)
            return json.loads(raw) if raw else {}

    async def watch(self, path: str, *, params: dict[str, Any], timeout: float) -> AsyncIterator[dict[str, Any]]:
        """The events of one watch stream (`{"type", "object"}`), until the server ends it. An
        ERROR event is raised as ApiStatusError (410 Gone: list again)."""
        query = {**params, "watch": "true", "timeoutSeconds": str(int(timeout))}
        stream_timeout = aiohttp.ClientTimeout(total=timeout + 30, sock_connect=10)
        async with self._http().get(self.server + path, params=query, timeout=stream_timeout) as resp:
            if resp.status >= 400:
                raise _status_error(resp.status, await resp.read())
            buffer = b""
            async for chunk in resp.content.iter_any():
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    if event.get("type") == "ERROR":
                        obj = event.get("object") or {}
                        raise ApiStatusError(
                            int(obj.get("code") or 500), obj.get("reason") or "", obj.get("message") or ""
                        )
                    yield event
