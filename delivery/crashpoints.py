"""Named crash points: a test seam of our own for the crash-point matrix.

`crashpoint(name)` SIGKILLs the current process when the environment variable
`K8S_DISPATCH_CRASH_AT` names that point (a comma list; `name@N` fires on the Nth hit of the
point in this process). Unset, it is one dictionary lookup. Nothing is patched: the worker
under test runs the production code path and dies exactly where a real crash would hit.
"""

from __future__ import annotations

import os
import signal
import threading
from collections import Counter
from collections.abc import Mapping
from enum import StrEnum

ENV_VAR = "K8S_DISPATCH_CRASH_AT"


class Point(StrEnum):
    AFTER_SCHEDULE_COMMIT = "after_schedule_commit"  # dispatch committed, create_job not enqueued
    AFTER_ADMIT_COMMIT = "after_admit_commit"  # admitted (SCHEDULED, a slot held), create_jobs not sent
    BEFORE_JOB_CREATE = "before_job_create"  # create_job task started, Job not created
    AFTER_JOB_CREATE = "after_job_create"  # Job created, dispatch not marked created
    BEFORE_COMPLETE_WRITE = "before_complete_write"  # Job terminal, completion not written
    AFTER_COMPLETE_WRITE = "after_complete_write"  # completion written; engine not notified, finalizer on
    MID_SWEEP = "mid_sweep"  # the recovery sweep, part-way through


_hits: Counter[str] = Counter()
_lock = threading.Lock()


def armed(environ: Mapping[str, str] | None = None) -> dict[str, int]:
    """The points armed by the environment: name -> the hit that fires (1 = the first)."""
    spec = (os.environ if environ is None else environ).get(ENV_VAR, "")
    points: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, nth = item.partition("@")
        points[name] = int(nth) if nth else 1
    return points


def crashpoint(name: str | Point) -> None:
    """Die here, at once and without clean-up (SIGKILL), if this point is armed."""
    key = name.value if isinstance(name, Point) else name
    spec = os.environ.get(ENV_VAR)
    if not spec:
        return
    fire_on = armed().get(key)
    if fire_on is None:
        return
    with _lock:
        _hits[key] += 1
        hit = _hits[key]
    if hit == fire_on:
        os.kill(os.getpid(), signal.SIGKILL)
