"""How many Jobs a dispatch may get (pure): a lost Job, or a Job whose result was lost, is made
again until `K8S_DISPATCH_MAX_JOB_ATTEMPTS` Jobs were made; then the dispatch fails `JobLost`.
One rule for the completion path and the sweep's plan."""

from __future__ import annotations

JOB_LOST_REASON = "JobLost"


def out_of_attempts(attempts: int, max_job_attempts: int) -> bool:
    """Whether a dispatch whose Job of attempt `attempts` (re-creations before it) was lost, or
    lost its result, fails `JobLost` rather than runs again: `max_job_attempts` counts Jobs."""
    return attempts + 1 >= max_job_attempts
