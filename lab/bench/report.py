"""The bench's tables for the terminal: first every figure with a target (issue 8's, in figure
order: median, range, target, met), then the other figures, then the other ratios."""

from __future__ import annotations

import os

from rich.console import Console, JustifyMethod
from rich.table import Table

from k8s_dispatch.lab.bench.results import RATIO_UNIT, BenchRun, Figure, Ratio


def _number(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}"


def _value(m: Figure | Ratio, value: float) -> str:
    return f"{value:.2f}" if m.unit == RATIO_UNIT else _number(value)


def _range(m: Figure | Ratio) -> str:
    return f"{_value(m, min(m.samples))}-{_value(m, max(m.samples))}"


def _met(m: Figure | Ratio, *, judged: bool) -> str:
    if m.met is None:
        return ""
    if not judged:
        return "[dim]not judged[/]"
    return "[green]yes[/]" if m.met else "[red]NO[/]"


def _table(title: str, columns: tuple[tuple[str, JustifyMethod], ...]) -> Table:
    table = Table(title=title)
    for column, justify in columns:
        table.add_column(column, justify=justify)
    return table


def targets_table(run: BenchRun) -> Table:
    judged = "" if run.judged else "; targets are not judged at this size"
    table = _table(
        f"targets ({run.size} size{judged}): medians of interleaved rounds",
        (("#", "left"), ("benchmark", "left"), ("figure", "left"), ("median", "right"), ("range", "right"),
         ("target", "left"), ("met", "center")),
    )  # fmt: skip
    for result, m in run.targets():
        assert m.target is not None
        table.add_row(
            m.ref or "", result.name, m.label, f"{_value(m, m.median)} {m.unit}", _range(m),
            m.target.text(m.unit), _met(m, judged=run.judged),
        )  # fmt: skip
    return table


def figures_table(run: BenchRun) -> Table:
    table = _table(
        "other figures: medians of interleaved rounds",
        (("benchmark", "left"), ("figure", "left"), ("median", "right"), ("range", "right"), ("unit", "left")),
    )
    for result in run.results:
        rows = [f for f in result.figures if f.target is None]
        for i, figure in enumerate(rows):
            table.add_row(
                result.name if i == 0 else "", figure.label, _number(figure.median), _range(figure), figure.unit
            )
        if rows:
            table.add_section()
    return table


def ratios_table(run: BenchRun) -> Table:
    table = _table(
        "other ratios, measured side by side (median of per-round ratios)",
        (("benchmark", "left"), ("ratio", "left"), ("median", "right"), ("range", "right")),
    )
    for result in run.results:
        rows = [r for r in result.ratios if r.target is None]
        for i, ratio in enumerate(rows):
            table.add_row(result.name if i == 0 else "", ratio.label, f"{_value(ratio, ratio.median)}x", _range(ratio))
    return table


def show(run: BenchRun, console: Console | None = None) -> None:
    console = console or Console()
    if run.targets():
        console.print(targets_table(run))
    for table in (figures_table(run), ratios_table(run)):
        if table.row_count:
            console.print(table)
    for result in run.results:
        for note in result.notes:
            console.print(f"[dim]{result.name}: {note}[/]")
    if run.load_at_start is not None:
        load = ", ".join(f"{value:.1f}" for value in run.load_at_start)
        console.print(f"[dim]load average at start (1, 5, 15 min): {load} on {os.cpu_count()} cpus[/]")
