"""Fault injection: a fraction of API requests answers 500, 503 or 429 (with Retry-After)
before doing anything, and every API request can be delayed. Changed at runtime through
LocalCluster.set_faults or POST /localcluster/faults. `throttle(n, retry_after_s)` makes the
next n requests answer 429 with that Retry-After: a client's honouring of it, tested exactly."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from k8s_dispatch.demo.localcluster.apierrors import ApiError


@dataclass
class Faults:
    rate: float = 0.0
    latency_ms: int = 0
    rng: random.Random = field(default_factory=random.Random)
    injected: int = 0  # error responses injected since start (the chaos run reports them)
    throttled: int = 0  # requests still to answer 429 (`throttle`)
    retry_after_s: float = 1.0  # their Retry-After

    def set(self, rate: float, latency_ms: int) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"fault rate must be within [0, 1], got {rate}")
        if latency_ms < 0:
            raise ValueError(f"latency must be >= 0 ms, got {latency_ms}")
        self.rate = rate
        self.latency_ms = latency_ms

    def throttle(self, count: int, retry_after_s: float) -> None:
        """Answer the next `count` requests 429 with `Retry-After: retry_after_s`."""
        if count < 0 or not retry_after_s >= 0:
            raise ValueError(f"throttle needs count >= 0 and retry_after_s >= 0, got {count}, {retry_after_s}")
        self.throttled, self.retry_after_s = count, retry_after_s

    def draw(self) -> ApiError | None:
        """The injected error for this request, if it is one of the unlucky ones."""
        if self.throttled > 0:
            self.throttled -= 1
            self.injected += 1
            return _too_many(f"{self.retry_after_s:g}")
        if self.rate <= 0 or self.rng.random() >= self.rate:
            return None
        self.injected += 1
        code = self.rng.choice((500, 503, 429))
        if code == 500:
            return ApiError(500, "InternalError", "Internal error occurred: injected fault (localcluster)")
        if code == 503:
            return ApiError(
                503,
                "ServiceUnavailable",
                "the server is currently unable to handle the request (injected fault)",
                headers={"Retry-After": "1"},
            )
        return _too_many("1")


def _too_many(retry_after: str) -> ApiError:
    return ApiError(
        429,
        "TooManyRequests",
        "the server has received too many requests and has asked us to try again later (injected fault)",
        details={"retryAfterSeconds": max(1, round(float(retry_after)))},
        headers={"Retry-After": retry_after},
    )
