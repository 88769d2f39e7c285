"""A process whose wall clock is off the true one (skewed, or stepped while it runs), its monotonic
clocks left true: libfaketime preloaded, as the chaos run and the clock tests play such a host.

`faketime_env(workdir, offset="+60s")` is a fixed skew; with `offset_file=` the offset is read
again at every clock call, so `write_offset(file, "-600s")` steps the clock under the running
process, as NTP or a resumed VM would.

Debian's libfaketime 0.9.10 gets `clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)` wrong when the
monotonic clock is left true: Python 3.11's `time.sleep` then fails with OSError(22, 'Invalid
argument') (wolfcw/libfaketime#426) in any code that waits (a Retry-After, a backoff). A
`sitecustomize` on the process's path makes `time.sleep` a relative wait on an Event, which
libfaketime leaves alone: the same sleep, without the bug.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

from k8s_dispatch.ops import processes

_SITECUSTOMIZE = '''"""Under libfaketime with the monotonic clock left true: time.sleep without its EINVAL (lab/chaos/faketime.py)."""
import threading
import time

_never_set = threading.Event()


def _sleep(seconds):
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    _never_set.wait(seconds)


time.sleep = _sleep
'''


class FaketimeNotInstalled(RuntimeError):
    """libfaketime is missing: `apt-get install faketime` (tests/services.sh does)."""


def libfaketime() -> str:
    """The multithreaded libfaketime (workers and beat run threads).

    Raises:
        FaketimeNotInstalled: no libfaketimeMT on this host.
    """
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketimeMT.so.1"))
    if not found:
        raise FaketimeNotInstalled("libfaketime is not installed: run tests/services.sh (apt-get install faketime)")
    return found[0]


def write_offset(offset_file: Path, offset: str) -> None:
    """Set the offset a process started with `offset_file` reads ("+700s", "-60s"), atomically."""
    partial = offset_file.with_name(f".{offset_file.name}.partial")
    partial.write_text(f"{offset}\n")
    os.replace(partial, offset_file)


def faketime_env(workdir: Path, *, offset: str | None = None, offset_file: Path | None = None) -> dict[str, str]:
    """Overrides for `processes.project_env` (or a ManagedProcess's env): the wall clock `offset`
    off, or off by what `offset_file` says at each call; `workdir` holds the sitecustomize.

    Raises:
        ValueError: neither or both of `offset` and `offset_file`.
        FaketimeNotInstalled: no libfaketime on this host.
    """
    if (offset is None) == (offset_file is None):
        raise ValueError("give either offset or offset_file")
    site = workdir / "faketime-site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    clock = {"FAKETIME": offset} if offset is not None else {"FAKETIME_TIMESTAMP_FILE": str(offset_file)}
    return {
        "LD_PRELOAD": libfaketime(),
        **clock,
        "FAKETIME_NO_CACHE": "1",  # a changed offset file is seen at once
        "DONT_FAKE_MONOTONIC": "1",  # timeouts and sleeps keep true time, as on a stepped host
        "PYTHONPATH": os.pathsep.join((str(site), processes.project_env({})["PYTHONPATH"])),
    }
