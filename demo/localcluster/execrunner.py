"""The exec runner: each container runs its `command` + `args` as a local process with its env.

`python`/`python3` as command[0] runs `sys.executable` (this project's venv). The process gets
TERMINATION_MESSAGE_PATH (a per-pod file standing in for terminationMessagePath), HOSTNAME and a
small base environment (PATH, HOME, LANG, TMPDIR, PYTHONPATH, VIRTUAL_ENV from the server);
its working directory is the container's workingDir if it exists, else the server's. Stdout and
stderr go to the pod's log file. At most `max_running` processes run at once; the others wait
(their pods stay Pending, ContainerCreating) in arrival order.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from k8s_dispatch.demo.localcluster.containerenv import command_line, container_env
from k8s_dispatch.demo.localcluster.podstatus import ContainerResult
from k8s_dispatch.demo.localcluster.timestamps import now

MAX_MESSAGE = 4096  # kubelet's per-container termination message limit
FALLBACK_BYTES = 2048
FALLBACK_LINES = 80
MAX_GRACE = 10.0
_BASE_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV", "SYSTEMROOT")


class Callbacks(Protocol):
    def started(self, uid: str, started_at: float, container_id: str) -> None: ...
    def finished(self, uid: str, result: ContainerResult) -> None: ...


@dataclass
class _Run:
    uid: str
    pod: dict[str, Any]
    dir: Path
    process: asyncio.subprocess.Process | None = None
    task: asyncio.Task[None] | None = None
    kill_timer: asyncio.TimerHandle | None = None
    stopping: bool = False
    started_at: float | None = None
    env: dict[str, str] | None = None  # the container's declared env as the kubelet resolved it
    extra: dict[str, Any] = field(default_factory=dict)


def tail(data: bytes, *, max_bytes: int = FALLBACK_BYTES, max_lines: int = FALLBACK_LINES) -> str:
    """The end of a log as FallbackToLogsOnError takes it: at most 80 lines and 2048 bytes."""
    lines = data.splitlines(keepends=True)[-max_lines:]
    return b"".join(lines)[-max_bytes:].decode(errors="replace")


def exit_code(returncode: int) -> int:
    return returncode if returncode >= 0 else 128 - returncode


class ExecRunner:
    immediate = False

    def __init__(
        self,
        callbacks: Callbacks,
        *,
        loop: asyncio.AbstractEventLoop,
        workdir: Path,
        max_running: int,
        cwd: Path | None = None,
    ) -> None:
        self._callbacks = callbacks
        self._loop = loop
        self._workdir = workdir
        self._cwd = cwd or Path.cwd()
        self.max_running = max(1, max_running)
        self._queue: deque[str] = deque()
        self._runs: dict[str, _Run] = {}
        self._running: set[str] = set()
        self._logs: dict[str, Path] = {}
        self._closing = False

    def container_id(self, uid: str) -> str:
        return f"localcluster://exec-{uid[:12]}"

    def start(
        self, uid: str, pod: dict[str, Any], *, started_at: float | None = None, env: dict[str, str] | None = None
    ) -> None:
        if self._closing:  # a Pod bound while the server shuts down: no files left behind it
            return
        meta = pod.get("metadata") or {}
        pod_dir = self._workdir / f"{meta.get('namespace', '')}_{meta.get('name', '')}_{uid[:8]}"
        pod_dir.mkdir(parents=True, exist_ok=True)
        (pod_dir / "termination-log").write_bytes(b"")
        (pod_dir / "log").write_bytes(b"")
        self._logs[uid] = pod_dir / "log"
        self._runs[uid] = _Run(uid, pod, pod_dir, env=env)
        self._queue.append(uid)
        self._pump()

    def running(self, uid: str) -> bool:
        return uid in self._runs

    def _pump(self) -> None:
        while self._queue and len(self._running) < self.max_running and not self._closing:
            uid = self._queue.popleft()
            run = self._runs.get(uid)
            if run is None:
                continue
            self._running.add(uid)
            run.task = self._loop.create_task(self._run(run))

    async def _run(self, run: _Run) -> None:
        try:
            result = await self._execute(run)
        finally:
            self._running.discard(run.uid)
            self._runs.pop(run.uid, None)
            if run.kill_timer is not None:
                run.kill_timer.cancel()
            self._pump()
        self._callbacks.finished(run.uid, result)

    async def _execute(self, run: _Run) -> ContainerResult:
        pod = run.pod
        container = ((pod.get("spec") or {}).get("containers") or [{}])[0]
        env = {k: os.environ[k] for k in _BASE_ENV if k in os.environ}
        env["HOSTNAME"] = (pod.get("metadata") or {}).get("name", "")
        declared = run.env if run.env is not None else container_env(pod, container)
        env.update(declared)
        message_path = run.dir / "termination-log"
        env["TERMINATION_MESSAGE_PATH"] = str(message_path)
        argv = command_line(container, declared)
        if not argv:
            return ContainerResult(
                128, "StartError", "localcluster exec mode runs the container's command: none is set", None, now()
            )
        if argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        workdir = container.get("workingDir")
        cwd = workdir if workdir and os.path.isdir(workdir) else str(self._cwd)
        started = now()
        with open(run.dir / "log", "ab") as log:
            try:
                process = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log,
                    stderr=asyncio.subprocess.STDOUT,
                    env=env,
                    cwd=cwd,
                    start_new_session=True,
                )
            except OSError as e:
                return ContainerResult(
                    128,
                    "StartError",
                    f'failed to create containerd task: exec: "{argv[0]}": {e.strerror or e}',
                    None,
                    now(),
                )
        run.process = process
        run.started_at = started
        if run.stopping:
            self._signal(run, signal.SIGKILL)
        self._callbacks.started(run.uid, started, self.container_id(run.uid))
        returncode = await process.wait()
        finished = now()
        code = exit_code(returncode)
        with open(message_path, "rb") as f:  # the kubelet keeps a longer message's last 4 KiB
            f.seek(max(0, f.seek(0, os.SEEK_END) - MAX_MESSAGE))
            message = f.read().decode(errors="replace")
        policy = container.get("terminationMessagePolicy", "File")
        if not message and code != 0 and policy == "FallbackToLogsOnError":
            message = tail((run.dir / "log").read_bytes())
        return ContainerResult(code, "Completed" if code == 0 else "Error", message, started, finished)

    def _signal(self, run: _Run, sig: signal.Signals) -> None:
        if run.process is None or run.process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.process.pid, sig)

    def stop(self, uid: str, grace: float) -> None:
        run = self._runs.get(uid)
        if run is None:
            return
        if run.task is None:  # still queued: never started
            self._runs.pop(uid, None)
            with contextlib.suppress(ValueError):
                self._queue.remove(uid)
            self._callbacks.finished(
                uid,
                ContainerResult(
                    137,
                    "ContainerStatusUnknown",
                    "The container could not be located when the pod was terminated",
                    None,
                    now(),
                ),
            )
            return
        if run.stopping:
            if grace <= 0:
                self._signal(run, signal.SIGKILL)
            return
        run.stopping = True
        grace = min(float(grace), MAX_GRACE)
        if grace <= 0:
            self._signal(run, signal.SIGKILL)
        else:
            self._signal(run, signal.SIGTERM)
            run.kill_timer = self._loop.call_later(grace, self._signal, run, signal.SIGKILL)

    def logs(self, uid: str) -> bytes:
        path = self._logs.get(uid)
        if path is None or not path.exists():
            return b""
        return path.read_bytes()

    def forget(self, uid: str) -> None:
        self._logs.pop(uid, None)

    async def close(self) -> None:
        self._closing = True
        self._queue.clear()
        tasks = []
        for run in list(self._runs.values()):
            run.stopping = True
            self._signal(run, signal.SIGKILL)
            if run.task is not None:
                tasks.append(run.task)
        if tasks:
            await asyncio.wait(tasks, timeout=10)
        for t in tasks:
            if not t.done():
                t.cancel()
