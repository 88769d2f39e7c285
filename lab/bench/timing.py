"""Timing on a shared, noisy machine: variants run interleaved, figures are medians, comparisons ratios.

A variant is a callable that does its own untimed setup and returns the seconds its measured
part took (use `Stopwatch`). `interleaved` runs every variant once per round, alternating the
order (A B, B A, A B...) so that neither always runs first; `paired_ratios` divides the two
variants' measurements round by round, so each ratio compares runs made seconds apart.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

T = TypeVar("T")

Variant = Callable[[], float]  # runs once, returns the seconds of its measured part


class Stopwatch:
    """`with Stopwatch() as sw: ...` then `sw.seconds`."""

    def __init__(self) -> None:
        self._start = 0.0
        self.seconds = 0.0

    def __enter__(self) -> Stopwatch:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._start


def timed(fn: Callable[[], object]) -> float:
    """The seconds one call of `fn` takes."""
    with Stopwatch() as sw:
        fn()
    return sw.seconds


def interleaved(variants: Mapping[str, Variant], *, rounds: int, warmup: bool = False) -> dict[str, list[float]]:
    """Run each variant `rounds` times, interleaved; their seconds, in round order, by name.

    Even rounds run the variants in the given order, odd rounds in reverse (A B | B A | A B),
    so drift in the machine's load and warm caches favour no variant. `warmup`: run each once
    first, untimed (for code whose first call loads or compiles something).
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    names = list(variants)
    if warmup:
        for name in names:
            variants[name]()
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for round_no in range(rounds):
        for name in names if round_no % 2 == 0 else reversed(names):
            seconds[name].append(variants[name]())
    return seconds


def alternating(operations: Mapping[str, Callable[[T], object]], items: Sequence[T]) -> dict[str, float]:
    """Feed `items` to the operations in turn (item 0 to the first, item 1 to the second...);
    the total seconds each operation took. For per-operation differences smaller than the
    machine's noise: a burst of load lands on every operation alike."""
    names = list(operations)
    seconds = dict.fromkeys(names, 0.0)
    for i, item in enumerate(items):
        name = names[i % len(names)]
        with Stopwatch() as sw:
            operations[name](item)
        seconds[name] += sw.seconds
    return seconds


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def rates(count: int, seconds: Sequence[float]) -> list[float]:
    """Operations per second for each measurement of `count` operations."""
    return [count / s for s in seconds]


def per_op_ms(count: int, seconds: Sequence[float]) -> list[float]:
    """Milliseconds per operation for each measurement of `count` operations."""
    return [1000.0 * s / count for s in seconds]


def paired_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    """numerator[i] / denominator[i] for each round: two measurements made side by side."""
    if len(numerator) != len(denominator):
        raise ValueError(f"{len(numerator)} measurements against {len(denominator)}")
    return [n / d for n, d in zip(numerator, denominator, strict=True)]
