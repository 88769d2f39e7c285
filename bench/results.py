"""What a benchmark reports: figures (medians of interleaved samples), ratios, targets, as JSON.

A `Figure` is one measured quantity (its samples, one per round, and their median); a `Ratio`
compares two variants measured side by side, round by round; a `Target` is a goal from an
issue with whether the median met it. `BenchRun.to_dict` is the JSON `python -m bench` writes.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench.timing import median

JSON_VERSION = 1


@dataclass(frozen=True)
class Target:
    """A goal for a figure's median: `at_least` (throughput) or `below` (a time)."""

    value: float
    at_least: bool = True

    def met(self, measured: float) -> bool:
        return measured >= self.value if self.at_least else measured < self.value

    def text(self, unit: str) -> str:
        return f"{'>=' if self.at_least else '<'} {self.value:g} {unit}"


@dataclass
class Figure:
    name: str  # snake_case key, stable across runs
    label: str  # what was measured, for people
    unit: str
    samples: list[float]
    target: Target | None = None

    @property
    def median(self) -> float:
        return median(self.samples)

    @property
    def met(self) -> bool | None:
        return None if self.target is None else self.target.met(self.median)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "label": self.label,
            "unit": self.unit,
            "median": self.median,
            "min": min(self.samples),
            "max": max(self.samples),
            "samples": list(self.samples),
            "target": self.target.text(self.unit) if self.target else None,
            "met": self.met,
        }


@dataclass
class Ratio:
    """numerator / denominator, one value per round (the two measured side by side)."""

    name: str
    label: str  # e.g. "GET per Job time / paginated LIST time"
    samples: list[float]

    @property
    def median(self) -> float:
        return median(self.samples)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "label": self.label,
            "median": self.median,
            "min": min(self.samples),
            "max": max(self.samples),
            "samples": list(self.samples),
        }


@dataclass
class BenchResult:
    name: str  # the family: localcluster, polling, adapter, delivery, recovery
    title: str
    rounds: int
    params: dict[str, Any] = field(default_factory=dict)  # sizes and settings of this run
    figures: list[Figure] = field(default_factory=list)
    ratios: list[Ratio] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0  # wall time of the whole family, setup included

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "rounds": self.rounds,
            "params": dict(self.params),
            "figures": [f.to_dict() for f in self.figures],
            "ratios": [r.to_dict() for r in self.ratios],
            "notes": list(self.notes),
            "seconds": self.seconds,
        }


def _load_average() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


@dataclass
class BenchRun:
    size: str  # "full" or "quick"
    started_at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    load_at_start: list[float] | None = field(default_factory=_load_average)  # 1, 5, 15 minutes
    results: list[BenchResult] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": JSON_VERSION,
            "size": self.size,
            "started_at": self.started_at.isoformat(),
            "seconds": self.seconds,
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "platform": platform.platform(),
                "load_average_at_start": self.load_at_start,
                "load_average_at_end": _load_average(),
            },
            "benchmarks": [r.to_dict() for r in self.results],
        }

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
