"""A ResourceQuota on the number of Jobs in a namespace, set by a namespace annotation
(`localcluster.k8s-dispatch.io/quota-jobs: "N"`, as `count/jobs.batch: N` would be): a Job
create past it is refused as the API server's quota admission refuses it, 403 Forbidden
"exceeded quota", until a Job of the namespace is removed. Every Job counts, finished or
being deleted, until it is gone (the quota controller counts objects, not running ones)."""

from __future__ import annotations

from typing import Any

from k8s_dispatch.demo.localcluster import apierrors
from k8s_dispatch.demo.localcluster.apierrors import ApiError
from k8s_dispatch.demo.localcluster.resources import JOBS

QUOTA_JOBS = "localcluster.k8s-dispatch.io/quota-jobs"
QUOTA_NAME = "localcluster-jobs"  # the quota's name in the message, as a ResourceQuota's name would be


def job_create_refusal(namespace_meta: dict[str, Any], *, name: str, used: int) -> ApiError | None:
    """The 403 for creating Job `name` where `used` Jobs exist, or None if the quota has room (pure)."""
    raw = (namespace_meta.get("annotations") or {}).get(QUOTA_JOBS)
    try:
        limit = int(raw) if raw is not None else None
    except ValueError:
        return None
    if limit is None or used + 1 <= limit:
        return None
    return apierrors.forbidden_request(
        JOBS, name,
        f'{JOBS.qualified} "{name}" is forbidden: exceeded quota: {QUOTA_NAME}, requested: count/jobs.batch=1, '
        f"used: count/jobs.batch={used}, limited: count/jobs.batch={limit}",
    )  # fmt: skip
