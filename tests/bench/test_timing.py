"""lab/bench/timing.py: the interleaving order, warm-up and ratios every benchmark figure relies on."""

from __future__ import annotations

import pytest

from k8s_dispatch.lab.bench.results import BenchResult, BenchRun, Figure, Ratio, Target
from k8s_dispatch.lab.bench.timing import alternating, interleaved, paired_ratios, per_op_ms, rates


def test_variants_alternate_their_order_each_round() -> None:
    calls: list[str] = []

    def variant(name: str, seconds: float):
        def run() -> float:
            calls.append(name)
            return seconds

        return run

    seconds = interleaved({"a": variant("a", 1.0), "b": variant("b", 2.0)}, rounds=3)

    assert calls == ["a", "b", "b", "a", "a", "b"]
    assert seconds == {"a": [1.0, 1.0, 1.0], "b": [2.0, 2.0, 2.0]}


def test_warmup_runs_each_variant_once_untimed() -> None:
    values = iter([9.0, 1.0, 2.0])  # the first (warm-up) value is dropped
    seconds = interleaved({"a": lambda: next(values)}, rounds=2, warmup=True)
    assert seconds == {"a": [1.0, 2.0]}


def test_rounds_must_be_positive() -> None:
    with pytest.raises(ValueError):
        interleaved({"a": lambda: 1.0}, rounds=0)


def test_ratios_pair_measurements_round_by_round() -> None:
    assert paired_ratios([4.0, 9.0], [2.0, 3.0]) == [2.0, 3.0]
    with pytest.raises(ValueError):
        paired_ratios([1.0], [1.0, 2.0])


def test_rates_and_per_op_times() -> None:
    assert rates(100, [0.5, 2.0]) == [200.0, 50.0]
    assert per_op_ms(10, [0.02]) == [2.0]


@pytest.mark.parametrize(
    ("target", "samples", "met"),
    [
        (Target(1000.0, at_least=True), [900.0, 1100.0, 1200.0], True),
        (Target(1000.0, at_least=True), [900.0, 950.0, 1200.0], False),
        (Target(1.0, at_least=False), [0.5, 0.9, 1.5], True),
        (Target(1.0, at_least=False), [1.0, 1.0, 0.2], False),  # "under a second": 1.0 is not under
    ],
)
def test_a_target_is_judged_on_the_median(target: Target, samples: list[float], met: bool) -> None:
    figure = Figure("x", "x", "u", samples, target)
    assert figure.met is met
    assert figure.to_dict()["met"] is met


def test_alternating_feeds_items_to_each_operation_in_turn() -> None:
    seen: dict[str, list[int]] = {"a": [], "b": []}
    seconds = alternating({"a": seen["a"].append, "b": seen["b"].append}, [0, 1, 2, 3, 4])

    assert seen == {"a": [0, 2, 4], "b": [1, 3]}
    assert set(seconds) == {"a", "b"} and all(s >= 0 for s in seconds.values())


@pytest.mark.parametrize(
    ("target", "value", "met", "text"),
    [
        (Target(3.0, at_least=False, inclusive=True), 3.0, True, "<= 3 requests/Job"),
        (Target(3.0, at_least=False), 3.0, False, "< 3 requests/Job"),
        (Target(0.8), 0.8, True, ">= 0.8 requests/Job"),
    ],
)
def test_a_target_states_its_comparison(target: Target, value: float, met: bool, text: str) -> None:
    assert target.met(value) is met
    assert target.text("requests/Job") == text


def test_a_ratio_reports_like_a_figure_and_targets_are_judged_only_when_the_run_says() -> None:
    ratio = Ratio("r", "ours / raw", [0.7, 0.9, 0.85], Target(0.8), ref="8.1")
    other = Figure("f", "other", "s", [1.0])
    result = BenchResult("b", "b", rounds=3, figures=[other], ratios=[ratio])

    judged = BenchRun(size="quick", judged=True, results=[result]).to_dict()
    smoke = BenchRun(size="smoke", judged=False, results=[result]).to_dict()

    assert judged["targets"] == [{"benchmark": "b", **ratio.to_dict()}]
    entry = judged["targets"][0]
    assert (entry["name"], entry["value"], entry["unit"], entry["target"], entry["met"]) == (
        "r", 0.85, "x", ">= 0.8x", True,
    )  # fmt: skip
    assert smoke["targets"][0]["met"] is None and smoke["targets"][0]["target"] == ">= 0.8x"
    assert judged["benchmarks"][0]["figures"][0]["target"] is None
