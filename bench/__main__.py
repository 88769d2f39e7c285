"""`python -m bench` (`make bench`): every benchmark, a table of figures and ratios, and JSON.

    python -m bench [--quick] [--only NAME ...] [--json-out PATH] [--results-dir DIR]

Results go to DIR/latest.json (DIR defaults to bench/results, git-ignored; a --quick run writes
DIR/latest-quick.json instead) and to --json-out PATH if given. Needs PostgreSQL and Redis
(`bash tests/services.sh`); starts its own localcluster and Celery processes.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from rich.console import Console

from bench import adapter, cluster_speed, delivery_speed, polling, recovery_speed, report, services
from bench.results import BenchResult, BenchRun
from bench.sizes import FULL, QUICK, Size

Benchmark = Callable[[services.BenchContext, Size], BenchResult]

BENCHMARKS: dict[str, Benchmark] = {
    "localcluster": cluster_speed.run,
    "polling": polling.run,
    "adapter": adapter.run,
    "delivery": delivery_speed.run,
    "recovery": recovery_speed.run,
}
DEFAULT_RESULTS_DIR = Path(__file__).resolve().parent / "results"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the smoke test's): seconds, not minutes")
    parser.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), metavar="NAME",
                        help=f"run only these ({', '.join(BENCHMARKS)})")  # fmt: skip
    parser.add_argument("--json-out", type=Path, help="also write the JSON results here")
    parser.add_argument("--results-dir", type=Path, default=DEFAULT_RESULTS_DIR, help="where latest.json goes")
    parser.add_argument("--pg-admin-url", default=services.PG_ADMIN_URL, help="creates and drops the run's database")
    parser.add_argument("--redis-url", default=services.REDIS_URL)
    return parser.parse_args(argv)


def run(names: Sequence[str], size: Size, *, pg_admin_url: str, redis_url: str, console: Console) -> BenchRun:
    """Run the named benchmarks at `size`, with the run's own databases and Redis prefix."""
    bench_run = BenchRun(size=size.name)
    started = time.perf_counter()
    services.check_postgres(pg_admin_url)
    with (
        tempfile.TemporaryDirectory(prefix="k8s-dispatch-bench-") as tmp,
        services.redis_prefix(redis_url) as prefix,
    ):
        ctx = services.BenchContext(
            work_dir=Path(tmp), pg_admin_url=pg_admin_url, redis_url=redis_url, key_prefix=prefix
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


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    size = QUICK if args.quick else FULL
    names = [name for name in BENCHMARKS if not args.only or name in args.only]
    console = Console()
    if not console.is_terminal:  # a log or a pipe: wide enough for the tables
        console = Console(width=160)
    try:
        bench_run = run(names, size, pg_admin_url=args.pg_admin_url, redis_url=args.redis_url, console=console)
    except services.ServiceUnavailable as e:
        console.print(f"[red]bench cannot run:[/] {e}")
        return 2
    report.show(bench_run, console)
    latest = args.results_dir / ("latest-quick.json" if args.quick else "latest.json")
    for path in [latest, *([args.json_out] if args.json_out else [])]:
        bench_run.write(path)
        console.print(f"results written to {path}")
    console.print(f"bench took {bench_run.seconds:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
