"""The process's API budget: a token bucket every Kubernetes request of the process draws from.

`qps` tokens a second, at most `burst` saved up (client-go's `flowcontrol` token bucket, shared
the same way: by every client of the process, so a burst of creates from eight threads cannot
exceed it either). A `Retry-After` the server sends with a 429 pauses the whole bucket: no
thread of the process sends until it has passed, and then at `qps`, not in a burst. The clock
and the sleep are injectable, so the arithmetic is tested with tables and no waiting.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Budget:
    """A token bucket; `qps` 0 is unlimited (only `pause` then holds requests back)."""

    def __init__(
        self,
        qps: float,
        burst: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] | None = None,
    ) -> None:
        if qps < 0 or burst < 1:
            raise ValueError(f"a budget needs qps >= 0 and burst >= 1, got qps={qps} burst={burst}")
        self._clock, self._sleep = clock, sleep or _wait
        self._lock = threading.Lock()
        self._qps, self._burst = float(qps), burst
        self._tokens = float(burst)  # may go below 0: the requests already promised a later time
        self._at = clock()  # when `_tokens` was counted
        self._paused_until = -float("inf")

    @property
    def qps(self) -> float:
        return self._qps

    @property
    def burst(self) -> int:
        return self._burst

    def configure(self, qps: float, burst: int) -> None:
        """Change the rate and the burst from now on (tokens saved keep, up to the new burst)."""
        if qps < 0 or burst < 1:
            raise ValueError(f"a budget needs qps >= 0 and burst >= 1, got qps={qps} burst={burst}")
        with self._lock:
            self._refill(self._clock())
            self._qps, self._burst = float(qps), burst
            self._tokens = min(self._tokens, float(burst))

    def reserve(self) -> float:
        """Take a token; the seconds to wait before sending (0.0: at once). Never blocks."""
        with self._lock:
            now = self._clock()
            start = now
            if self._qps > 0:
                self._refill(now)
                self._tokens -= 1.0
                if self._tokens < 0:  # its token comes when the balance (counted at `_at`) is back at 0
                    start = self._at - self._tokens / self._qps
            return max(start, self._paused_until) - now

    def acquire(self) -> float:
        """Wait for a token (and out any pause that starts meanwhile); the seconds waited."""
        waited = 0.0
        wait = self.reserve()
        while wait > 0:
            self._sleep(wait)
            waited += wait
            with self._lock:
                wait = self._paused_until - self._clock()  # a Retry-After that came in meanwhile
        return waited

    def pause(self, seconds: float) -> None:
        """Hold every request of the process for `seconds` from now (a 429's Retry-After); after
        it, requests resume at `qps` with no burst saved up."""
        with self._lock:
            now = self._clock()
            until = now + seconds
            if until <= self._paused_until:
                return
            self._paused_until = until
            if self._qps > 0:
                self._refill(now)
                self._tokens = min(self._tokens, 0.0)
                self._at = until  # nothing saved up during the pause
        log.info("the API server asked to wait %.3g s (429 Retry-After): every request of this process waits", seconds)

    def _refill(self, now: float) -> None:
        if now > self._at:
            self._tokens = min(float(self._burst), self._tokens + (now - self._at) * self._qps)
            self._at = now


def _wait(seconds: float) -> None:
    """Sleep on an Event that is never set, not `time.sleep`: Python's `time.sleep` sleeps to an
    absolute monotonic deadline (`clock_nanosleep`), which a process run off the true clock by
    libfaketime (the clock-skew tests and the chaos run) fails with EINVAL."""
    _NEVER.wait(seconds)


_NEVER = threading.Event()

# K8S_DISPATCH_KUBE_QPS and _BURST's defaults (core/settings.py; README says why these).
DEFAULT_QPS = 300.0
DEFAULT_BURST = 600

_SHARED: list[Budget] = []
_SHARED_LOCK = threading.Lock()


def shared(qps: float | None = None, burst: int | None = None) -> Budget:
    """The process's one budget, made on first use (at the defaults, unless given); a later call
    with other values changes its rate: every client of the process draws from it."""
    with _SHARED_LOCK:
        if not _SHARED:
            _SHARED.append(Budget(DEFAULT_QPS if qps is None else qps, DEFAULT_BURST if burst is None else burst))
        budget = _SHARED[0]
    wanted = (budget.qps if qps is None else float(qps), budget.burst if burst is None else burst)
    if wanted != (budget.qps, budget.burst):
        budget.configure(*wanted)
    return budget
