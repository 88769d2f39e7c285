"""Beat's heartbeat: a file holding when beat last handed a task to the broker, for a liveness probe.

Beat is the one process whose death, a hang in a publish or a broker it cannot reach stops
polling, and it has no ping of its own. Its scheduler (`tasks/beat_scheduler.py`) writes
`HEARTBEAT_FILE` in the temp dir after each task it sent; the probe in deploy/ fails once no
task was sent for a while. The time written is the boot-time clock (what `/proc/uptime` shows),
not the wall clock: a step of the host's clock neither ages a fresh heartbeat nor makes a stale
one look new, and the probe reads the same clock on the same host.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path

HEARTBEAT_FILE = "k8s-dispatch-beat.heartbeat"


def heartbeat_path() -> Path:
    """Where beat's heartbeat is: `$TMPDIR` (default /tmp), writable under a read-only root."""
    return Path(tempfile.gettempdir()) / HEARTBEAT_FILE


def liveness_clock() -> float:
    """Seconds on the clock `/proc/uptime` shows (CLOCK_BOOTTIME): never stepped, shared by every
    process of the host (or of the container's time namespace), the probe's shell included."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def write_heartbeat(path: Path | None = None) -> None:
    """Record that a task was sent just now: the liveness clock, one line, replaced atomically (a
    probe never reads half a line). Errors are swallowed: no heartbeat means the probe restarts
    beat, the right outcome for a broken temp dir."""
    path = path or heartbeat_path()
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    with contextlib.suppress(OSError):
        partial.write_text(f"{liveness_clock():.3f}\n")
        os.replace(partial, path)


def clear_heartbeat(path: Path | None = None) -> None:
    """Remove a heartbeat left by an earlier beat (a restarted container keeps its temp dir): this
    beat is alive once it has sent something itself."""
    with contextlib.suppress(OSError):
        (path or heartbeat_path()).unlink(missing_ok=True)
