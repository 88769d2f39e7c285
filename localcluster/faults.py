"""Fault injection: a fraction of API requests answers 500, 503 or 429 (with Retry-After)
before doing anything, and every API request can be delayed. Changed at runtime through
LocalCluster.set_faults or POST /localcluster/faults."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from k8s_dispatch.localcluster.apierrors import ApiError


@dataclass
class Faults:
    rate: float = 0.0
    latency_ms: int = 0
    rng: random.Random = field(default_factory=random.Random)
    injected: int = 0  # error responses injected since start (the chaos run reports them)

    def set(self, rate: float, latency_ms: int) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"fault rate must be within [0, 1], got {rate}")
        if latency_ms < 0:
            raise ValueError(f"latency must be >= 0 ms, got {latency_ms}")
        self.rate = rate
        self.latency_ms = latency_ms

    def draw(self) -> ApiError | None:
        """The injected error for this request, if it is one of the unlucky ones."""
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
        return ApiError(
            429,
            "TooManyRequests",
            "the server has received too many requests and has asked us to try again later (injected fault)",
            details={"retryAfterSeconds": 1},
            headers={"Retry-After": "1"},
        )
