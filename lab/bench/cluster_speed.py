"""1. localcluster's own speed (issue 3: >= 1,000 Job creates/s; 10,000 Jobs listed in pages of
500 in under a second), on one `localcluster serve` process.

Creates come from concurrent threads, each with its own keep-alive connection, so the figure is
the server's. Jobs that run (the Job controller starts, finishes and records a simulated Pod
for each) are compared with suspended Jobs (the API path alone): their ratio is what the
controller costs. The listing is timed as the server's part (bare HTTP: each page's request
and transfer, the target's figure) and as the project's `KubeClient` pays it (JSON decoded).
"""

from __future__ import annotations

import itertools

from k8s_dispatch.lab.bench import rawhttp, services, workload
from k8s_dispatch.lab.bench.results import BenchResult, Figure, Ratio, Target
from k8s_dispatch.lab.bench.sizes import Size
from k8s_dispatch.lab.bench.timing import Stopwatch, interleaved, paired_ratios, rates
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.kube import KubeClient

CREATES_TARGET = Target(1000.0, at_least=True)  # Job creates per second
LIST_TARGET = Target(1.0, at_least=False)  # seconds for 10,000 Jobs in pages of 500
LIST_NAMESPACE = "bench-list"


def run(ctx: services.BenchContext, size: Size) -> BenchResult:
    result = BenchResult(
        name="localcluster",
        title="localcluster speed (one server process)",
        rounds=size.rounds,
        params={
            "clients": size.create_clients,
            "creates_per_round": size.creates,
            "list_jobs": size.list_jobs,
            "list_page": size.list_page,
        },
    )
    caps = workload.resolver()
    with services.cluster(ctx.work_dir, name="lc-speed") as cluster, KubeClient(cluster.kubeconfig) as kube:
        counter = itertools.count()

        def creates(*, suspend: bool) -> float:
            namespace = f"bench-create-{next(counter)}"
            bodies = workload.job_bodies(size.creates, namespace=namespace, caps=caps, suspend=suspend)
            return rawhttp.create_jobs(cluster, namespace, bodies, clients=size.create_clients)

        create_s = interleaved(
            {"running": lambda: creates(suspend=False), "suspended": lambda: creates(suspend=True)},
            rounds=size.rounds,
        )

        # The listed Jobs are suspended: filling the namespace takes seconds, not a minute.
        bodies = workload.job_bodies(size.list_jobs, namespace=LIST_NAMESPACE, caps=caps, suspend=True)
        rawhttp.create_jobs(cluster, LIST_NAMESPACE, bodies, clients=size.create_clients)
        selector = job_labels.selector()

        def list_server() -> float:
            with rawhttp.RawApi(cluster) as api:
                count = api.count_jobs(LIST_NAMESPACE, label_selector=selector, page_size=size.list_page)
            _check_count(count, size.list_jobs)
            return api.http_seconds  # the pages' requests and transfers; decoding excluded

        def list_kube() -> float:
            with Stopwatch() as sw:
                pages = kube.iter_jobs(LIST_NAMESPACE, label_selector=selector, page_size=size.list_page)
                count = sum(len(page) for page in pages)
            _check_count(count, size.list_jobs)
            return sw.seconds

        list_s = interleaved({"server": list_server, "kube": list_kube}, rounds=size.rounds)

    creates_target = CREATES_TARGET if size.check_targets else None
    list_target = LIST_TARGET if size.check_targets else None
    clients = size.create_clients
    result.figures += [
        Figure(
            "creates_per_s_running",
            f"Job creates/s, {clients} clients, Jobs that run (simulated Pods)",
            "jobs/s",
            rates(size.creates, create_s["running"]),
            creates_target,
            ref="8.6",
        ),
        Figure(
            "creates_per_s_suspended",
            f"Job creates/s, {clients} clients, suspended Jobs (API path only)",
            "jobs/s",
            rates(size.creates, create_s["suspended"]),
            creates_target,
            ref="8.6",
        ),
        Figure(
            "list_s_server",
            f"list {size.list_jobs:,} Jobs in pages of {size.list_page}: requests + transfer (bare HTTP)",
            "s",
            list_s["server"],
            list_target,
            ref="8.6",
        ),
        Figure(
            "list_s_kubeclient",
            f"list {size.list_jobs:,} Jobs in pages of {size.list_page}: KubeClient.iter_jobs, JSON decoded",
            "s",
            list_s["kube"],
            ref="8.6",
        ),
    ]
    result.ratios += [
        Ratio(
            "running_vs_suspended_create_time",
            "create time, running Jobs / suspended Jobs (the controller's cost)",
            paired_ratios(create_s["running"], create_s["suspended"]),
        ),
        Ratio(
            "kubeclient_vs_server_list_time",
            "list time, KubeClient with decoding / the server's requests + transfer",
            paired_ratios(list_s["kube"], list_s["server"]),
        ),
    ]
    result.notes.append(
        "server: `python -m k8s_dispatch.demo.localcluster serve --mode simulate --no-tls` in its own process"
    )
    result.notes.append("listed Jobs are suspended ones built by workers.manifest.build_job")
    return result


def _check_count(count: int, expected: int) -> None:
    if count != expected:
        raise RuntimeError(f"listed {count} Jobs, expected {expected}")
