"""Running the cluster: `serve()` starts the HTTP server on the current event loop and writes the
kubeconfig; `LocalCluster` runs it on its own loop in a background thread for tests, the demo and
the bench:

    with LocalCluster(mode="simulate") as cluster:
        config.load_kube_config(config_file=str(cluster.kubeconfig))
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml
from aiohttp import web

from k8s_dispatch.demo.localcluster import kubeconfig as kubeconfig_file
from k8s_dispatch.demo.localcluster import tls
from k8s_dispatch.demo.localcluster.apierrors import ApiError
from k8s_dispatch.demo.localcluster.audit import RequestCount
from k8s_dispatch.demo.localcluster.core import ClusterCore
from k8s_dispatch.demo.localcluster.server import build_app

R = TypeVar("R")


def token_from_kubeconfig(path: Path) -> str | None:
    """The bearer token of an existing localcluster kubeconfig (so a restart keeps credentials)."""
    try:
        doc = yaml.safe_load(Path(path).read_text())
        for user in doc.get("users") or []:
            if user.get("name") == kubeconfig_file.CONTEXT:
                token: str = user["user"]["token"]
                return token
    except (OSError, yaml.YAMLError, AttributeError, KeyError, TypeError):
        return None
    return None


class Server:
    """The cluster core plus its HTTP server, started and stopped on the running loop."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        kubeconfig_path: Path | None = None,
        tls: bool = True,
        tls_port: int = 0,
        tls_dir: Path | None = None,
        **core_options: Any,
    ) -> None:
        self.host = host
        self.port = port
        self.token = token or secrets.token_urlsafe(32)
        self.kubeconfig_path = Path(kubeconfig_path) if kubeconfig_path else None
        self.tls = tls
        self.tls_port = tls_port
        self.tls_dir = (
            Path(tls_dir)
            if tls_dir
            else (self.kubeconfig_path.with_name(self.kubeconfig_path.name + ".tls") if self.kubeconfig_path else None)
        )
        self.tls_error = ""
        self._core_options = core_options
        self.core: ClusterCore | None = None
        self._runner: web.AppRunner | None = None
        self.url = ""
        self.https_url = ""

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.core = ClusterCore(loop=loop, **self._core_options)
        self.core.start()
        app = build_app(self.core, self.token)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=2.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self.url = f"http://{self.host}:{self.port}"
        files = None
        if self.tls and self.tls_dir is not None:
            try:
                files = tls.ensure_certificate(self.tls_dir, [self.host])
            except tls.TlsUnavailable as e:
                self.tls_error = str(e)
        if files is not None:
            secure = web.TCPSite(self._runner, self.host, self.tls_port, ssl_context=files.server_context())
            await secure.start()
            self.tls_port = self._runner.addresses[1][1]
            self.https_url = f"https://{self.host}:{self.tls_port}"
        if self.kubeconfig_path is not None:
            if files is not None:
                kubeconfig_file.write(self.kubeconfig_path, self.https_url, self.token, ca_data=files.ca_data())
            else:
                kubeconfig_file.write(self.kubeconfig_path, self.url, self.token)

    async def close(self) -> None:
        if self.core is not None:
            self.core.store.close_watchers()
        if self._runner is not None:
            server = self._runner.server
            transports = [h.transport for h in (server.connections if server else [])]
            await self._runner.cleanup()
            # a TLS connection still open waits for the peer's close_notify: cut it, so no socket outlives the loop
            for transport in transports:
                if transport is not None:
                    transport.abort()
            for _ in range(3):
                await asyncio.sleep(0)
            self._runner = None
        if self.core is not None:
            await self.core.close()
            self.core = None


class LocalCluster:
    """A cluster on a background thread. `url` is plain http; the kubeconfig points at `https_url`
    (a second port, self-signed certificate in the kubeconfig) because kubectl sends credentials
    only over TLS; with tls=False (or no openssl) it points at `url`.

    Options past the contract's: `token`, `max_running` (exec-mode processes at once),
    `retry_backoff` (seconds before the first re-created Pod of a failing Job, doubling),
    `event_log_size` (events kept for watches), `tls`, `tls_port`, `tls_dir`, `kubelet` (False:
    no node in process; Pods wait for an external `localcluster node` agent)."""

    def __init__(
        self,
        mode: str = "exec",
        state_path: str | Path | None = None,
        fault_rate: float = 0.0,
        latency_ms: int = 0,
        kubeconfig_path: str | Path | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        token: str | None = None,
        max_running: int | None = None,
        retry_backoff: float = 0.1,
        event_log_size: int = 50_000,
        tls: bool = True,
        tls_port: int = 0,
        tls_dir: str | Path | None = None,
        kubelet: bool = True,
    ) -> None:
        self._tmpdir: str | None = None
        if kubeconfig_path is None:
            self._tmpdir = tempfile.mkdtemp(prefix="localcluster-kube-")
            kubeconfig_path = Path(self._tmpdir) / "kubeconfig"
        self.kubeconfig = Path(kubeconfig_path)
        self._server = Server(
            host=host,
            port=port,
            token=token,
            kubeconfig_path=self.kubeconfig,
            tls=tls,
            tls_port=tls_port,
            tls_dir=Path(tls_dir) if tls_dir else None,
            mode=mode,
            state_path=Path(state_path) if state_path else None,
            fault_rate=fault_rate,
            latency_ms=latency_ms,
            max_running=max_running,
            retry_backoff=retry_backoff,
            event_log_size=event_log_size,
            kubelet=kubelet,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return self._server.url

    @property
    def https_url(self) -> str:
        """The TLS listener's URL ("" when TLS is off): what the kubeconfig names."""
        return self._server.https_url

    @property
    def token(self) -> str:
        return self._server.token

    @property
    def mode(self) -> str:
        mode: str = self._server._core_options["mode"]
        return mode

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="localcluster", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            self._cleanup_tmp()
            raise self._error

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        finally:
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.run_until_complete(loop.shutdown_default_executor())
            finally:
                loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        try:
            await self._server.start()
        except BaseException as e:  # reported to the starting thread, which re-raises it
            self._error = e
            self._ready.set()
            await self._server.close()
            return
        self._ready.set()
        await self._stop.wait()
        await self._server.close()

    def stop(self) -> None:
        if self._thread is None:
            return
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join()
        self._thread = None
        self._cleanup_tmp()

    def _cleanup_tmp(self) -> None:
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def call(self, fn: Callable[[ClusterCore], R], timeout: float = 10.0) -> R:
        """Run `fn(core)` on the cluster's loop and return its result (for inspection in tests)."""
        assert self._loop is not None and self._server.core is not None
        core = self._server.core

        async def run() -> R:
            return fn(core)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout)

    def audit(self, *, clear: bool = False) -> set[tuple[str, str, str]]:
        """(group, resource, verb) of every API request made so far (see demo/localcluster/audit.py)."""

        def read(core: Any) -> set[tuple[str, str, str]]:
            seen = set(core.audit.seen())
            if clear:
                core.audit.clear()
            return seen

        return self.call(read)

    def request_counts(self) -> list[RequestCount]:
        """`apiserver_request_total` so far: (labels, response code, count) rows (see demo/localcluster/audit.py)."""
        return self.call(lambda core: core.audit.request_counts())

    def break_watches(self, code: int = 500, message: str = "injected watch error (localcluster)") -> int:
        """End every open watch with an ERROR event of `code` after the events it has queued
        (what a watch meets when the server's storage fails); how many it ended."""
        status = ApiError(code, "InternalError", message).status()
        return self.call(lambda core: core.store.break_watches(status))

    def set_faults(self, rate: float, latency_ms: int) -> None:
        """Change fault injection at runtime (raises ValueError for out-of-range values)."""
        if not 0.0 <= rate <= 1.0 or latency_ms < 0:
            raise ValueError(f"invalid faults: rate={rate} latency_ms={latency_ms}")
        self.call(lambda core: core.faults.set(rate, latency_ms))
