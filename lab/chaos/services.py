"""The chaos run's own servers and clocks: a redis-server and a PostgreSQL instance that belong to
the run alone (on free ports, in temp dirs), so that restarting them hurts nobody else, and the
faked wall clocks of the processes whose clock the run steps.

- `OwnRedis`: `redis-server` with an append-only file (fsync every second, as a production Redis
  keeps it): a restart is SIGKILL, then a start on the same port and the same files.
- `OwnPostgres`: `initdb` into a temp dir with the Debian binaries, `postgres` on a free port as the
  `postgres` user when we are root; a restart is SIGKILL of the postmaster and every backend, then a
  start that replays the WAL, as after a host crash.
- `OwnObjectStore`: SeaweedFS's `weed mini` (master, volume server, filer and S3 gateway in one
  process; built by `tools/build.sh seaweedfs`) on free ports, its data under the run's work dir: a
  restart is SIGKILL, then a start on the same ports and data, ready once a signed PUT succeeds.
- `SteppedClock`: a process runs under libfaketime reading its offset from a file (again every
  second: `FAKETIME_NO_CACHE`, a read on every call, made a worker's start-up 30 times slower), so
  the offset jumps while it runs, within about 2 s of a step; the monotonic clocks stay true. libfaketime 0.9.10 breaks
  `clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)` (EINVAL, or a sleep of the whole offset), which
  Python 3.11's `time.sleep` uses: a small preloaded shim sends monotonic sleeps to the kernel, so
  a faked process fails only where a host whose clock stepped would, with no Python patched (and
  the previous release's workers keep their own `PYTHONPATH`). `lab.chaos.faketime` is the clock tests'
  variant of the same (a `sitecustomize`, an offset read at every call).
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k8s_dispatch.lab import seaweedfs
from k8s_dispatch.lab.chaos.faketime import libfaketime, write_offset
from k8s_dispatch.ops.processes import ManagedProcess, free_port, free_ports, wait_for_log, wait_until

START_TIMEOUT_S = 60.0
REDIS_READY = "Ready to accept connections"
PG_READY = "database system is ready to accept connections"
PG_USER = "postgres"


class ServiceUnavailable(RuntimeError):
    """A server binary or library the chaos run needs is not installed."""


# --- Redis -----------------------------------------------------------------------------------------


class OwnRedis:
    """A redis-server of the run's own on a free port, its files under `directory`."""

    def __init__(self, *, directory: Path, log_dir: Path, env: dict[str, str]) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise ServiceUnavailable("redis-server is not installed: run tests/services.sh")
        directory.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        argv = [
            binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(directory), "--save", "",
            "--appendonly", "yes", "--appendfsync", "everysec", "--protected-mode", "no",
        ]  # fmt: skip
        self.proc = ManagedProcess("redis", argv, env, log_dir / "redis.log")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc.start()
        wait_for_log(self.proc, REDIS_READY, timeout=START_TIMEOUT_S)

    def restart(self) -> str:
        pid = self.proc.pid
        self.proc.kill(signal.SIGKILL)
        self.start()
        return f"redis-server (pid {pid}) SIGKILLed and started again on port {self.port} (pid {self.proc.pid})"

    def stop(self) -> None:
        self.proc.stop(timeout=10)


# --- PostgreSQL ------------------------------------------------------------------------------------


def postgres_bin() -> Path:
    """The newest Debian PostgreSQL binaries' directory. Raises ServiceUnavailable: none."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"), key=lambda p: int(Path(p).parts[-3]))
    if not found:
        raise ServiceUnavailable("no /usr/lib/postgresql/*/bin/postgres: run tests/services.sh")
    return Path(found[-1]).parent


def _run_as() -> str | None:
    """The user PostgreSQL runs as: `postgres` when we are root (it refuses root), else ourselves."""
    return PG_USER if os.geteuid() == 0 else None


class OwnPostgres:
    """A PostgreSQL instance of the run's own: `initdb` into a temp dir (removed by `stop`), trust
    authentication on 127.0.0.1, a free port, no Unix socket."""

    def __init__(self, *, log_dir: Path, env: dict[str, str]) -> None:
        self.bin = postgres_bin()
        self.user = _run_as()
        self.data = Path(tempfile.mkdtemp(prefix="k8s-dispatch-chaos-pg-"))
        self.port = free_port()
        self.env = env
        argv = [
            str(self.bin / "postgres"), "-D", str(self.data), "-p", str(self.port), "-c", "listen_addresses=127.0.0.1",
            "-c", "unix_socket_directories=", "-c", "fsync=off", "-c", "max_connections=300",
            "-c", "shared_buffers=32MB",
        ]  # fmt: skip
        self.proc = ManagedProcess("postgres", argv, env, log_dir / "postgres.log", user=self.user)

    @property
    def admin_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        if not (self.data / "PG_VERSION").exists():
            self._initdb()
        self.proc.start()
        wait_for_log(self.proc, PG_READY, timeout=START_TIMEOUT_S)

    def _initdb(self) -> None:
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            os.chown(self.data, entry.pw_uid, entry.pw_gid)
        done = subprocess.run(
            [str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
             "--no-sync", "--locale=C"],
            user=self.user, env=self.env, cwd=self.data, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed ({done.returncode}): {done.stdout}{done.stderr}")

    def restart(self) -> str:
        pid = self.proc.pid
        self.proc.kill(signal.SIGKILL)  # the postmaster and its backends: one process group
        self.start()
        return f"postgres (pid {pid}) and its backends SIGKILLed, started again on port {self.port} (WAL replayed)"

    def stop(self) -> None:
        try:
            if self.proc.alive:
                self.proc.kill(signal.SIGINT)  # a fast shutdown: ends the sessions at once
                self.proc.stop(timeout=15)
        finally:
            shutil.rmtree(self.data, ignore_errors=True)


# --- the object store ------------------------------------------------------------------------------

BUILD_SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "build.sh"
BUILD_TIMEOUT_S = 1800.0  # a cold build of weed: about 11 CPU-minutes
STORE_BUCKET = "chaos"
PROBE_KEY = ".chaos-probe"


def weed_binary() -> Path:
    """`weed`, built from its Go module into the tools cache (a cached build only hashes its
    inputs). Raises ServiceUnavailable: the build failed."""
    try:
        done = subprocess.run(["bash", str(BUILD_SCRIPT), "seaweedfs"], capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S)  # fmt: skip
    except subprocess.TimeoutExpired as e:
        raise ServiceUnavailable(f"tools/build.sh seaweedfs took over {BUILD_TIMEOUT_S:g}s") from e
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise ServiceUnavailable(f"tools/build.sh seaweedfs failed ({done.returncode}): {done.stderr[-2000:]}")
    return Path(lines[-1]) / "weed"


class OwnObjectStore:
    """A SeaweedFS of the run's own (`weed mini`) on free ports, its data under `directory`, one
    bucket (STORE_BUCKET) and one identity with a fresh secret key."""

    def __init__(self, *, directory: Path, log_dir: Path, env: dict[str, str]) -> None:
        weed = weed_binary()
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "data").mkdir(exist_ok=True)
        self.access_key, self.secret_key = "chaos", secrets.token_hex(16)
        (directory / "s3.json").write_text(seaweedfs.s3_config("chaos", self.access_key, self.secret_key))
        p = free_ports(seaweedfs.PORTS)
        self.port = p[6]
        argv = seaweedfs.mini_argv(weed, directory, p, STORE_BUCKET)
        self.proc = ManagedProcess("seaweedfs", argv, env, log_dir / "seaweedfs.log", cwd=directory)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def settings(self, prefix: str) -> dict[str, str]:
        """The K8S_DISPATCH_* settings (without the prefix) that use this store, objects under `prefix`."""
        return {
            "OBJECT_STORE_ENDPOINT": self.endpoint,
            "OBJECT_STORE_BUCKET": STORE_BUCKET,
            "OBJECT_STORE_PREFIX": prefix,
            "OBJECT_STORE_ACCESS_KEY": self.access_key,
            "OBJECT_STORE_SECRET_KEY": self.secret_key,
        }

    def client(self) -> Any:
        """A boto3 S3 client of the store (the harness's own: its reads and lists)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}, connect_timeout=5, read_timeout=30,
                          retries={"max_attempts": 3, "mode": "standard"}),
        )  # fmt: skip

    def start(self) -> None:
        """Start it and wait until it takes writes. Raises WaitTimeout, RuntimeError (it exited)."""
        self.proc.start()
        self.wait_ready()

    def wait_ready(self) -> None:
        """Until a signed PUT succeeds (the gateway answers before the filer and a volume take
        writes; after a SIGKILL, seen 15 s). Raises WaitTimeout, RuntimeError (it exited)."""
        from botocore.exceptions import BotoCoreError, ClientError

        client = self.client()

        def writable() -> bool:
            if not self.proc.alive:
                raise RuntimeError(f"weed exited with code {self.proc.returncode}:\n{self.proc.log_tail(20)}")
            try:
                client.put_object(Bucket=STORE_BUCKET, Key=PROBE_KEY, Body=b"ok")
                client.delete_object(Bucket=STORE_BUCKET, Key=PROBE_KEY)
            except (BotoCoreError, ClientError):
                return False
            return True

        try:
            wait_until(writable, timeout=START_TIMEOUT_S, interval=0.1, what="the object store to take a write")
        finally:
            client.close()

    def stop(self) -> None:
        self.proc.stop(timeout=10)


# --- faked clocks ----------------------------------------------------------------------------------

SHIM_SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
/* Monotonic (and boot-time) sleeps go to the kernel: libfaketime 0.9.10 answers EINVAL to an
   absolute one when the monotonic clock is not faked. Wall-clock sleeps stay libfaketime's. */
int clock_nanosleep(clockid_t id, int flags, const struct timespec *req, struct timespec *rem) {
    if (id != CLOCK_REALTIME) {
        long r = syscall(SYS_clock_nanosleep, id, flags, req, rem);
        return r == -1 ? errno : 0;
    }
    int (*next)(clockid_t, int, const struct timespec *, struct timespec *) = dlsym(RTLD_NEXT, "clock_nanosleep");
    return next(id, flags, req, rem);
}
"""


def build_sleep_shim(directory: Path) -> Path:
    """Compile the monotonic-sleep shim into `directory`. Raises ServiceUnavailable: no C compiler."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise ServiceUnavailable("no C compiler (cc) for the faketime sleep shim: apt-get install gcc")
    directory.mkdir(parents=True, exist_ok=True)
    source, library = directory / "sleepshim.c", directory / "sleepshim.so"
    source.write_text(SHIM_SOURCE)
    done = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(library), str(source), "-ldl"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    if done.returncode != 0:
        raise ServiceUnavailable(f"compiling the faketime sleep shim failed: {done.stderr}")
    return library


@dataclass
class SteppedClock:
    """One process's wall clock: `offset_s` off the true one, changed while it runs by `step`."""

    path: Path
    offset_s: float = 0.0

    def __post_init__(self) -> None:
        self._write()

    def env(self, shim: Path) -> dict[str, str]:
        """What runs a process on this clock."""
        return {
            "LD_PRELOAD": f"{shim} {libfaketime()}",
            "FAKETIME_TIMESTAMP_FILE": str(self.path),
            "FAKETIME_CACHE_DURATION": "1",
            "DONT_FAKE_MONOTONIC": "1",
        }

    def step(self, seconds: float) -> float:
        """Jump the clock by `seconds`; return its new offset."""
        self.offset_s += seconds
        self._write()
        return self.offset_s

    def _write(self) -> None:
        write_offset(self.path, f"{self.offset_s:+.0f}")  # atomic: never an empty file to read
