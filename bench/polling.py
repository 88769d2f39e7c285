"""2. Polling: one paginated LIST of all our Jobs (what the `poll` task does) against one GET per
Job (the naive way), for the same finished Jobs, through the project's `KubeClient`.

Both passes read every Job's state with `job_state`, as `poll` does; the ratio of their times
is the point of the design's "one LIST per interval, not a GET per Job".
"""

from __future__ import annotations


from bench import rawhttp, services, workload
from bench.results import BenchResult, Figure, Ratio
from bench.sizes import Size
from bench.timing import Stopwatch, interleaved, paired_ratios
from workers import labels as job_labels
from workers.job_status import job_state
from workers.kube import DEFAULT_PAGE_SIZE, KubeClient

NAMESPACE = "bench-poll"
# A LIST pass takes a fraction of a GET pass: each of its samples is the mean of a few passes,
# so one scheduler hiccup does not swing the ratio.
LIST_PASSES = 5


def run(ctx: services.BenchContext, size: Size) -> BenchResult:
    n = size.poll_jobs
    result = BenchResult(
        name="polling",
        title=f"polling {n:,} finished Jobs: one paginated LIST vs a GET per Job",
        rounds=size.rounds,
        params={"jobs": n, "page_size": DEFAULT_PAGE_SIZE, "list_passes_per_sample": LIST_PASSES},
    )
    with services.cluster(ctx.work_dir, name="lc-poll") as cluster, KubeClient(cluster.kubeconfig) as kube:
        bodies = workload.job_bodies(n, namespace=NAMESPACE, caps=workload.resolver())
        rawhttp.create_jobs(cluster, NAMESPACE, bodies, clients=size.create_clients)
        workload.wait_jobs_terminal(kube, NAMESPACE, n)
        names = [body["metadata"]["name"] for body in bodies]

        def by_list() -> float:
            with Stopwatch() as sw:
                for _ in range(LIST_PASSES):
                    finished = sum(
                        1
                        for page in kube.iter_jobs(NAMESPACE, label_selector=job_labels.selector())
                        for job in page
                        if job_state(job).terminal
                    )
                    _check(finished, n)
            return sw.seconds / LIST_PASSES

        def by_get() -> float:
            with Stopwatch() as sw:
                finished = sum(1 for name in names if job_state(kube.get_job(NAMESPACE, name)).terminal)
            _check(finished, n)
            return sw.seconds

        seconds = interleaved({"list": by_list, "get": by_get}, rounds=size.rounds)

    result.figures += [
        Figure("poll_s_list", f"one poll by paginated LIST (mean of {LIST_PASSES})", "s", seconds["list"]),
        Figure("poll_s_get", f"one poll by {n:,} GETs", "s", seconds["get"]),
    ]
    result.ratios.append(
        Ratio(
            "get_vs_list_time",
            "poll time, a GET per Job / one paginated LIST",
            paired_ratios(seconds["get"], seconds["list"]),
        )
    )
    return result


def _check(finished: int, expected: int) -> None:
    if finished != expected:
        raise RuntimeError(f"saw {finished} finished Jobs, expected {expected}")
