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
from collections.abc import Sequence
from dataclasses import dataclass

import redis

from k8s_dispatch.core.errors import GuardUnavailable
from k8s_dispatch.delivery.metrics import METRICS

# Delete each key only if it still holds our owner token (ARGV[i] for KEYS[i]): a claim that
# expired and was taken by another replica must not be released by the slow first holder.
# One script call for any number of claims: one round trip.
_RELEASE = """
local released = 0
for i, key in ipairs(KEYS) do
    if redis.call('GET', key) == ARGV[i] then
        released = released + redis.call('DEL', key)
    end
end
return released
"""

# Extend the claim's lease only if it still holds our owner token: one that expired and passed to
# another replica stays theirs.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('PEXPIRE', KEYS[1], ARGV[2])
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
        self._renew = client.register_script(_RENEW)
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
        return self.claim_many([dispatch_id])[dispatch_id]

    def claim_many(self, dispatch_ids: Sequence[str]) -> dict[str, Claim | None]:
        """Take each dispatch's claim: a Claim, or None (a duplicate prevented, counted) where
        someone holds it; one Redis round trip for them all.

        Raises:
            GuardUnavailable: Redis cannot be reached (claims taken meanwhile expire by themselves).
        """
        wanted = list(dict.fromkeys(dispatch_ids))
        claims = {
            d: Claim(dispatch_id=d, key=self.key(d), owner=f"{self._owner_base}:{uuid.uuid4().hex}") for d in wanted
        }
        try:
            pipe = self._redis.pipeline(transaction=False)
            for c in claims.values():
                pipe.set(c.key, c.owner, nx=True, px=self._lease_ms)
            taken = dict(zip(wanted, pipe.execute(), strict=True))
            held_elsewhere = [d for d in wanted if not taken[d]]
            if held_elsewhere:
                self._redis.incrby(self.duplicates_key, len(held_elsewhere))
        except redis.RedisError as e:
            raise GuardUnavailable(f"claim {', '.join(c.key for c in claims.values())[:200]}: {e}") from e
        for _ in held_elsewhere:
            METRICS.duplicate_prevented(by="guard")
        return {d: claims[d] if taken[d] else None for d in wanted}

    def release(self, claim: Claim) -> bool:
        """Release a claim we hold; False if it had expired (or been taken over) already.

        Raises:
            GuardUnavailable: Redis cannot be reached (the claim then expires by itself).
        """
        return self.release_many([claim]) == 1

    def release_many(self, claims: Sequence[Claim]) -> int:
        """Release claims we hold, with one script call; how many were still ours.

        Raises:
            GuardUnavailable: Redis cannot be reached (the claims then expire by themselves).
        """
        if not claims:
            return 0
        try:
            return int(self._release(keys=[c.key for c in claims], args=[c.owner for c in claims]))
        except redis.RedisError as e:
            raise GuardUnavailable(f"release {claims[0].key} and {len(claims) - 1} more: {e}") from e

    def renew(self, claim: Claim) -> bool:
        """Give a claim we hold a whole lease from now, with no moment unheld between (a release
        and a new claim would leave one); False if it had expired or passed to another already.

        Raises:
            GuardUnavailable: Redis cannot be reached (the claim then expires by itself).
        """
        try:
            return int(self._renew(keys=[claim.key], args=[claim.owner, self._lease_ms])) == 1
        except redis.RedisError as e:
            raise GuardUnavailable(f"renew {claim.key}: {e}") from e

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
