"""`python -m k8s_dispatch.lab.bench` (`make bench`): every benchmark, a table of figures and targets, and JSON.

    python -m k8s_dispatch.lab.bench [--smoke | --full] [--only NAME ...] [--cluster local|real|both] [--results PATH] [--json-out PATH]
    python -m k8s_dispatch.lab.bench --plot [--results PATH] [--png PATH]

Sizes (lab/bench/sizes.py): quick by default (`make bench`, about 2 minutes on 2 cores), `--full`
(`make bench FULL=1`), `--smoke` (seconds, for the test suite; targets not judged). Results go
to lab/bench/results.json (git-ignored) or --results PATH, and also to --json-out PATH if given.
`--plot` runs nothing: it draws poll_cost's rows of --results PATH as a PNG (docs/poll-cost.png).
Needs PostgreSQL and Redis (`bash tests/services.sh`); starts its own localcluster and Celery
processes, and for `api_load` (unless `--cluster local`) the real control plane of `realcluster`
(built on first use).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from rich.console import Console

from k8s_dispatch.lab.bench import (
    adapter,
    admission,
    api_load,
    artifacts,
    cluster_speed,
    dispatch_throughput,
    maps,
    plot,
    poll_cost,
    report,
    services,
    sweep_scale,
)
from k8s_dispatch.lab.bench.results import BenchResult, BenchRun
from k8s_dispatch.lab.bench.sizes import SIZES, Size

Benchmark = Callable[[services.BenchContext, Size], BenchResult]

# In the order of issue 8's figures; each name is a module's `run(ctx, size)`.
BENCHMARKS: dict[str, Benchmark] = {
    "dispatch": dispatch_throughput.run,  # figure 1
    "api_load": api_load.run,  # figures 2 and 3
    "sweep": sweep_scale.run,  # figures 4 and 5
    "localcluster": cluster_speed.run,  # figure 6
    "adapter": adapter.run,
    "poll_cost": poll_cost.run,  # issue 16: objects read per finished Job, watch vs LIST poll
    "admission": admission.run,  # issue 17: a pass's cost with 1,000 vs 100,000 queued behind a limit
    "maps": maps.run,  # issue 29: N items as one map dispatch vs N single dispatches
    "artifacts": artifacts.run,  # issue 28: a large result vs a raw PUT + GET; requests per Job with a store
}
# Not an issue-8 figure, so not in the quick run (about 2 minutes); `--only adapter` runs it there.
SKIPPED_AT = {"adapter": {"quick"}}
DEFAULT_RESULTS = Path(__file__).resolve().parent / "results.json"
CLUSTERS = {
    "local": (services.LOCAL,),
    "real": (services.REAL,),
    "both": (services.LOCAL, services.REAL),
    # api_load beside a real node: the agent's control plane, then the kubelet's (minutes more)
    "kubelet": (services.KUBELET,),
    "all": (services.LOCAL, services.REAL, services.KUBELET),
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m k8s_dispatch.lab.bench", description=__doc__.splitlines()[0])
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--full", dest="size", action="store_const", const="full",
                       help="the issues' sizes (make bench FULL=1): several minutes")  # fmt: skip
    sizes.add_argument("--smoke", dest="size", action="store_const", const="smoke",
                       help="tiny sizes (the test suite's): seconds; targets not judged")  # fmt: skip
    parser.set_defaults(size="quick")
    parser.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), metavar="NAME",
                        help=f"run only these ({', '.join(BENCHMARKS)})")  # fmt: skip
    parser.add_argument("--cluster", choices=CLUSTERS, default="both",
                        help="the API servers api_load runs against: localcluster, the real control plane, both, beside "
                             "a real node (kubelet: the node agent's and the kubelet's control planes), or all")  # fmt: skip
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="where the JSON results go")
    parser.add_argument("--json-out", type=Path, help="also write the JSON results here")
    parser.add_argument("--plot", action="store_true", help="only draw poll_cost's results (--results) as a PNG")
    parser.add_argument("--png", type=Path, default=plot.DEFAULT_PNG, help="where --plot writes")
    parser.add_argument("--pg-admin-url", default=services.PG_ADMIN_URL, help="creates and drops the run's database")
    parser.add_argument("--redis-url", default=services.REDIS_URL)
    return parser.parse_args(argv)


def run(
    names: Sequence[str],
    size: Size,
    *,
    pg_admin_url: str,
    redis_url: str,
    console: Console,
    clusters: tuple[str, ...] = CLUSTERS["both"],
) -> BenchRun:
    """Run the named benchmarks at `size`, with the run's own databases and Redis prefix."""
    bench_run = BenchRun(
        size=size.name,
        judged=size.check_targets,
        settings={"benchmarks": list(names), "size": dataclasses.asdict(size), "clusters": list(clusters)},
    )
    started = time.perf_counter()
    services.check_postgres(pg_admin_url)
    with (
        tempfile.TemporaryDirectory(prefix="k8s-dispatch-bench-") as tmp,
        services.redis_prefix(redis_url) as prefix,
    ):
        ctx = services.BenchContext(
            work_dir=Path(tmp), pg_admin_url=pg_admin_url, redis_url=redis_url, key_prefix=prefix, clusters=clusters
        )
        for name in names:
            console.print(f"[bold]{name}[/] ...")
            family_started = time.perf_counter()
            result = BENCHMARKS[name](ctx, size)
            result.seconds = time.perf_counter() - family_started
            console.print(f"  done in {result.seconds:.1f}s")
            bench_run.results.append(result)
    bench_run.seconds = time.perf_counter() - started
    return bench_run


def default_names(size: Size) -> list[str]:
    """The benchmarks a run of this size makes unless told which (`--only`)."""
    return [name for name in BENCHMARKS if size.name not in SKIPPED_AT.get(name, set())]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot:
        print(f"plot written to {plot.plot(poll_cost.rows_of(args.results), args.png)}")
        return 0
    size = SIZES[args.size]
    names = [name for name in BENCHMARKS if name in args.only] if args.only else default_names(size)
    console = Console()
    if not console.is_terminal:  # a log or a pipe: wide enough for the tables
        console = Console(width=160)
    for name in [] if args.only else sorted(set(BENCHMARKS) - set(names)):  # left out by size, not by --only
        console.print(f"[dim]{name}: not run at {size.name} size (--only {name} runs it)[/]")
    try:
        bench_run = run(names, size, pg_admin_url=args.pg_admin_url, redis_url=args.redis_url, console=console,
                        clusters=CLUSTERS[args.cluster])  # fmt: skip
    except services.ServiceUnavailable as e:
        console.print(f"[red]bench cannot run:[/] {e}")
        return 2
    report.show(bench_run, console)
    for path in [args.results, *([args.json_out] if args.json_out else [])]:
        bench_run.write(path)
        console.print(f"results written to {path}")
    console.print(f"bench took {bench_run.seconds:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
