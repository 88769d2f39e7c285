"""The chaos run's report: what it did and found, as tables on a rich Console (the final line is
`ChaosResult.final_line`)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from k8s_dispatch.lab.chaos.cluster import LOCALCLUSTER
from k8s_dispatch.lab.chaos.fault_plan import FaultKind
from k8s_dispatch.lab.chaos.options import DEPLOYMENT_SETTINGS, ChaosOptions, ChaosResult


def render(result: ChaosResult, console: Any) -> None:
    """Print what the run did and found as tables on a rich Console (not the final line)."""
    from rich.table import Table

    options, verdict = result.options, result.verdict
    setup = Table(title="chaos run", show_header=False)
    setup.add_column(style="bold")
    setup.add_column()
    for name, value in (
        ("seed", options.seed),
        ("dispatches", f"{options.dispatches} ({options.map_count} of them maps) at {options.rate:g}/s "
                       f"(feed {result.feed_s:.1f}s)"),
        ("processes", f"{options.workers} x celery -A k8s_dispatch.tasks worker, celery -A k8s_dispatch.tasks beat"),
        ("cluster", _cluster_words(options)),
        ("deployment", ", ".join(f"{k.lower()}={v}" for k, v in DEPLOYMENT_SETTINGS.items())),
        ("database / prefix", f"{result.database} / {result.prefix}"),
        ("converged", (f"{result.converged_s:.1f}s after the faults stopped" if result.converged_s is not None
                       else f"NOT within {options.deadline_s:g}s")
         + (f" ({result.slots_wait_s:.1f}s of it waiting for the slots of ended dispatches to be freed)"
            if result.slots_wait_s is not None else "")),
        ("wall time", f"{result.wall_s:.1f}s"),
    ):  # fmt: skip
        setup.add_row(name, str(value))
    console.print(setup)

    faults = Table(title="faults (planned from the seed, then done)")
    for column in ("fault", "planned", "done", "what happened"):
        faults.add_column(column)
    for kind in FaultKind:
        done = [d for d in result.done if d.fault.kind is kind]
        if not done and not result.plan.count(kind):
            continue
        if kind is FaultKind.KILL:
            by_target = Counter(d.fault.target for d in done if d.ok)
            what = ", ".join(f"{t} x{n}" for t, n in sorted(by_target.items()))
        elif kind is FaultKind.API_FAULTS_ON:
            kinds = ", ".join(f"{k} x{n}" for k, n in result.api_faults_by_kind.items())
            what = f"{done[0].detail if done else ''}; {result.api_faults} injected ({kinds})"
        else:
            what = "; ".join(d.detail for d in done)
        failed = [d for d in done if not d.ok]
        if failed:
            what += f" [red]{len(failed)} failed: {failed[0].detail}[/red]"
        faults.add_row(kind.value, str(result.plan.count(kind)), str(sum(d.ok for d in done)), what)
    if result.unexpected_exits:
        faults.add_row("unexpected exits", "0", str(len(result.unexpected_exits)), "; ".join(result.unexpected_exits))
    if result.deaf:
        faults.add_row("deaf after the Redis restart", "0", str(len(result.deaf)), "; ".join(result.deaf))
    if result.unexpected_errors:
        faults.add_row("exceptions escaping a task", "0", str(len(result.unexpected_errors)),
                       "; ".join(result.unexpected_errors[:5]))  # fmt: skip
    console.print(faults)

    outcomes = Table(title="terminal events")
    outcomes.add_column("event")
    outcomes.add_column("dispatches", justify="right")
    for outcome, count in sorted(verdict.outcomes.items()):
        outcomes.add_row(outcome, str(count))
    console.print(outcomes)
    if verdict.items:
        items = Table(title=f"item events ({verdict.items} items of {verdict.maps} map dispatches)")
        items.add_column("event")
        items.add_column("items", justify="right")
        for outcome, count in sorted(verdict.item_outcomes.items()):
            items.add_row(outcome, str(count))
        console.print(items)

    checks = Table(title="checks")
    for column in ("check", "found", ""):
        checks.add_column(column)
    for name, value in (
        ("lost (no terminal event)", verdict.lost),
        ("duplicates (more than one terminal event)", verdict.duplicates),
        ("wrong output or reason", verdict.wrong_output),
        ("map items lost (no item event)", verdict.items_lost),
        ("map items with more than one item event", verdict.items_duplicates),
        ("map items with a wrong output or reason", verdict.items_wrong_output),
        ("leftover jobs or finalizers", verdict.leftover_jobs),
        ("Pods still holding our finalizer", verdict.held_pods),
        ("dispatches with a second Job", verdict.second_jobs),
        ("dispatches with a Job outside their recorded namespace", verdict.wrong_namespace),
        ("Jobs (a map: its Pods) running beyond a limit (worst sample)", max(0, verdict.limit_exceeded or 0)),
        ("dispatches holding a slot after convergence", verdict.running),
        ("dispatches queued after convergence", verdict.queued),
        ("guard claims held past their lease", verdict.held_claims),
        ("ended without the engine told", verdict.unnotified),
    ):
        checks.add_row(name, str(value), "[green]ok[/green]" if value == 0 else "[red]FAIL[/red]")
    objects = result.objects
    if options.objectstore:
        for name, value in (
            (f"stored results ({objects.large}) not read back as their SHA-256", objects.large_bad),
            (f"objects under the run's prefix ({objects.objects}) no dispatch of it records", objects.orphan_objects),
            (f"planned failures without their archived log ({objects.logs_archived} with)", objects.logs_missing),
            (f"secret inputs ({objects.secrets}) found where they must not be", objects.secret_leaks),
        ):
            checks.add_row(name, str(value), "[green]ok[/green]" if value == 0 else "[red]FAIL[/red]")
        scanned = ", ".join(f"{n} {place}s" for place, n in objects.scanned.items())
        checks.add_row("read for secret markers", scanned or "nothing", "")
    for name, value in sorted(result.stats.items()):
        checks.add_row(f"stat: {name}", str(value), "")
    checks.add_row("schedule task calls sent again by the engine", str(result.resends), "")
    checks.add_row("Jobs the observer saw", str(result.jobs_seen), "")
    if result.neighbour is not None:
        n = result.neighbour
        checks.add_row(f"second deployment: {n.dispatched} dispatches, {n.terminal} ended",
                       "clean" if n.ok else "NOT clean", "[green]ok[/green]" if n.ok else "[red]FAIL[/red]")  # fmt: skip
    console.print(checks)
    if verdict.limits:
        limits = Table(title=f"fair-share limits: the most Jobs running at once (a map's: its running Pods), "
                             f"{result.samples} samples 100 ms apart")  # fmt: skip
        for column in ("limit", "maxRunning", "most running", "most queued (database)", ""):
            limits.add_column(column)
        for peak in verdict.limits:
            queued = str(result.queued_peak.get(peak.name, 0)) if peak.scope == "tenancy" else ""
            mark = "[green]ok[/green]" if peak.excess <= 0 else "[red]FAIL[/red]"
            limits.add_row(f"{peak.scope} {peak.name}", str(peak.limit), str(peak.peak), queued, mark)
        console.print(limits)
    for problem in [*verdict.problems, *result.objects.problems]:
        console.print(f"[red]{problem}[/red]")
    for dispatch_id, lines in result.stories.items():
        console.print(f"what the logs say of {dispatch_id} (the last {len(lines)} lines naming it):", markup=False)
        for line in lines:
            console.print(f"  {line}", markup=False, highlight=False, soft_wrap=True)
    if result.error:
        console.print(f"[red]error: {result.error}[/red]")
    if not result.ok:
        console.print(f"logs and cluster state kept in {result.work_dir}")


def _cluster_words(options: ChaosOptions) -> str:
    if options.cluster == LOCALCLUSTER:
        return f"localcluster serve --mode {options.mode}"
    return (f"realcluster: etcd, kube-apiserver, kube-controller-manager, node agent --mode {options.mode}; "
            "workers through faultproxy as deploy/rbac.yaml's ServiceAccount")  # fmt: skip
