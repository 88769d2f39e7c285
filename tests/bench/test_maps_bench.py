"""lab/bench/maps.py at its smoke size, end to end against the real services: both variants run,
every figure is a positive number, the map is one Job at its peak where the singles are many,
and the bench's own requests (its watch of Pods, its LISTs of one Job) are not counted as ours.

Not a timed assertion: the machine is shared and the smoke size says nothing about speed.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from k8s_dispatch.lab.bench import maps, services
from k8s_dispatch.lab.bench.__main__ import main

PG_ADMIN_URL = os.environ.get("K8S_DISPATCH_TEST_PG_ADMIN_URL", services.PG_ADMIN_URL)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_maps_bench_compares_one_map_with_single_dispatches(tmp_path: Path, redis_url: str) -> None:
    results = tmp_path / "results.json"
    args = ["--smoke", "--only", "maps", "--cluster", "local", "--results", str(results),
            "--pg-admin-url", PG_ADMIN_URL, "--redis-url", redis_url]  # fmt: skip
    assert main(args) == 0
    data = json.loads(results.read_text())
    [bench] = data["benchmarks"]
    assert bench["name"] == "maps" and bench["params"]["items"] == maps.KNOBS["smoke"].items
    values = {f["name"]: f["value"] for f in bench["figures"] + bench["ratios"]}
    for variant in (maps.MAP, maps.SINGLES):
        for figure in ("requests_per_item", "objects_per_item", "peak_jobs", "last_recorded_s", "recorded_p99_s"):
            value = values[f"{figure}_{variant}"]
            assert math.isfinite(value) and value > 0, (figure, variant, value)
    assert values["peak_jobs_map"] == 1 and values["peak_jobs_singles"] > 1
    # each single dispatch creates its own Job; the map's items share one create
    assert values["requests_per_item_singles"] > values["requests_per_item_map"] >= 1
    targets = {t["name"] for t in data["targets"] if t["benchmark"] == "maps"}
    assert {"requests_per_item_map", "recorded_p99_s_map"} <= targets
    assert all(t["met"] is None for t in data["targets"])  # not judged at the smoke size
