"""lab/bench/artifacts.py at its smoke size, end to end against the real services (its own
SeaweedFS, PostgreSQL, Redis, exec-mode localcluster, worker and beat): every round delivered a
result of the size asked and read back, the figures are positive, the ratio carries issue 28's
target, and an object store configured with `archiveLogs: onFailure` costs succeeding Jobs no
request to it.

Not a timed assertion: the machine is shared and the smoke size says nothing about speed.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from k8s_dispatch.lab.bench import artifacts, services
from k8s_dispatch.lab.bench.__main__ import main

PG_ADMIN_URL = os.environ.get("K8S_DISPATCH_TEST_PG_ADMIN_URL", services.PG_ADMIN_URL)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_artifacts_bench_delivers_its_rounds_and_counts_the_store(tmp_path: Path, redis_url: str) -> None:
    results = tmp_path / "results.json"
    args = ["--smoke", "--only", "artifacts", "--cluster", "local", "--results", str(results),
            "--pg-admin-url", PG_ADMIN_URL, "--redis-url", redis_url]  # fmt: skip
    assert main(args) == 0
    data = json.loads(results.read_text())
    [bench] = data["benchmarks"]
    knobs = artifacts.KNOBS["smoke"]
    assert bench["name"] == "artifacts" and bench["params"]["result_mib"] == knobs.result_mib
    measured = {m["name"]: m for m in bench["figures"] + bench["ratios"]}
    for name in ("result_schedule_to_terminal_s", "raw_put_get_s", "result_vs_raw_throughput"):
        samples = measured[name]["samples"]
        assert len(samples) == knobs.rounds and all(math.isfinite(s) and s > 0 for s in samples), (name, samples)
    assert measured["result_vs_raw_throughput"]["target"] == ">= 0.8x"
    # Where each round's time went: every phase measured, and together exactly the dispatch's time.
    phases = [measured[f"phase_{name}_s"]["samples"] for name in artifacts.PHASES]
    for samples in phases:
        assert len(samples) == knobs.rounds and all(math.isfinite(s) and s >= 0 for s in samples), samples
    for i, took in enumerate(measured["result_schedule_to_terminal_s"]["samples"]):
        assert math.isclose(sum(p[i] for p in phases), took, abs_tol=1e-6)
    assert measured["transfer_vs_raw_throughput"]["target"] is None
    assert bench["params"]["object_store_requests_per_job"] == 0  # onFailure: a success archives nothing
    [jobs] = knobs.load.jobs
    kubernetes = measured[f"requests_per_job_kubernetes_{jobs}"]
    assert kubernetes["value"] >= 1 and kubernetes["target"] is None  # stated at 1,000 Jobs only, as api_load's
    assert all(t["met"] is None for t in data["targets"])  # not judged at the smoke size


def test_a_rounds_phases_come_from_its_marks_and_the_batch_received_last_before_its_event() -> None:
    marks = [{"process": 10.5, "upload": 10.75, "uploaded": 14.0, "exit": 14.0}]
    # 13.0 before the upload ended (another Job's), 16.5 after the event: neither is this round's.
    phases = artifacts.phases_of([(10.0, 16.25)], marks, received=[13.0, 15.0, 15.5, 16.5])
    assert phases == {
        "to_runner": [0.5], "runner_start": [0.25], "runner_upload": [3.25], "to_complete": [1.5], "complete": [0.75]
    }  # fmt: skip
    [missing] = artifacts.phases_of([(10.0, 16.25)], marks, received=[])["to_complete"]
    assert math.isnan(missing)
