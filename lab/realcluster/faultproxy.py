"""A fault-injecting HTTPS proxy in front of kube-apiserver: the chaos run's API faults on the real
control plane, which has no fault injection of its own.

It terminates TLS with a certificate from the control plane's CA (clients verify it as they would
the API server), forwards each request over TLS to kube-apiserver, streams the answer back (watches
included), and for a fraction of requests does instead what a failing server or network does:

- answers 500, 503 or 429 with a Kubernetes `Status` body (503 and 429 with `Retry-After`), as an
  overloaded kube-apiserver or its priority-and-fairness filter would, before forwarding;
- resets the connection before forwarding (a load balancer dropping it);
- forwards the request, then cuts the connection instead of answering (the write happened, the
  client cannot know: what a timeout after sending looks like).

Every request can also be delayed. With `--health-token-file` it also does what the load balancer
in front of every HA control plane does: it checks kube-apiserver's `/readyz` twice a second and
sends nothing to a server that is not ready (the client's connection is cut, as when kube-apiserver
is down). A kube-apiserver reached directly answers between opening its port and syncing its
RBAC caches, and refuses ServiceAccount tokens 403 (`clusterrole ... not found`) in that window
(kubernetes/kubernetes#121635); `/readyz` waits for `informer-sync`. Set at runtime, like localcluster's, with
`POST /faultproxy/faults {"rate": 0.05, "latency_ms": 20}` (optionally `"kinds": ["503", "reset"]`
to draw from those alone; GET: the settings and counts), bearer token from `--token-file`.

    python -m k8s_dispatch.lab.realcluster.faultproxy --port P --upstream https://127.0.0.1:N --ca ca.crt \
        --cert server.crt --key server.key --token-file control.token
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import random
import signal
import ssl
import sys
from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector, web

CONTROL_PATH = "/faultproxy/faults"
NO_FAULT_PATHS = frozenset({"/healthz", "/livez", "/readyz"})
LISTENING = "faultproxy: listening on "  # printed once it serves
# Not forwarded either way (RFC 9110 7.6.1), and what aiohttp sets itself from the body it sends.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "content-length",
})  # fmt: skip
# What aiohttp would add to a request that came without them: the upstream must see the request as
# the client sent it (no Content-Type on the kubernetes client's creates, no gzip it did not ask for).
NO_AUTO_HEADERS = ("Content-Type", "Accept-Encoding", "User-Agent")
UPSTREAM_CONNECT_S = 5.0
HEALTH_INTERVAL_S = 0.5
HEALTH_TIMEOUT_S = 2.0


class Fault(StrEnum):
    INTERNAL_ERROR = "500"
    UNAVAILABLE = "503"
    TOO_MANY_REQUESTS = "429"
    RESET = "reset"  # cut before forwarding: nothing happened
    LOST_RESPONSE = "lost_response"  # forwarded, then cut: it may well have happened


STATUS_FAULTS = {
    Fault.INTERNAL_ERROR: (500, "InternalError", "Internal error occurred: injected fault (faultproxy)", None),
    Fault.UNAVAILABLE: (503, "ServiceUnavailable", "the server is currently unable to handle the request (injected fault)", None),
    Fault.TOO_MANY_REQUESTS: (429, "TooManyRequests",
                              "the server has received too many requests and has asked us to try again later (injected fault)",
                              {"retryAfterSeconds": 1}),
}  # fmt: skip


def status_response(fault: Fault) -> tuple[int, dict[str, str], bytes]:
    """The answer for a status fault: (code, headers, the `Status` body kube-apiserver would send)."""
    code, reason, message, details = STATUS_FAULTS[fault]
    body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                            "message": message, "reason": reason, "code": code}  # fmt: skip
    if details:
        body["details"] = details
    headers = {"Content-Type": "application/json"}
    if code in (503, 429):
        headers["Retry-After"] = "1"
    return code, headers, json.dumps(body).encode()


@dataclass
class Faults:
    """What to inject, drawn per request; counts what was injected."""

    rate: float = 0.0
    latency_ms: int = 0
    kinds: tuple[Fault, ...] = tuple(Fault)  # drawn from with equal odds
    rng: random.Random = field(default_factory=random.Random)
    injected: Counter[str] = field(default_factory=Counter)

    def set(self, rate: float, latency_ms: int, kinds: list[str] | None = None) -> None:
        """Raises ValueError: a rate outside [0, 1], a negative latency, an unknown or no kind."""
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"fault rate must be within [0, 1], got {rate}")
        if latency_ms < 0:
            raise ValueError(f"latency must be >= 0 ms, got {latency_ms}")
        chosen = tuple(Fault(k) for k in kinds) if kinds is not None else self.kinds
        if not chosen:
            raise ValueError("at least one fault kind is needed")
        self.rate, self.latency_ms, self.kinds = rate, latency_ms, chosen

    def draw(self) -> Fault | None:
        if self.rate <= 0 or self.rng.random() >= self.rate:
            return None
        fault = self.rng.choice(self.kinds)
        self.injected[fault.value] += 1
        return fault

    def report(self) -> dict[str, Any]:
        return {"rate": self.rate, "latency_ms": self.latency_ms, "kinds": [k.value for k in self.kinds],
                "injected": sum(self.injected.values()), "by_kind": dict(sorted(self.injected.items()))}  # fmt: skip


def _cut(request: web.Request) -> web.Response:
    """Drop the client's connection without an answer (what it sees: reset, or closed mid-request)."""
    if request.transport is not None:
        request.transport.abort()
    return web.Response(status=500)  # never reaches the client: its connection is gone


def _client_gone(request: web.Request) -> bool:
    """The client closed its connection (what a write to it failed on)."""
    return request.transport is None or request.transport.is_closing()


@dataclass
class Proxy:
    upstream: str
    upstream_ssl: ssl.SSLContext
    control_token: str
    health_token: str | None = None  # None: no readiness checks, every request is forwarded
    faults: Faults = field(default_factory=Faults)
    session: ClientSession | None = None
    ready: bool = False
    unready_cuts: int = 0  # connections cut because kube-apiserver was not ready (not a fault)
    _checks: asyncio.Task[None] | None = None

    async def start(self, app: web.Application) -> None:
        self.session = ClientSession(
            connector=TCPConnector(ssl=self.upstream_ssl, limit=0),
            timeout=ClientTimeout(total=None, sock_connect=UPSTREAM_CONNECT_S),
            auto_decompress=False,  # bytes pass through as kube-apiserver sent them
        )
        if self.health_token is None:
            self.ready = True
        else:
            await self.check_ready()
            self._checks = asyncio.create_task(self.keep_checking())

    async def close(self, app: web.Application) -> None:
        if self._checks is not None:
            self._checks.cancel()
        if self.session is not None:
            await self.session.close()

    async def check_ready(self) -> None:
        assert self.session is not None
        try:
            async with self.session.get(
                self.upstream + "/readyz", headers={"Authorization": f"Bearer {self.health_token}"},
                timeout=ClientTimeout(total=HEALTH_TIMEOUT_S),
            ) as answer:  # fmt: skip
                await answer.read()
                self.ready = answer.status == 200
        except (TimeoutError, ClientError, OSError):
            self.ready = False

    async def keep_checking(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            await self.check_ready()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path == CONTROL_PATH:
            return await self.control(request)
        if not self.ready:
            self.unready_cuts += 1
            return _cut(request)
        fault = None
        if request.path not in NO_FAULT_PATHS:
            if self.faults.latency_ms:
                await asyncio.sleep(self.faults.latency_ms / 1000)
            fault = self.faults.draw()
        if fault in STATUS_FAULTS:
            code, headers, body = status_response(fault)
            return web.Response(status=code, headers=headers, body=body)
        if fault is Fault.RESET:
            return _cut(request)
        return await self.forward(request, lose_response=fault is Fault.LOST_RESPONSE)

    async def forward(self, request: web.Request, *, lose_response: bool) -> web.StreamResponse:
        assert self.session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        body = await request.read()
        try:
            async with self.session.request(
                request.method, self.upstream + request.path_qs, headers=headers, data=body or None,
                allow_redirects=False, skip_auto_headers=NO_AUTO_HEADERS,
            ) as upstream:  # fmt: skip
                if lose_response:
                    await upstream.read()
                    return _cut(request)
                out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
                if upstream.content_length is not None:
                    return web.Response(status=upstream.status, headers=out_headers, body=await upstream.read())
                response = web.StreamResponse(status=upstream.status, headers=out_headers)
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():  # a watch: each event as it comes
                    await response.write(chunk)
                await response.write_eof()
                return response
        except (TimeoutError, ClientError, OSError):
            # kube-apiserver down or gone mid-answer: so is the client's connection. A client that
            # went itself (a watch closed at the end of its slice, a timeout) says nothing of the
            # server: every other request would be cut until the next check.
            if self.health_token is not None and not _client_gone(request):
                self.ready = False  # until a check says otherwise
            return _cut(request)

    async def control(self, request: web.Request) -> web.Response:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.control_token.encode()):
            return web.json_response({"error": "unauthorized"}, status=401)
        if request.method == "POST":
            try:
                settings = await request.json()
                self.faults.set(
                    float(settings.get("rate", self.faults.rate)),
                    int(settings.get("latency_ms", self.faults.latency_ms)),
                    settings.get("kinds"),
                )
            except (ValueError, TypeError, AttributeError) as e:
                return web.json_response({"error": f"invalid fault settings: {e}"}, status=400)
        return web.json_response(self.faults.report() | {"ready": self.ready, "unready_cuts": self.unready_cuts})


# --- for the harness: the proxy as a subprocess, and its control endpoint ----------------------


def process(plane: Any, *, port: int, token_file: Path, log_dir: Path, ready_gate: bool = True,
            name: str = "faultproxy") -> Any:  # fmt: skip
    """`python -m k8s_dispatch.lab.realcluster.faultproxy` in front of `plane` (a started ControlPlane), serving with
    its API server's certificate (CA-signed, loopback names), forwarding only while kube-apiserver
    is ready unless `ready_gate` is False; a ManagedProcess not yet started."""
    from k8s_dispatch.ops.processes import ManagedProcess, project_env

    keys = plane.directory / "pki"
    argv = [sys.executable, "-m", "k8s_dispatch.lab.realcluster.faultproxy", "--port", str(port), "--upstream", plane.url,
            "--ca", str(keys / "ca.crt"), "--cert", str(keys / "apiserver.crt"), "--key", str(keys / "apiserver.key"),
            "--token-file", str(token_file)]  # fmt: skip
    if ready_gate:
        health = log_dir / f"{name}.health-token"
        health.write_text(plane.token)  # any authenticated user may read /readyz; anonymous access is off
        health.chmod(0o600)
        argv += ["--health-token-file", str(health)]
    return ManagedProcess(name, argv, project_env({}), log_dir / f"{name}.log")


def call(
    url: str, *, token: str, ca_file: Path, settings: dict[str, Any] | None = None, timeout: float = 10.0
) -> dict[str, Any]:
    """GET (settings None) or POST the proxy's fault settings; returns its report. Raises OSError."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        url.rstrip("/") + CONTROL_PATH, data=json.dumps(settings).encode() if settings is not None else None,
        method="POST" if settings is not None else "GET",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )  # fmt: skip
    context = ssl.create_default_context(cafile=str(ca_file))
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            return dict(json.loads(response.read()))
    except urllib.error.HTTPError as e:  # an OSError whose open answer holds the connection
        e.close()
        raise


def app_for(proxy: Proxy) -> web.Application:
    app = web.Application(client_max_size=16 * 1024 * 1024)
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.close)
    app.router.add_route("*", "/{tail:.*}", proxy.handle)
    return app


async def _serve(args: argparse.Namespace) -> None:
    upstream_ssl = ssl.create_default_context(cafile=str(args.ca))
    server_ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ssl.load_cert_chain(str(args.cert), str(args.key))
    health_token = args.health_token_file.read_text().strip() if args.health_token_file else None
    proxy = Proxy(upstream=args.upstream.rstrip("/"), upstream_ssl=upstream_ssl,
                  control_token=args.token_file.read_text().strip(), health_token=health_token)  # fmt: skip
    proxy.faults.set(args.fault_rate, args.latency_ms)
    runner = web.AppRunner(app_for(proxy), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, ssl_context=server_ssl)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print(f"{LISTENING}https://{args.host}:{args.port} -> {proxy.upstream}", flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m k8s_dispatch.lab.realcluster.faultproxy", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="kube-apiserver's URL")
    parser.add_argument("--ca", type=Path, required=True, help="the CA that signed kube-apiserver's certificate")
    parser.add_argument("--cert", type=Path, required=True, help="the proxy's serving certificate (CA-signed)")
    parser.add_argument("--key", type=Path, required=True)
    parser.add_argument("--token-file", type=Path, required=True, help="the bearer token of the control endpoint")
    parser.add_argument(
        "--health-token-file",
        type=Path,
        default=None,
        help="a token that may GET /readyz: forward only while kube-apiserver is ready",
    )
    parser.add_argument("--fault-rate", type=float, default=0.0)
    parser.add_argument("--latency-ms", type=int, default=0)
    args = parser.parse_args(argv)
    asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
