"""3. The Kubernetes adapter: a page of Jobs as raw JSON dicts (`_preload_content=False` and
`json.loads`, what `workers.kube` does) against the official client's model objects (its
default: `V1JobList` with a `V1Job` per item).

Timed twice: the whole request (list one page), and the decoding alone on the same bytes,
which isolates what the models cost from the HTTP round trip.
"""

from __future__ import annotations

import json
from typing import cast

import urllib3
from kubernetes import client as k8s

from k8s_dispatch.lab import kubeclient
from k8s_dispatch.lab.bench import rawhttp, services, workload
from k8s_dispatch.lab.bench.results import BenchResult, Figure, Ratio
from k8s_dispatch.lab.bench.sizes import Size
from k8s_dispatch.lab.bench.timing import Stopwatch, interleaved, paired_ratios
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.kube import KubeClient

NAMESPACE = "bench-adapter"
# Each round takes a fraction of a second, and one slow round swings a median of three:
# this benchmark runs three times the size's rounds.
ROUNDS_FACTOR = 3


def run(ctx: services.BenchContext, size: Size) -> BenchResult:
    n = size.adapter_page
    result = BenchResult(
        name="adapter",
        title=f"the adapter: a page of {n} Jobs as raw JSON dicts vs client models",
        rounds=size.rounds * ROUNDS_FACTOR,
        params={"page": n},
    )
    rounds = result.rounds
    selector = job_labels.selector()
    with services.cluster(ctx.work_dir, name="lc-adapter") as cluster, KubeClient(cluster.kubeconfig) as kube:
        bodies = workload.job_bodies(n, namespace=NAMESPACE, caps=workload.resolver())
        rawhttp.create_jobs(cluster, NAMESPACE, bodies, clients=size.create_clients)
        workload.wait_jobs_terminal(kube, NAMESPACE, n)
        api_client = kubeclient.api_client(cluster.kubeconfig)
        try:
            batch = k8s.BatchV1Api(api_client)

            def page_dicts() -> float:
                with Stopwatch() as sw:
                    page = kube.list_jobs_page(NAMESPACE, label_selector=selector, limit=n)
                _check(len(page["items"]), n)
                return sw.seconds

            def page_models() -> float:
                with Stopwatch() as sw:
                    page = batch.list_namespaced_job(NAMESPACE, label_selector=selector, limit=n)
                _check(len(page.items), n)
                return sw.seconds

            request_s = interleaved({"dicts": page_dicts, "models": page_models}, rounds=rounds, warmup=True)

            # unread (`_preload_content=False`), the answer is urllib3's response, not the V1JobList typed
            response = cast(
                urllib3.HTTPResponse,
                batch.list_namespaced_job(NAMESPACE, label_selector=selector, limit=n, _preload_content=False),
            )
            try:
                raw = response.data.decode("utf-8")
            finally:
                response.release_conn()

            def decode_dicts() -> float:
                with Stopwatch() as sw:
                    page = json.loads(raw)
                _check(len(page["items"]), n)
                return sw.seconds

            def decode_models() -> float:
                with Stopwatch() as sw:
                    page = api_client.deserialize(raw, "V1JobList", "application/json")
                _check(len(page.items), n)
                return sw.seconds

            decode_s = interleaved({"dicts": decode_dicts, "models": decode_models}, rounds=rounds, warmup=True)
        finally:
            kubeclient.close(api_client)

    result.params["page_bytes"] = len(raw.encode("utf-8"))
    result.figures += [
        Figure("page_ms_dicts", "list one page, KubeClient (raw JSON dicts)", "ms", _ms(request_s["dicts"])),
        Figure("page_ms_models", "list one page, BatchV1Api (V1JobList models)", "ms", _ms(request_s["models"])),
        Figure("decode_ms_dicts", "decode one page: json.loads", "ms", _ms(decode_s["dicts"])),
        Figure("decode_ms_models", "decode one page: ApiClient.deserialize", "ms", _ms(decode_s["models"])),
    ]
    result.ratios += [
        Ratio(
            "models_vs_dicts_page_time",
            "list one page, models / raw dicts",
            paired_ratios(request_s["models"], request_s["dicts"]),
        ),
        Ratio(
            "models_vs_dicts_decode_time",
            "decode one page, models / json.loads",
            paired_ratios(decode_s["models"], decode_s["dicts"]),
        ),
    ]
    return result


def _ms(seconds: list[float]) -> list[float]:
    return [1000 * s for s in seconds]


def _check(count: int, expected: int) -> None:
    if count != expected:
        raise RuntimeError(f"a page of {count} Jobs, expected {expected}")
