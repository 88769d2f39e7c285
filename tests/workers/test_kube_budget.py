"""The API budget at the seams, against localcluster over HTTP: a burst of creates from many
threads and two clients never exceeds it at the server; a 429's Retry-After holds every thread,
then the request goes again; the request and budget metrics are served at /metrics."""

from __future__ import annotations

import re
import threading
import time
import urllib.request
import uuid
from typing import Any

import pytest

from k8s_dispatch.core.errors import ApiUnavailable
from k8s_dispatch.delivery import metrics as recovery_metrics
from k8s_dispatch.demo.localcluster import LocalCluster
from k8s_dispatch.demo.localcluster.audit import Answer
from k8s_dispatch.workers.budget import Budget
from k8s_dispatch.workers.kube import RETRY_AFTER_ATTEMPTS, KubeClient

# Requests already sent when a 429 comes are answered in this long (a simulated create takes
# about a millisecond; the rest is a busy machine's scheduling).
IN_FLIGHT_S = 0.15


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(mode="simulate") as c:
        yield c


def job(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": {"suite": "budget"}},
        "spec": {
            "suspend": True,  # nothing runs: only the creates are measured
            "template": {
                "spec": {"restartPolicy": "Never", "containers": [{"name": "worker", "image": "busybox"}]},
            },
        },
    }


def creates(cluster: LocalCluster, clients: list[KubeClient], *, threads: int, per_thread: int) -> tuple[float, float]:
    """`threads` threads (spread over `clients`) each creating `per_thread` Jobs, started together;
    the monotonic times of the first send and the last answer."""
    namespace = f"budget-{uuid.uuid4().hex[:8]}"
    start = threading.Barrier(threads + 1)
    errors: list[BaseException] = []

    def work(t: int) -> None:
        start.wait()
        try:
            for i in range(per_thread):
                clients[t % len(clients)].create_job(namespace, job(f"j-{t}-{i}"))
        except BaseException as e:
            errors.append(e)

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    began = time.monotonic()
    start.wait()
    for w in workers:
        w.join()
    assert not errors, errors[0]
    return began, time.monotonic()


def answers(cluster: LocalCluster, *, since: float) -> list[Answer]:
    return [a for a in cluster.call(lambda core: core.audit.answers()) if a.at >= since]


def most_in_any_window(times: list[float], window: float) -> int:
    """The largest number of `times` within any interval of `window` seconds (sliding)."""
    times = sorted(times)
    most, first = 0, 0
    for last, t in enumerate(times):
        while t - times[first] > window:
            first += 1
        most = max(most, last - first + 1)
    return most


class Scheduled(Budget):
    """The budget as it is, through its clock seam: each token's time to send (the `now` its
    `reserve` read, plus the wait it returned) is recorded, exactly, whatever the machine's load."""

    def __init__(self, qps: float, burst: int) -> None:
        self._read = threading.local()
        self.times: list[float] = []
        super().__init__(qps, burst, clock=self._clock_read)

    def _clock_read(self) -> float:
        self._read.now = time.monotonic()
        return self._read.now

    def reserve(self) -> float:
        wait = super().reserve()
        self.times.append(self._read.now + wait)  # reserve reads the clock once, under its lock
        return wait


def over_budget(times: list[float], *, qps: float, burst: int) -> list[tuple[float, int, float]]:
    """The windows where more was sent than a token bucket allows: in any `w` seconds, at most
    burst + qps * w. (window, seen, allowed) of each one exceeded."""
    found = []
    for window in (0.1, 0.25, 0.5, 1.0, 2.0):
        allowed = burst + qps * window + 1e-6  # the float sums of the bucket's times
        seen = most_in_any_window(times, window)
        if seen > allowed:
            found.append((window, seen, allowed))
    return found


def test_a_burst_of_creates_from_eight_threads_and_two_clients_stays_within_the_budget(cluster):
    qps, burst, threads, per_thread = 40.0, 8, 8, 10
    # Unlimited first: the same burst far exceeds what the budget allows, so the check can fail.
    unlimited = Scheduled(0, 1)
    with KubeClient(cluster.kubeconfig, budget=unlimited) as a, KubeClient(cluster.kubeconfig, budget=unlimited) as b:
        began, _ = creates(cluster, [a, b], threads=threads, per_thread=per_thread)
    assert len([x for x in answers(cluster, since=began) if x.verb == "POST"]) == threads * per_thread
    assert over_budget(unlimited.times, qps=qps, burst=burst), "an unlimited burst should exceed the budget"

    shared = Scheduled(qps, burst)  # one budget, as every client of a process shares the process's
    with KubeClient(cluster.kubeconfig, budget=shared) as a, KubeClient(cluster.kubeconfig, budget=shared) as b:
        began, ended = creates(cluster, [a, b], threads=threads, per_thread=per_thread)
    posts = sorted(x.at for x in answers(cluster, since=began) if x.verb == "POST" and x.code == 201)
    assert len(posts) == len(shared.times) == threads * per_thread  # one token per request
    assert over_budget(shared.times, qps=qps, burst=burst) == []
    # No request reached the server before its token allowed: the k-th answer came after the
    # k-th time to send (true of the sorted lists if of each request, and false if any went early).
    early = [(at, go) for at, go in zip(posts, sorted(shared.times), strict=True) if at < go]
    assert early == []
    # 80 requests, 8 at once and then 40 a second: at least (80 - 8) / 40 = 1.8 s.
    assert ended - began >= (threads * per_thread - burst) / qps


def test_a_429s_retry_after_holds_every_thread_then_the_request_goes_again(cluster):
    retry_after = 1.0
    budget = Budget(0, 1)  # unlimited: only the Retry-After holds requests back
    with KubeClient(cluster.kubeconfig, budget=budget) as kube:
        namespace = f"budget-{uuid.uuid4().hex[:8]}"
        kube.create_job(namespace, job("warm"))  # connections open
        cluster.call(lambda core: core.faults.throttle(1, retry_after))
        began, ended = creates(cluster, [kube], threads=4, per_thread=3)
    seen = answers(cluster, since=began)
    (throttled,) = [a for a in seen if a.code == 429]
    created = [a for a in seen if a.verb == "POST" and a.code == 201]
    assert len(created) == 12, "the throttled create went again and succeeded"
    # Requests already on their way when the 429 came are answered at once; after that, nothing
    # until the Retry-After has passed, from any thread.
    in_pause = [a for a in created if throttled.at + IN_FLIGHT_S < a.at < throttled.at + retry_after - 0.05]
    assert in_pause == []
    assert max(a.at for a in created) >= throttled.at + retry_after - 0.05
    assert ended - began >= retry_after


def test_a_429_that_keeps_coming_ends_as_api_unavailable_after_the_bounded_retries(cluster):
    with KubeClient(cluster.kubeconfig, budget=Budget(0, 1)) as kube:
        cluster.call(lambda core: core.faults.throttle(RETRY_AFTER_ATTEMPTS + 1, 0.05))
        started = time.monotonic()
        with pytest.raises(ApiUnavailable, match="429"):
            kube.create_job(f"budget-{uuid.uuid4().hex[:8]}", job("never"))
        assert time.monotonic() - started >= RETRY_AFTER_ATTEMPTS * 0.05
        assert cluster.call(lambda core: core.faults.throttled) == 0  # each attempt reached the server
        kube.create_job(f"budget-{uuid.uuid4().hex[:8]}", job("after"))  # and the next one goes


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def sample(text: str, name: str, **labels: str) -> float:
    """One sample's value from Prometheus text (0.0 if absent)."""
    for line in text.splitlines():
        match = re.fullmatch(rf"{name}(?:\{{(.*)\}})? (\S+)", line)
        if match and dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or "")) == labels:
            return float(match.group(2))
    return 0.0


def test_request_latency_and_budget_waits_are_served_at_metrics(cluster):
    port = recovery_metrics.serve(0, addr="127.0.0.1")
    try:
        before = scrape(port)
        with KubeClient(cluster.kubeconfig, budget=Budget(5, 1)) as kube:
            namespace = f"budget-{uuid.uuid4().hex[:8]}"
            for i in range(3):
                kube.create_job(namespace, job(f"m-{i}"))
            kube.get_job(namespace, "m-0")
            listed = next(kube.iter_jobs(namespace, label_selector="suite=budget"))
            first = min(listed, key=lambda j: int(j["metadata"]["resourceVersion"]))
            version = first["metadata"]["resourceVersion"]  # the first Job's: two were made after it
            watched = kube.watch_jobs(namespace, label_selector="suite=budget", resource_version=version, bound_s=1)
            cluster.call(lambda core: core.faults.throttle(1, 0.05))
            kube.get_job(namespace, "m-1")
        after = scrape(port)
    finally:
        recovery_metrics.stop_serving()

    def grew(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    latency = "k8s_dispatch_kube_request_duration_seconds_count"
    assert grew(latency, verb="create", code="201") == 3
    assert grew(latency, verb="get", code="200") == 2
    assert grew(latency, verb="get", code="429") == 1
    assert grew(latency, verb="list", code="200") == 1
    assert grew(latency, verb="watch", code="200") == 1
    assert len(watched.events) >= 2  # the two later creates, and the status writes that follow them
    assert grew("k8s_dispatch_kube_watch_events_total", resource="jobs") == len(watched.events)
    assert grew("k8s_dispatch_kube_retry_after_total") == 1
    # 8 requests at 5/s with no burst to spare: 7 waited about 0.2 s each (the 429's retry among them).
    assert grew("k8s_dispatch_kube_budget_wait_seconds_count") >= 6
    assert grew("k8s_dispatch_kube_budget_wait_seconds_sum") >= 0.5
