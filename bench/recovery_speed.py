"""5. Recovery: one sweep over a backlog of finished Jobs whose completions were never recorded
(the "worker was down while they ran" case), against the normal path for the same backlog.

Before each timed run: N dispatches written and marked created, their N Jobs created, all
finished (untimed). Then either `recovery.reconcile.run_sweep` (pages of Jobs matched with
their dispatches by one query per page, each page's completions through `recovery.delivery` on
`sweep_concurrency` threads) or the normal path inline: poll's paginated LIST, then
`delivery.complete_job` for each finished Job of a page on as many threads (what a worker's
`complete` tasks run, without the broker hop). One Runtime, as in a worker process.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import sqlalchemy as sa
from celery import Celery

import celeryconfig
from bench import rawhttp, services, workload
from bench.results import BenchResult, Figure, Ratio
from bench.sizes import Size
from bench.timing import Stopwatch, interleaved, paired_ratios, rates
from engine.db import transaction
from engine.models import Dispatch, DispatchState
from engine.settings import load_settings
from recovery import delivery
from recovery.reconcile import run_sweep
from recovery.runtime import Runtime
from recovery.sweep import Category
from tasks.app import celery_notifier
from workers import labels as job_labels
from workers.job_status import job_state

NAMESPACE = "bench-recovery"
CONCURRENCY = 8  # the sweep's threads, and the normal path's (a worker's default threads)


def run(ctx: services.BenchContext, size: Size) -> BenchResult:
    n = size.backlog
    result = BenchResult(
        name="recovery",
        title=f"recovery: a backlog of {n:,} finished, unrecorded Jobs",
        rounds=size.recovery_rounds,
        params={"backlog": n, "threads": CONCURRENCY},
    )
    caps_file = workload.write_capabilities(ctx.work_dir / "recovery-capabilities.yaml")
    with (
        services.database(ctx.pg_admin_url) as database_url,
        services.cluster(ctx.work_dir, name="lc-recovery") as cluster,
    ):
        settings = load_settings(
            services.deployment_env(
                {
                    "database_url": database_url,
                    "redis_url": ctx.redis_url,
                    "key_prefix": f"{ctx.key_prefix}-recovery",
                    "namespace": NAMESPACE,
                    "kubeconfig": str(cluster.kubeconfig),
                    "capabilities": str(caps_file),
                    "sweep_concurrency": str(CONCURRENCY),
                }
            )
        )
        producer = Celery("bench-notifier", set_as_current=False)
        producer.conf.update(celeryconfig.config(settings))
        rt = Runtime.from_settings(settings, notifier=celery_notifier(settings, via=producer))
        try:
            seconds = _measure(rt, cluster, size)
        finally:
            rt.close()
            producer.close()
    result.params["page_size"] = settings.poll_page_size
    result.figures += [
        Figure(
            "sweep_jobs_per_s",
            f"one recovery sweep (run_sweep, {CONCURRENCY} threads)",
            "jobs/s",
            rates(n, seconds["sweep"]),
        ),
        Figure(
            "poll_complete_jobs_per_s",
            f"poll's LIST + complete_job per Job, inline on {CONCURRENCY} threads",
            "jobs/s",
            rates(n, seconds["poll"]),
        ),
    ]
    result.ratios.append(
        Ratio(
            "sweep_vs_poll_complete_time",
            "backlog time, sweep / poll + complete",
            paired_ratios(seconds["sweep"], seconds["poll"]),
        )
    )
    result.notes.append(
        "each completion: guard, result from the Pod, terminal event, engine notified (a Celery message), "
        "finalizer removed, Job deleted"
    )
    return result


def _measure(rt: Runtime, cluster: services.Cluster, size: Size) -> dict[str, list[float]]:
    n = size.backlog

    def backlog() -> list[str]:
        made = workload.created_dispatches(
            rt.sessions, rt.resolver, count=n, namespace=NAMESPACE, max_input_bytes=rt.settings.max_input_bytes
        )
        rawhttp.create_jobs(cluster, NAMESPACE, [body for _, body in made], clients=size.create_clients)
        workload.wait_jobs_terminal(rt.kube, NAMESPACE, n)
        return [ref.dispatch_id for ref, _ in made]

    def sweep() -> float:
        ids = backlog()
        with Stopwatch() as sw:
            report = run_sweep(rt)
        completed = report.categories[Category.FINISHED_UNRECORDED].acted
        if completed != n or report.errors:
            raise RuntimeError(
                f"the sweep completed {completed} of {n} Jobs with {report.errors} error(s):\n{report.table()}"
            )
        _check_completed(rt, ids)
        return sw.seconds

    def poll_complete() -> float:
        ids = backlog()
        completed = 0
        with ThreadPoolExecutor(CONCURRENCY, thread_name_prefix="complete") as pool, Stopwatch() as sw:
            for page in rt.kube.iter_jobs(
                NAMESPACE, label_selector=job_labels.selector(), page_size=rt.settings.poll_page_size
            ):
                names = [job["metadata"]["name"] for job in page if job_state(job).terminal]
                outcomes = pool.map(lambda name: delivery.complete_job(rt, NAMESPACE, name), names)
                completed += sum(outcome is delivery.CompleteOutcome.COMPLETED for outcome in outcomes)
        if completed != n:
            raise RuntimeError(f"poll + complete completed {completed} of {n} Jobs")
        _check_completed(rt, ids)
        return sw.seconds

    return interleaved({"sweep": sweep, "poll": poll_complete}, rounds=size.recovery_rounds)


def _check_completed(rt: Runtime, ids: Sequence[str]) -> None:
    """Every dispatch of the backlog completed and its engine told; its Job gone."""
    with transaction(rt.sessions) as session:
        done = session.scalar(
            sa.select(sa.func.count()).where(
                Dispatch.dispatch_id.in_(ids),
                Dispatch.state == DispatchState.COMPLETED,
                Dispatch.notified_at.is_not(None),
            )
        )
    left = sum(len(page) for page in rt.kube.iter_jobs(NAMESPACE, label_selector=job_labels.selector()))
    if done != len(ids) or left:
        raise RuntimeError(f"{done} of {len(ids)} dispatches completed and notified; {left} Job(s) left")
