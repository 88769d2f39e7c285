"""The cross-replica guard against a real Redis: exclusive claims, owner-only release, expiry."""

from __future__ import annotations

import threading

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from k8s_dispatch.core.errors import GuardUnavailable
from k8s_dispatch.delivery.guard import Claim, Guard
from k8s_dispatch.ops.processes import wait_until


@pytest.fixture
def client(redis_url):
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


@pytest.fixture
def prefix(key_prefix, request):
    return f"{key_prefix}:guard:{request.node.name}"


def test_claim_is_exclusive_and_counts_the_refused(client, prefix):
    guard = Guard(client, prefix=prefix, lease_ms=10_000)
    first = guard.claim("d-1")
    assert isinstance(first, Claim) and first.dispatch_id == "d-1"
    assert guard.claim("d-1") is None
    assert guard.claim("d-1") is None
    assert guard.duplicates_prevented() == 2
    assert guard.holder("d-1") == first.owner
    # Another dispatch is independent.
    assert guard.claim("d-2") is not None


def test_release_frees_the_claim_for_the_next_holder(client, prefix):
    guard = Guard(client, prefix=prefix, lease_ms=10_000)
    claim = guard.claim("d-1")
    assert guard.release(claim) is True
    assert guard.holder("d-1") is None
    assert guard.claim("d-1") is not None
    assert guard.duplicates_prevented() == 0


def test_claim_expires_when_its_holder_never_releases(client, prefix):
    dead = Guard(client, prefix=prefix, lease_ms=100)
    assert dead.claim("d-1") is not None  # the holder "dies" here
    alive = Guard(client, prefix=prefix, lease_ms=10_000)
    assert alive.claim("d-1") is None
    wait_until(lambda: alive.holder("d-1") is None, timeout=5.0)
    assert alive.claim("d-1") is not None


def test_a_late_holder_cannot_release_a_claim_taken_over_after_expiry(client, prefix):
    slow = Guard(client, prefix=prefix, lease_ms=100)
    stale = slow.claim("d-1")
    wait_until(lambda: slow.holder("d-1") is None, timeout=5.0)
    fresh = Guard(client, prefix=prefix, lease_ms=10_000).claim("d-1")
    assert fresh is not None
    assert slow.release(stale) is False  # compare-and-delete: not our token any more
    assert slow.holder("d-1") == fresh.owner


def test_many_threads_claiming_at_once_yield_one_winner(client, prefix):
    guard = Guard(client, prefix=prefix, lease_ms=10_000)
    barrier = threading.Barrier(16)
    results: list[Claim | None] = []
    lock = threading.Lock()

    def contend() -> None:
        barrier.wait()
        claim = guard.claim("contended")
        with lock:
            results.append(claim)

    threads = [threading.Thread(target=contend) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(1 for r in results if r is not None) == 1
    assert guard.duplicates_prevented() == 15


def test_unreachable_redis_is_guard_unavailable():
    # No retries: redis-py would otherwise back off and retry for seconds.
    unreachable = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    try:
        guard = Guard(unreachable, prefix="nowhere", lease_ms=1000)
        with pytest.raises(GuardUnavailable):
            guard.claim("d-1")
        with pytest.raises(GuardUnavailable):
            guard.release(Claim(dispatch_id="d-1", key="nowhere:claim:d-1", owner="x"))
    finally:
        unreachable.close()


def test_claim_many_takes_the_free_claims_in_one_call_and_release_many_frees_only_ours(client, prefix):
    guard = Guard(client, prefix=prefix, lease_ms=10_000)
    held = guard.claim("d-2")
    assert held is not None
    claims = guard.claim_many(["d-1", "d-2", "d-3", "d-1"])
    assert list(claims) == ["d-1", "d-2", "d-3"]
    assert claims["d-2"] is None and guard.duplicates_prevented() == 1
    mine = [c for c in claims.values() if c is not None]
    assert [guard.holder(c.dispatch_id) for c in mine] == [c.owner for c in mine]
    client.delete(guard.key("d-3"))
    stolen = guard.claim("d-3")  # d-3's lease "expired" and another holder took it
    assert guard.release_many(mine) == 1
    assert guard.holder("d-1") is None
    assert stolen is not None and guard.holder("d-3") == stolen.owner
    assert guard.holder("d-2") == held.owner
