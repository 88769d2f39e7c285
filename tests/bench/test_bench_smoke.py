"""The bench at its "smoke" size, end to end: every benchmark runs against the real services and
the JSON it writes has the documented shape, with every figure and ratio a positive number.

Not a timed assertion: the machine is shared, and the smoke sizes say nothing about speed
(targets are carried but not judged at this size).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

from k8s_dispatch.lab.bench import services
from k8s_dispatch.lab.bench.__main__ import BENCHMARKS, main

PG_ADMIN_URL = os.environ.get("K8S_DISPATCH_TEST_PG_ADMIN_URL", services.PG_ADMIN_URL)


def positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


# Figures that may be 0 at the smoke size: a poll's kept watch stream sends no request in a short
# window (the stream opened before it is read on), so "requests finding finished Jobs" can be none.
MAY_BE_ZERO = ("api_load/finding_requests_per_s_ours_",)


def non_negative(value: Any) -> bool:
    return positive(value) or (isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0)


def check_entry(entry: dict[str, Any], *, where: str) -> None:
    samples = entry["samples"]
    assert entry["label"] and entry["unit"], where
    ok = non_negative if where.startswith(MAY_BE_ZERO) else positive
    assert samples and all(ok(s) for s in samples), f"{where}: samples {samples}"
    for key in ("value", "median", "min", "max"):
        assert ok(entry[key]), f"{where}: {key} = {entry[key]!r}"
    assert entry["value"] == entry["median"], where
    assert entry["min"] <= entry["median"] <= entry["max"], where
    assert entry["min"] == min(samples) and entry["max"] == max(samples), where
    # Targets are stated at every size, judged at quick and full only.
    assert entry["target"] is None or isinstance(entry["target"], str), where
    assert entry["met"] is None, where


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_smoke_bench_writes_every_figure_as_a_positive_number(tmp_path: Path, redis_url: str) -> None:
    results = tmp_path / "results.json"
    json_out = tmp_path / "out" / "bench.json"

    code = main(
        [
            "--smoke",
            "--results",
            str(results),
            "--json-out",
            str(json_out),
            "--pg-admin-url",
            PG_ADMIN_URL,
            "--redis-url",
            redis_url,
        ]
    )

    assert code == 0
    data = json.loads(json_out.read_text())
    assert json.loads(results.read_text()) == data
    assert data["version"] == 2
    assert data["size"] == "smoke" and data["targets_judged"] is False
    assert positive(data["seconds"])
    assert data["machine"]["cpus"] >= 1 and data["machine"]["python"]
    assert data["settings"]["size"]["name"] == "smoke"
    assert [b["name"] for b in data["benchmarks"]] == list(BENCHMARKS)
    assert set(data["settings"]["params"]) == set(BENCHMARKS)
    for bench in data["benchmarks"]:
        name = bench["name"]
        assert bench["title"] and positive(bench["seconds"]), name
        assert bench["figures"], f"{name} reports no figure"
        entries = bench["figures"] + bench["ratios"]
        for entry in entries:
            check_entry(entry, where=f"{name}/{entry['name']}")
        names = [e["name"] for e in entries]
        assert len(names) == len(set(names)), f"{name}: duplicate figure names {names}"
    targeted = {(t["benchmark"], t["name"]) for t in data["targets"]}
    assert ("dispatch", "dispatch_throughput_ratio") in targeted
    for target in data["targets"]:
        assert target["target"] and target["met"] is None, target
