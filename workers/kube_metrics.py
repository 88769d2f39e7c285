"""The Kubernetes adapter's metrics: each request's latency by verb and code, the time spent
waiting for the API budget, the 429s whose Retry-After was honoured, and the watch events read.

Registered in prometheus_client's default registry, the one a worker's `/metrics` serves
(`delivery/metrics.serve`), so `workers/` defines them without importing `recovery/`. Verbs and
codes are those of `k8s_dispatch_api_requests_total` (RBAC's verbs: get, list, create, patch,
delete, deletecollection; the HTTP code, or `error` for no answer): the histogram's count is
that counter, split by latency.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

NAMESPACE = "k8s_dispatch"
# From a fast local answer to the request timeout's order (10 s by default).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class KubeMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.request_duration = Histogram(
            "kube_request_duration_seconds",
            "Kubernetes API requests from this process: seconds from sending to the answer read, by "
            "verb and HTTP code (error: no answer). Waiting for the budget is not included.",
            ["verb", "code"],
            namespace=NAMESPACE,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.budget_wait = Histogram(
            "kube_budget_wait_seconds",
            "Seconds a Kubernetes API request waited for this process's budget (K8S_DISPATCH_KUBE_QPS "
            "and _BURST) or for a 429's Retry-After, per request that waited.",
            namespace=NAMESPACE,
            buckets=WAIT_BUCKETS,
            registry=registry,
        )
        self.retry_after = Counter(
            "kube_retry_after",
            "429 answers whose Retry-After this process waited out before sending again.",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.watch_events = Counter(
            "kube_watch_events",
            "Watch events this process read, by resource: what poll's watch costs the API server "
            "(kube-apiserver's own count, apiserver_watch_events_total, adds every other watcher's).",
            ["resource"],
            namespace=NAMESPACE,
            registry=registry,
        )

    def request_done(self, verb: str, code: str, seconds: float) -> None:
        self.request_duration.labels(verb=verb, code=code).observe(seconds)

    def waited(self, seconds: float) -> None:
        if seconds > 0:
            self.budget_wait.observe(seconds)


METRICS = KubeMetrics()
