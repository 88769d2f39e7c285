"""A periodic task's run holds a lease while it runs: a run that finds it held skips at once.

`supersede` keeps the copies queued behind a stall from all running; this keeps a run from
starting while the previous one still runs, on any replica. Without it, polls that last longer
than their interval start one beside the other until every worker thread is polling. The lease
is a Redis key with the run's own token and a TTL counted by Redis alone (no clocks compared);
the run renews it while it works and deletes it when done (only its own: compare-and-delete). A
run whose worker dies leaves a lease that expires within the TTL. With Redis unreachable a run
goes ahead: the tasks are safe to run twice.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import redis

from k8s_dispatch.delivery.metrics import METRICS

log = logging.getLogger(__name__)

# Renew, then delete: each only while the key still holds this run's token (a lease that expired
# and was taken by a later run is that run's).
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
"""
# A run's lease lives this many of its task's intervals (and at least LEASE_MIN_S) from its
# last renewal: a run renews it about every interval.
LEASE_INTERVALS = 3
LEASE_MIN_S = 2.0


def ttl_s(interval_s: float) -> float:
    """How long the lease of a task sent every `interval_s` lives past its last renewal (pure)."""
    return max(LEASE_MIN_S, LEASE_INTERVALS * interval_s)


def key(prefix: str, task: str) -> str:
    """The task's lease (pure): one per deployment (key prefix) and task."""
    return f"{prefix}:running:{task}"


class Lease:
    """A held lease (`take`); renewing or releasing one that Redis cannot reach does nothing."""

    def __init__(self, client: redis.Redis, name: str, token: str, ttl_ms: int) -> None:
        self._client, self._name, self._token, self._ttl_ms = client, name, token, ttl_ms

    def renew(self) -> bool:
        """Extend the lease by its TTL from now; False if it is no longer this run's (it expired)."""
        try:
            return bool(self._client.eval(_RENEW, 1, self._name, self._token, self._ttl_ms))
        except redis.RedisError as e:
            log.warning("cannot renew %s (%s)", self._name, e)
            return False

    def release(self) -> None:
        try:
            self._client.eval(_RELEASE, 1, self._name, self._token)
        except redis.RedisError as e:  # it expires on its own
            log.warning("cannot release %s (%s); it expires within %d ms", self._name, e, self._ttl_ms)


def take(client: redis.Redis, prefix: str, task: str, *, ttl_s: float, quiet: bool = False) -> Lease | None:
    """The task's lease for this run, or None when another run holds it (then logged and counted
    as `k8s_dispatch_tasks_discarded_total{reason="running"}`, unless `quiet`: a caller that will
    try again soon, not a run discarded). Redis unreachable: a lease all the same (logged), since
    running twice is safe."""
    name, token, ttl_ms = key(prefix, task), uuid.uuid4().hex, max(1, int(ttl_s * 1000))
    try:
        taken = client.set(name, token, nx=True, px=ttl_ms)
    except redis.RedisError as e:
        log.warning("%s: cannot tell whether another run is under way (%s); running", task, e)
        return Lease(client, name, token, ttl_ms)
    if not taken:
        if quiet:
            return None
        log.info("%s skipped: the previous run is still under way", task)
        METRICS.task_discarded(task=task, reason="running")
        return None
    return Lease(client, name, token, ttl_ms)


@contextmanager
def kept(running: Lease, *, every_s: float) -> Iterator[None]:
    """Renew `running` every `every_s` from a thread of its own while the body runs, then release
    it: for a run made of steps that cannot renew it themselves (a sweep's walk and actions)."""
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(every_s):
            running.renew()

    renewer = threading.Thread(target=renew, name="lease-renewal", daemon=True)
    renewer.start()
    try:
        yield
    finally:
        stop.set()
        renewer.join()
        running.release()
