"""The bench's table for the terminal: every figure (median, range, target, met) and every ratio."""

from __future__ import annotations

import os

from rich.console import Console
from rich.table import Table

from bench.results import BenchRun


def _number(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}"


def figures_table(run: BenchRun) -> Table:
    table = Table(title=f"k8s-dispatch bench ({run.size}): medians of interleaved rounds")
    for column, justify in (("benchmark", "left"), ("figure", "left"), ("median", "right"), ("range", "right"),
                            ("unit", "left"), ("target", "left"), ("met", "center")):  # fmt: skip
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for result in run.results:
        for i, figure in enumerate(result.figures):
            met = "" if figure.met is None else ("[green]yes[/]" if figure.met else "[red]no[/]")
            table.add_row(
                result.name if i == 0 else "",
                figure.label,
                _number(figure.median),
                f"{_number(min(figure.samples))}-{_number(max(figure.samples))}",
                figure.unit,
                figure.target.text(figure.unit) if figure.target else "",
                met,
            )
        table.add_section()
    return table


def ratios_table(run: BenchRun) -> Table:
    table = Table(title="ratios, measured side by side (median of per-round ratios)")
    for column, justify in (("benchmark", "left"), ("ratio", "left"), ("median", "right"), ("range", "right")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for result in run.results:
        for i, ratio in enumerate(result.ratios):
            table.add_row(
                result.name if i == 0 else "",
                ratio.label,
                f"{ratio.median:.2f}x",
                f"{min(ratio.samples):.2f}-{max(ratio.samples):.2f}",
            )
    return table


def show(run: BenchRun, console: Console | None = None) -> None:
    console = console or Console()
    console.print(figures_table(run))
    console.print(ratios_table(run))
    for result in run.results:
        for note in result.notes:
            console.print(f"[dim]{result.name}: {note}[/]")
    if run.load_at_start is not None:
        load = ", ".join(f"{value:.1f}" for value in run.load_at_start)
        console.print(f"[dim]load average at start (1, 5, 15 min): {load} on {os.cpu_count()} cpus[/]")
