"""A finished Job handed to a queued completion: poll's marker per Job, and the sweep's check for it.

Poll marks each finished Job it sends to `complete_batch` (SET NX PX: one hand-off per TTL,
however often poll runs); the recovery sweep leaves a Job with a live marker to that queued
message instead of delivering it a second time. While the complete queue holds messages
(a backlog), poll renews the markers of the Jobs it finds still waiting: a message queued for
longer than the TTL is not handed off again behind itself (a second copy could not run sooner).
A marker only ever expires, never blocks: once the queue is empty, a marker whose message was
lost (a broker flush empties the queue) or whose batch died expires after the TTL; then poll
hands the Job off again, and a sweep that finds no marker delivers the Job itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import redis

# Poll's markers live max(HANDOFF_MIN_TTL_S, HANDOFF_INTERVALS * poll interval): a slow queue is
# not handed the same Job again every interval, and a lost completion is handed again (or
# delivered by the sweep) after it.
HANDOFF_MIN_TTL_S = 10.0
HANDOFF_INTERVALS = 5


def ttl_s(poll_interval_s: float) -> float:
    """How long a marker lives for a poll every `poll_interval_s` (pure)."""
    return max(HANDOFF_MIN_TTL_S, HANDOFF_INTERVALS * poll_interval_s)


def key(prefix: str, namespace: str, job: Mapping[str, Any]) -> str:
    """The Job's marker key (pure). The uid too: a Job re-created under the same name is a new hand-off."""
    metadata = job.get("metadata") or {}
    return f"{prefix}:handoff:{namespace}/{metadata.get('name')}/{metadata.get('uid')}"


def mark(
    client: redis.Redis,
    prefix: str,
    namespace: str,
    jobs: Sequence[Mapping[str, Any]],
    ttl_s: float,
    *,
    renew: bool = False,
) -> list[bool]:
    """Mark the Jobs handed off for `ttl_s`, one pipeline for them all: True where this call
    set the marker (the Job was not handed off already), in the order of `jobs`. With `renew`
    (their message may still be queued), a marker already there lives `ttl_s` from now too.

    Raises:
        redis.RedisError: Redis is unavailable (nothing is known to be marked).
    """
    if not jobs:
        return []
    ttl_ms = max(1, int(ttl_s * 1000))
    pipe = client.pipeline(transaction=False)
    for job in jobs:
        pipe.set(key(prefix, namespace, job), 1, nx=True, px=ttl_ms)
        if renew:
            pipe.pexpire(key(prefix, namespace, job), ttl_ms)
    replies = pipe.execute()
    return [bool(set_now) for set_now in (replies[::2] if renew else replies)]


def pending(client: redis.Redis, prefix: str, namespace: str, jobs: Sequence[Mapping[str, Any]]) -> list[bool]:
    """Whether a completion is queued for each Job (its marker is live), one pipeline of EXISTS,
    in the order of `jobs`. Reads only.

    Raises:
        redis.RedisError: Redis is unavailable; the caller must then assume nothing is queued.
    """
    if not jobs:
        return []
    pipe = client.pipeline(transaction=False)
    for job in jobs:
        pipe.exists(key(prefix, namespace, job))
    return [bool(live) for live in pipe.execute()]
