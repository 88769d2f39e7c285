"""What a benchmark reports: figures (medians of interleaved samples), ratios, targets, as JSON.

A `Figure` is one measured quantity (its samples, one per round, and their median); a `Ratio`
compares two variants measured side by side, round by round; either may carry a `Target`, a
goal from an issue, and `ref` (e.g. "8.1": issue 8, figure 1) to say which. Targets are
judged only at the sizes meant for it (quick and full, not smoke). `BenchRun.to_dict` is the
JSON `python -m k8s_dispatch.lab.bench` writes: per figure `name`, `value` (the median), `unit`, `target`, `met`.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from k8s_dispatch.lab.bench.timing import median

JSON_VERSION = 2
RATIO_UNIT = "x"


@dataclass(frozen=True)
class Target:
    """A goal for a figure's median: `at_least` (throughput), else below it (a time); `inclusive`
    makes "below" mean "at most" (<=, as in "<= 3 requests per Job")."""

    value: float
    at_least: bool = True
    inclusive: bool = False

    def met(self, measured: float) -> bool:
        if self.at_least:
            return measured >= self.value
        return measured <= self.value if self.inclusive else measured < self.value

    def text(self, unit: str) -> str:
        op = ">=" if self.at_least else ("<=" if self.inclusive else "<")
        return f"{op} {self.value:g}{unit}" if unit == RATIO_UNIT else f"{op} {self.value:g} {unit}"


class _Measured:
    """What a figure and a ratio share: the median of their samples, the target judged on it,
    and the JSON (the same keys for both)."""

    name: str
    label: str
    unit: str
    samples: list[float]
    target: Target | None
    ref: str | None

    @property
    def median(self) -> float:
        return median(self.samples)

    @property
    def met(self) -> bool | None:
        return None if self.target is None else self.target.met(self.median)

    def to_dict(self, *, judged: bool = True) -> dict[str, Any]:
        value = self.median
        return {
            "name": self.name,
            "label": self.label,
            "ref": self.ref,
            "unit": self.unit,
            "value": value,
            "median": value,
            "min": min(self.samples),
            "max": max(self.samples),
            "samples": list(self.samples),
            "target": self.target.text(self.unit) if self.target else None,
            "met": self.target.met(value) if self.target and judged else None,
        }


@dataclass
class Figure(_Measured):
    name: str  # snake_case key, stable across runs
    label: str  # what was measured, for people
    unit: str
    samples: list[float]
    target: Target | None = None
    ref: str | None = None  # the figure this is, e.g. "8.1"


@dataclass
class Ratio(_Measured):
    """numerator / denominator, one value per round (the two measured side by side)."""

    name: str
    label: str  # e.g. "GET per Job time / paginated LIST time"
    samples: list[float]
    target: Target | None = None
    ref: str | None = None

    unit = RATIO_UNIT


@dataclass
class BenchResult:
    name: str  # the benchmark, as named in bench.__main__.BENCHMARKS
    title: str
    rounds: int
    params: dict[str, Any] = field(default_factory=dict)  # sizes and settings of this run
    figures: list[Figure] = field(default_factory=list)
    ratios: list[Ratio] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0  # wall time of the whole benchmark, setup included

    def targeted(self) -> list[Figure | Ratio]:
        """Figures and ratios that carry a target, in the order reported."""
        measured: list[Figure | Ratio] = [*self.figures, *self.ratios]
        return [m for m in measured if m.target is not None]

    def to_dict(self, *, judged: bool = True) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "rounds": self.rounds,
            "params": dict(self.params),
            "figures": [f.to_dict(judged=judged) for f in self.figures],
            "ratios": [r.to_dict(judged=judged) for r in self.ratios],
            "notes": list(self.notes),
            "seconds": self.seconds,
        }


def _load_average() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


@dataclass
class BenchRun:
    size: str  # "smoke", "quick" or "full"
    judged: bool = True  # targets are judged at this size (not at "smoke")
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    load_at_start: list[float] | None = field(default_factory=_load_average)  # 1, 5, 15 minutes
    results: list[BenchResult] = field(default_factory=list)
    seconds: float = 0.0
    settings: dict[str, Any] = field(default_factory=dict)  # the run's own: size knobs, services

    def targets(self) -> list[tuple[BenchResult, Figure | Ratio]]:
        """Every figure with a target, those of an issue (`ref`) first, in ref order."""
        found = [(result, m) for result in self.results for m in result.targeted()]
        return sorted(found, key=lambda pair: (pair[1].ref is None, pair[1].ref or ""))

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": JSON_VERSION,
            "size": self.size,
            "targets_judged": self.judged,
            "started_at": self.started_at.isoformat(),
            "seconds": self.seconds,
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "platform": platform.platform(),
                "load_average_at_start": self.load_at_start,
                "load_average_at_end": _load_average(),
            },
            "settings": {
                **self.settings,
                "params": {r.name: dict(r.params) for r in self.results},
            },
            "targets": [{"benchmark": result.name, **m.to_dict(judged=self.judged)} for result, m in self.targets()],
            "benchmarks": [r.to_dict(judged=self.judged) for r in self.results],
        }

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
