"""Beat's heartbeat: a file beat touches after every tick, for a liveness probe to age-check.

Beat is the one process whose death (or a hang in a publish) stops polling, and it has no ping
of its own. `HeartbeatScheduler` (celeryconfig's `beat_scheduler`) touches `HEARTBEAT_FILE` in
the temp dir after each tick; the probe in deploy/ fails once the file is older than a few poll
intervals. The file's age is read on the host that wrote it, so no two clocks are compared.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Any

from celery.beat import Scheduler

HEARTBEAT_FILE = "k8s-dispatch-beat.heartbeat"


def heartbeat_path() -> Path:
    """Where beat's heartbeat is: `$TMPDIR` (default /tmp), writable under a read-only root."""
    return Path(tempfile.gettempdir()) / HEARTBEAT_FILE


class HeartbeatScheduler(Scheduler):
    """Celery's in-memory scheduler, touching the heartbeat file after every tick it completes."""

    def tick(self, *args: Any, **kwargs: Any) -> float:
        interval: float = super().tick(*args, **kwargs)
        # No heartbeat means the probe restarts beat: the right outcome for a broken temp dir.
        with contextlib.suppress(OSError):
            heartbeat_path().touch()
        return interval
