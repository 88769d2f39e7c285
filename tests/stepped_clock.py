"""A wall clock the test steps while a process runs (`lab/chaos/faketime.py`: libfaketime reading its
offset from a file at every call, the monotonic clocks left true, `time.sleep` working)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from k8s_dispatch.lab.chaos.faketime import FaketimeNotInstalled, faketime_env, write_offset
from k8s_dispatch.ops import processes


class SteppedClock:
    """The offset file, the environment that obeys it, and a way to step it."""

    def __init__(self, workdir: Path, offset: str = "+0") -> None:
        self.workdir = workdir
        self.offset_file = workdir / "faketime.offset"
        self.step(offset)

    def step(self, offset: str) -> None:
        """Set the offset from the true clock (libfaketime's syntax: "+700s", "-60s")."""
        write_offset(self.offset_file, offset)

    def env(self) -> dict[str, str]:
        """Overrides for `processes.project_env` (or a ManagedProcess's env)."""
        try:
            return faketime_env(self.workdir, offset_file=self.offset_file)
        except FaketimeNotInstalled as e:
            pytest.fail(str(e))

    def offset_seen(self) -> float:
        """How far a fresh process with `env()` is off the true clock (after one sleep, which
        libfaketime's bug would fail): the step really took hold."""
        before = time.time()
        out = subprocess.run(
            [sys.executable, "-c", "import time; time.sleep(0.01); print(time.time())"],
            env=processes.project_env(self.env()),
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
        return float(out) - (before + time.time()) / 2
