"""The cross-replica guard: at most one process delivers a dispatch's completion at a time.

A claim is `SET {prefix}:claim:{dispatch_id} owner NX PX lease` in the Redis every replica
shares; only its owner releases it (compare-and-delete in Lua), and it expires if the owner
dies, so a crash never blocks delivery for good. The unique terminal event in the database
stays the final arbiter; the guard only keeps replicas from doing the work twice.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass

import redis

from engine.errors import GuardUnavailable
from recovery.metrics import METRICS

# Delete the key only if it still holds our owner token: a claim that expired and was taken
# by another replica must not be released by the slow first holder.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
"""


@dataclass(frozen=True)
class Claim:
    dispatch_id: str
    key: str
    owner: str


class Guard:
    def __init__(self, client: redis.Redis, *, prefix: str, lease_ms: int) -> None:
        self._redis = client
        self._prefix = prefix
        self._lease_ms = lease_ms
        self._release = client.register_script(_RELEASE)
        self._owner_base = f"{socket.gethostname()}:{os.getpid()}"

    @property
    def duplicates_key(self) -> str:
        return f"{self._prefix}:stats:duplicates_prevented"

    def key(self, dispatch_id: str) -> str:
        return f"{self._prefix}:claim:{dispatch_id}"

    def claim(self, dispatch_id: str) -> Claim | None:
        """Take the claim, or None (and count a duplicate prevented) if someone holds it.

        Raises:
            GuardUnavailable: Redis cannot be reached.
        """
        key = self.key(dispatch_id)
        owner = f"{self._owner_base}:{uuid.uuid4().hex}"
        try:
            if self._redis.set(key, owner, nx=True, px=self._lease_ms):
                return Claim(dispatch_id=dispatch_id, key=key, owner=owner)
            self._redis.incr(self.duplicates_key)
            METRICS.duplicate_prevented(by="guard")
        except redis.RedisError as e:
            raise GuardUnavailable(f"claim {key}: {e}") from e
        return None

    def release(self, claim: Claim) -> bool:
        """Release a claim we hold; False if it had expired (or been taken over) already.

        Raises:
            GuardUnavailable: Redis cannot be reached (the claim then expires by itself).
        """
        try:
            return bool(self._release(keys=[claim.key], args=[claim.owner]))
        except redis.RedisError as e:
            raise GuardUnavailable(f"release {claim.key}: {e}") from e

    def holder(self, dispatch_id: str) -> str | None:
        """The owner token holding the claim now, if any (for reports and tests)."""
        try:
            value = self._redis.get(self.key(dispatch_id))
        except redis.RedisError as e:
            raise GuardUnavailable(f"read {self.key(dispatch_id)}: {e}") from e
        return value.decode() if isinstance(value, bytes) else value

    def duplicates_prevented(self) -> int:
        try:
            return int(self._redis.get(self.duplicates_key) or 0)
        except redis.RedisError as e:
            raise GuardUnavailable(f"read {self.duplicates_key}: {e}") from e
