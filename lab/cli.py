"""The lab's command line: `python -m k8s_dispatch.lab chaos|realcluster ...` (`make chaos`).
Apart from `k8s-dispatch`, which is the product's and never imports the lab."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import click

from k8s_dispatch.cli import EXIT_FAILED, EXIT_OK, run_group
from k8s_dispatch.lab.realcluster.cli import realcluster

# `chaos --skip NAME`: the options that leave a class of fault out.
CHAOS_SKIPPABLE: dict[str, dict[str, Any]] = {
    "redis_restart": {"redis_restarts": 0},
    "pg_restart": {"pg_restarts": 0},
    "objectstore_restart": {"objectstore_restarts": 0},
    "objectstore": {"objectstore": False},
    "lost_cancel": {"lost_cancels": 0},
    "label_edit": {"label_edits": 0},
    "clock_step": {"clock_step_s": 0.0},
    "rolling_upgrade": {"upgrade_from": None},
    "idle_namespaces": {"idle_namespaces": 0},
}


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def lab() -> None:
    """The lab around k8s-dispatch: the chaos run and the real control plane."""


@lab.command()
@click.option("--dispatches", default=1000, show_default=True, type=click.IntRange(min=1), help="How many to schedule.")
@click.option("--workers", default=3, show_default=True, type=click.IntRange(min=1), help="Worker processes.")
@click.option("--seed", default=None, type=int, help="Seed of the fault schedule and the work mix (default: random).")
@click.option(
    "--mode",
    type=click.Choice(["simulate", "exec"]),
    default="simulate",
    show_default=True,
    help="The cluster runs the Jobs' pods as processes (exec) or simulates them.",
)
@click.option(
    "--cluster",
    type=click.Choice(["localcluster", "realcluster"]),
    default="localcluster",
    show_default=True,
    help="localcluster serve, or the real control plane (kube-apiserver, etcd, the Job controller) behind "
    "a fault proxy.",
)
@click.option(
    "--no-ready-gate",
    "no_ready_gate",
    is_flag=True,
    help="realcluster: let the workers reach a kube-apiserver that is not ready yet (no load balancer).",
)
@click.option(
    "--rate",
    default=10.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Dispatches per second from the feeder.",
)
@click.option(
    "--kills", default=20, show_default=True, type=click.IntRange(min=0), help="SIGKILLs of a worker or beat."
)
@click.option(
    "--deadline",
    default=300.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds to converge once the faults stop.",
)
@click.option(
    "--json-out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the result as JSON here.",
)
@click.option(
    "--database-url", default=None, help="Use this PostgreSQL database (default: a fresh one, dropped after)."
)
@click.option(
    "--work-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Keep logs and cluster state here (default: a temp dir, kept only if the run fails).",
)
@click.option(
    "--upgrade-from",
    default="HEAD~1",
    show_default=True,
    help="Start the workers and beat from this commit (a git worktree), migrate under them, then replace "
    "them (a rolling upgrade); 'none' for no upgrade.",
)
@click.option(
    "--skip",
    multiple=True,
    type=click.Choice(sorted(CHAOS_SKIPPABLE)),
    help="Leave out one class of fault (repeatable).",
)
@click.option("--show-plan", is_flag=True, help="Print the seed's fault schedule and exit; run nothing.")
def chaos(dispatches: int, workers: int, seed: int | None, mode: str, cluster: str, no_ready_gate: bool,
          rate: float, kills: int, deadline: float, json_out: Path | None, database_url: str | None,
          work_dir: Path | None, upgrade_from: str, skip: tuple[str, ...], show_plan: bool) -> int:  # fmt: skip
    """Run the system under abuse (kills, a broker flush, API faults and restart, a DB connection
    kill) against real PostgreSQL, Redis and a cluster (localcluster or the real control plane);
    check nothing is lost, doubled, wrong or left over. Ends with one `chaos: ...` line; exits 1 if
    any check fails."""
    import json
    import random

    from rich.console import Console

    from k8s_dispatch.lab.chaos.run import ChaosOptions, fault_plan, render, run

    options = ChaosOptions(
        dispatches=dispatches, workers=workers, seed=seed if seed is not None else random.SystemRandom().randrange(10**6),
        mode=mode, cluster=cluster, api_ready_gate=not no_ready_gate, rate=rate, kills=kills, deadline_s=deadline,
        database_url=database_url, work_dir=work_dir, upgrade_from=None if upgrade_from == "none" else upgrade_from,
    )  # fmt: skip
    options = dataclasses.replace(options, **{k: v for name in skip for k, v in CHAOS_SKIPPABLE[name].items()})
    if show_plan:
        click.echo(f"seed {options.seed}: faults over {options.window_s:g}s\n{fault_plan(options).describe()}")
        return EXIT_OK
    err = Console(stderr=True)
    result = run(options, progress=lambda line: err.print(line, highlight=False))
    render(result, Console())
    if json_out is not None:
        json_out.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    click.echo(result.final_line())
    return EXIT_OK if result.ok else EXIT_FAILED


lab.add_command(realcluster)


def main(argv: list[str] | None = None) -> int:
    return run_group(lab, argv, "python -m k8s_dispatch.lab")


if __name__ == "__main__":
    sys.exit(main())
