"""Counters shared by every replica, kept in Redis under `{prefix}:stats:`.

What one process saw is not the story when three run: Jobs refused, duplicates prevented and
notifications sent are counted cluster-wide, read by the CLI, the tests and the bench.
Counting is best effort: a Redis error is logged, never allowed to fail a delivery.
"""

from __future__ import annotations

import logging

import redis

log = logging.getLogger(__name__)

# The counter names in use (the guard writes DUPLICATES_PREVENTED itself).
DUPLICATES_PREVENTED = "duplicates_prevented"
JOBS_REFUSED = "jobs_refused"  # labels unreadable or disagreeing with the DB: never delivered
COMPLETIONS_WRITTEN = "completions_written"
NOTIFICATIONS_SENT = "notifications_sent"


class Stats:
    def __init__(self, client: redis.Redis, *, prefix: str) -> None:
        self._redis = client
        self._prefix = f"{prefix}:stats:"

    def incr(self, name: str, amount: int = 1) -> None:
        try:
            self._redis.incrby(self._prefix + name, amount)
        except redis.RedisError as e:
            log.warning("could not count %s: %s", name, e)

    def get(self, name: str) -> int:
        """Raises: redis.RedisError (reading is for reports, which should say Redis is down)."""
        return int(self._redis.get(self._prefix + name) or 0)

    def all(self) -> dict[str, int]:
        """Every counter under the prefix."""
        keys = sorted(self._redis.scan_iter(match=self._prefix + "*", count=100))
        values = self._redis.mget(keys) if keys else []
        return {k.decode()[len(self._prefix) :]: int(v or 0) for k, v in zip(keys, values, strict=True)}
