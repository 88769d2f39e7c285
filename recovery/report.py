"""What one recovery sweep found and did: counts per category, as a table or as JSON.

Filled in by `recovery.sweep.run_sweep`; read by the `recover` CLI, the sweep's log line,
the metrics and the tests. Per category: found, acted, skipped (fresh state showed nothing was
left to do) and errors; and the finished Jobs deferred to completions already queued.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from k8s_dispatch.recovery.plan import Category

UNNOTIFIED_ROW = "unnotified"  # terminal dispatches whose engine notification was not sent
MAX_PROBLEMS = 50  # lines kept in a report; the log has them all


@dataclass
class Counts:
    found: int = 0
    acted: int = 0
    skipped: int = 0  # planned, then found unnecessary on a fresh read (normal work got there)
    errors: int = 0


@dataclass
class SweepReport:
    dry_run: bool
    started_at: datetime
    finished_at: datetime | None = None
    namespaces: list[str] = field(default_factory=list)
    jobs_listed: int = 0
    dispatches_checked: int = 0  # non-terminal dispatches looked up for a missing Job
    categories: dict[Category, Counts] = field(default_factory=lambda: {c: Counts() for c in Category})
    unnotified: Counts = field(default_factory=Counts)
    # Finished Jobs (found in category 2, or 4 when their completion is being written) left to
    # the completion poll queued for them (a live hand-off marker, see delivery.handoff):
    # neither acted on nor skipped by this sweep.
    completions_deferred: int = 0
    # Jobs of ours made before the deployment label existed, given it (dry run: to be given).
    jobs_labelled: int = 0
    # How long the oldest dispatch still scheduled past the grace period had waited for its Job
    # (by the database's clock; 0: none): beyond grace + a sweep interval, its creates fail.
    oldest_scheduled_s: float = 0.0
    # Failures that are not one action's: a namespace that could not be listed, a page of
    # the database that could not be read. Each also counts as an error.
    problems: list[str] = field(default_factory=list)
    problem_count: int = 0

    def add_problem(self, text: str) -> None:
        self.problem_count += 1
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(text)

    @property
    def errors(self) -> int:
        return sum(c.errors for c in self.categories.values()) + self.unnotified.errors + self.problem_count

    @property
    def duration_s(self) -> float | None:
        if self.finished_at is None:
            return None
        return (self.finished_at - self.started_at).total_seconds()

    def rows(self) -> list[tuple[str, Counts]]:
        """(row name, counts) in table order: the categories, then re-notifications."""
        named = [(f"{c.value} {c.label}", counts) for c, counts in sorted(self.categories.items())]
        return [*named, (UNNOTIFIED_ROW, self.unnotified)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "started_at": self.started_at.isoformat(),
            "finished_at": self.finished_at.isoformat() if self.finished_at else None,
            "duration_s": self.duration_s,
            "namespaces": list(self.namespaces),
            "jobs_listed": self.jobs_listed,
            "dispatches_checked": self.dispatches_checked,
            "categories": {c.label: asdict(counts) for c, counts in sorted(self.categories.items())},
            UNNOTIFIED_ROW: asdict(self.unnotified),
            "completions_deferred": self.completions_deferred,
            "jobs_labelled": self.jobs_labelled,
            "errors": self.errors,
            "problems": list(self.problems),
        }

    def summary(self) -> str:
        """One log line: found/acted/skipped per category."""
        parts = [f"{name.split(' ')[-1]}={c.found}/{c.acted}/{c.skipped}" for name, c in self.rows()]
        mode = " (dry run)" if self.dry_run else ""
        return (
            f"sweep{mode}: jobs={self.jobs_listed} " + " ".join(parts)
            + f" deferred={self.completions_deferred} errors={self.errors} (found/acted/skipped)"
        )  # fmt: skip

    def table(self) -> str:
        """A plain-text table of the counts, then the problems, for the terminal."""
        header = ("category", "found", "acted", "skipped", "errors")
        body = [(name, str(c.found), str(c.acted), str(c.skipped), str(c.errors)) for name, c in self.rows()]
        widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]

        def line(cells: tuple[str, ...]) -> str:
            return "  ".join(
                cell.ljust(width) if i == 0 else cell.rjust(width)
                for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
            ).rstrip()

        lines = [line(header), *(line(row) for row in body)]
        duration = f" in {self.duration_s:.2f}s" if self.duration_s is not None else ""
        mode = "dry run: nothing was changed; " if self.dry_run else ""
        lines.append(
            f"{mode}{self.jobs_listed} jobs listed in {len(self.namespaces)} namespace(s), "
            f"{self.dispatches_checked} dispatches checked, {self.completions_deferred} completion(s) "
            f"left to queued messages{duration}; {self.errors} error(s)"
        )
        lines.extend(f"problem: {text}" for text in self.problems)
        return "\n".join(lines)
