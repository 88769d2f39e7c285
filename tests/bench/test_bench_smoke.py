"""The bench at its "quick" size, end to end: every benchmark runs against the real services and
the JSON it writes has the documented shape, with every figure and ratio a positive number.

Not a timed assertion: the machine is shared, and the quick sizes say nothing about speed.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

from bench import services
from bench.__main__ import BENCHMARKS, main

PG_ADMIN_URL = os.environ.get("K8S_DISPATCH_TEST_PG_ADMIN_URL", services.PG_ADMIN_URL)


def positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def check_samples(entry: dict[str, Any], *, where: str) -> None:
    samples = entry["samples"]
    assert samples and all(positive(s) for s in samples), f"{where}: samples {samples}"
    for key in ("median", "min", "max"):
        assert positive(entry[key]), f"{where}: {key} = {entry[key]!r}"
    assert entry["min"] <= entry["median"] <= entry["max"], where
    assert entry["min"] == min(samples) and entry["max"] == max(samples), where


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_bench_writes_every_figure_as_a_positive_number(tmp_path: Path, redis_url: str) -> None:
    json_out = tmp_path / "out" / "bench.json"
    results_dir = tmp_path / "results"

    code = main(
        [
            "--quick",
            "--json-out", str(json_out),
            "--results-dir", str(results_dir),
            "--pg-admin-url", PG_ADMIN_URL,
            "--redis-url", redis_url,
        ]  # fmt: skip
    )

    assert code == 0
    data = json.loads(json_out.read_text())
    assert json.loads((results_dir / "latest-quick.json").read_text()) == data
    assert not (results_dir / "latest.json").exists(), "a quick run must not replace the full results"
    assert data["version"] == 1
    assert data["size"] == "quick"
    assert positive(data["seconds"])
    assert data["machine"]["cpus"] >= 1
    assert [b["name"] for b in data["benchmarks"]] == list(BENCHMARKS)
    for bench in data["benchmarks"]:
        name = bench["name"]
        assert bench["title"] and positive(bench["seconds"]), name
        assert bench["figures"], f"{name} reports no figure"
        assert bench["ratios"], f"{name} reports no ratio"
        for figure in bench["figures"]:
            where = f"{name}/{figure['name']}"
            assert figure["label"] and figure["unit"], where
            check_samples(figure, where=where)
            # Targets are judged at the full size only.
            assert figure["target"] is None and figure["met"] is None, where
        for ratio in bench["ratios"]:
            where = f"{name}/{ratio['name']}"
            assert ratio["label"], where
            check_samples(ratio, where=where)
        names = [f["name"] for f in bench["figures"]] + [r["name"] for r in bench["ratios"]]
        assert len(names) == len(set(names)), f"{name}: duplicate figure names {names}"

