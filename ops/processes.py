"""Start, stop and kill the project's processes as real subprocesses, the way the README tells a
user to start them (`celery -A k8s_dispatch.tasks worker`, `celery -A k8s_dispatch.tasks beat`, `python -m k8s_dispatch.demo.localcluster
serve`). Used by the demo, the chaos run, the benchmarks and the process tests.

Each process runs in its own session (process group), so a kill takes its children with it,
and writes its output to a log file the caller can show when something goes wrong.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import k8s_dispatch

T = TypeVar("T")

STACK_DUMP_S = 5.0  # for faulthandler to write a hung process's stacks before its SIGKILL


class WaitTimeout(TimeoutError):
    """A condition polled with a deadline did not hold in time."""


def wait_until(
    condition: Callable[[], T | None],
    *,
    timeout: float,
    interval: float = 0.05,
    what: str = "condition",
    details: Callable[[], str] | None = None,
) -> T:
    """Poll `condition` until it returns something truthy; return that value.

    Raises:
        WaitTimeout: after `timeout` seconds, naming `what`, followed by `details()` (say,
            the processes' logs) when given.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            message = f"timed out after {timeout:.0f}s waiting for {what}"
            raise WaitTimeout(f"{message}\n{details()}" if details else message)
        time.sleep(interval)


@dataclass
class ManagedProcess:
    """One subprocess we can start, kill (any signal) and start again with the same command."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    cwd: Path | None = None
    user: str | None = None  # run as this user (we are root: PostgreSQL refuses to run as root)
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    starts: int = 0

    def start(self) -> ManagedProcess:
        if self.alive:
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"--- start #{self.starts + 1}: {' '.join(self.argv)}\n".encode())
            log.flush()
            self.popen = subprocess.Popen(
                self.argv,
                env=self.env,
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                user=self.user,
            )
        self.starts += 1
        return self

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll() if self.popen else None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to the whole process group and, for SIGKILL, reap it."""
        if not self.alive:
            return
        assert self.popen is not None
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            return
        if sig == signal.SIGKILL:
            self.popen.wait()

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM (a warm shutdown for Celery), then SIGKILL after `timeout` seconds. A Python
        process still there is first sent SIGABRT: `faulthandler` (on in `project_env`) writes
        every thread's stack to its log, so a hung shutdown says where it hung."""
        if self.popen is None:
            return None
        if self.alive:
            self.kill(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self._dump_stacks()
                self.kill(signal.SIGKILL)
        return self.popen.wait()

    def _dump_stacks(self) -> None:
        if self.env.get("PYTHONFAULTHANDLER") and self.popen is not None:
            self.popen.send_signal(signal.SIGABRT)  # the process only: its children keep theirs
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(STACK_DUMP_S)

    def restart(self) -> ManagedProcess:
        self.stop()
        return self.start()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


def project_env(overrides: Mapping[str, str]) -> dict[str, str]:
    """The current environment plus `overrides`, with the project importable from anywhere."""
    env = dict(os.environ)
    root = str(Path(k8s_dispatch.__file__).parent.parent)  # where `k8s_dispatch` is found, not its folders
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env["PYTHONFAULTHANDLER"] = "1"  # a fatal signal (and `stop`'s SIGABRT) writes the stacks to the log
    env.update(overrides)
    return env


def celery_worker(
    name: str, *, env: Mapping[str, str], log_dir: Path, concurrency: int = 4, extra: tuple[str, ...] = ()
) -> ManagedProcess:
    """`celery -A k8s_dispatch.tasks worker` with a unique node name."""
    argv = [
        sys.executable, "-m", "celery", "-A", "k8s_dispatch.tasks", "worker",
        "--loglevel=INFO", f"--hostname={name}@%h", f"--concurrency={concurrency}",
        "--without-mingle", "--without-gossip", *extra,
    ]  # fmt: skip
    # Celery's INFO line for each poll, admit, sweep: tests and benchmarks count them in the log.
    return ManagedProcess(
        name, argv, project_env({"K8S_DISPATCH_HOUSEKEEPING_LOG": "info", **env}), log_dir / f"{name}.log"
    )


def celery_beat(*, env: Mapping[str, str], log_dir: Path, name: str = "beat") -> ManagedProcess:
    """`celery -A k8s_dispatch.tasks beat` (its scheduler keeps nothing on disk: see celeryconfig)."""
    argv = [sys.executable, "-m", "celery", "-A", "k8s_dispatch.tasks", "beat", "--loglevel=INFO"]
    return ManagedProcess(name, argv, project_env(env), log_dir / f"{name}.log")


def celery_flower(
    *,
    env: Mapping[str, str],
    log_dir: Path,
    port: int,
    address: str = "127.0.0.1",
    extra: tuple[str, ...] = (),
    name: str = "flower",
) -> ManagedProcess:
    """`k8s-dispatch flower` on `address:port`; its state (--persistent off) stays in memory."""
    argv = [sys.executable, "-m", "k8s_dispatch.cli", "flower", f"--port={port}", f"--address={address}", *extra]
    return ManagedProcess(name, argv, project_env(env), log_dir / f"{name}.log")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now: for a server that must come back on the same port after a restart."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` TCP ports free right now, all different (each held until all are found): for a server
    that listens on several at once and comes back on them after a restart.

    Taken below the kernel's ephemeral range (`ip_local_port_range`), where port 0 would land:
    the kernel gives those to every outgoing connection, and one could take a stopped server's
    port before it starts again ("bind: address already in use")."""
    candidates = _server_ports()
    held: list[socket.socket] = []
    try:
        while len(held) < n:
            if not candidates:
                raise OSError(f"no {n} free TCP ports on {host} outside the ephemeral range")
            port = candidates.pop(_random.randrange(len(candidates)))
            try:
                held.append(socket.create_server((host, port)))
            except OSError:
                continue
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


SERVER_PORTS_FLOOR = 10_000  # below it: the well-known services' ports (PostgreSQL, Redis, ...)
_PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_random = random.SystemRandom()  # forked test workers must not draw the same ports


def _server_ports() -> list[int]:
    """The ports `free_ports` draws from: between SERVER_PORTS_FLOOR and the ephemeral range's
    low end, or above its high end where that leaves more."""
    try:
        low, high = (int(x) for x in _PORT_RANGE.read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    below, above = range(SERVER_PORTS_FLOOR, low), range(high + 1, 65536)
    return list(below if len(below) >= len(above) else above)


def localcluster_server(
    *,
    log_dir: Path,
    kubeconfig: Path,
    mode: str = "simulate",
    state: Path | None = None,
    port: int = 0,
    tls_port: int = 0,
    fault_rate: float = 0.0,
    latency_ms: int = 0,
    env: Mapping[str, str] | None = None,
    name: str = "localcluster",
) -> ManagedProcess:
    """`python -m k8s_dispatch.demo.localcluster serve`; wait for `LISTENING` in its log. With `state` and fixed
    ports (`port`: http, `tls_port`: the https one the kubeconfig names), a restart comes back
    with the same objects at the same URLs (and the same token and certificate, read back from
    next to `kubeconfig`)."""
    argv = [
        sys.executable, "-m", "k8s_dispatch.demo.localcluster", "serve", "--port", str(port), "--tls-port", str(tls_port), "--mode", mode,
        "--kubeconfig", str(kubeconfig), "--fault-rate", str(fault_rate), "--latency-ms", str(latency_ms),
        *(["--state", str(state)] if state is not None else []),
    ]  # fmt: skip
    return ManagedProcess(name, argv, project_env(env or {}), log_dir / f"{name}.log")


LISTENING = "listening on "  # what `localcluster serve` prints once it serves


def wait_for_log(process: ManagedProcess, text: str, *, timeout: float) -> str:
    """Wait until `text` appears in the process's log since its latest start; return that line."""
    marker = f"--- start #{process.starts}:"

    def found() -> str | None:
        if not process.alive:
            raise RuntimeError(f"{process.name} exited ({process.returncode}):\n{process.log_tail()}")
        log = process.log_path.read_text(errors="replace")
        for line in log[log.rfind(marker) :].splitlines():
            if text in line:
                return line
        return None

    return wait_until(found, timeout=timeout, what=f"{text!r} in {process.name}'s log")
