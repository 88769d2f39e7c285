"""`python -m k8s_dispatch.lab.bench --plot`: poll_cost's rows of a results file drawn as a PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k8s_dispatch.lab.bench.__main__ import main

ROWS = [
    {"mode": mode, "jobs": jobs, "job_s": job_s, "objects_per_job": cost}
    for mode, jobs, job_s, cost in [
        ("list", 1000, 60.0, 32.0), ("list", 1000, 600.0, 320.0), ("list", 300, 600.0, 310.0),
        ("watch", 1000, 60.0, 4.2), ("watch", 1000, 600.0, 5.1), ("watch", 300, 600.0, 5.0),
    ]
]  # fmt: skip


def test_plot_draws_the_poll_cost_rows_of_a_results_file(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"benchmarks": [{"name": "sweep"}, {"name": "poll_cost", "params": {"rows": ROWS}}]}))
    png = tmp_path / "cost.png"
    assert main(["--plot", "--results", str(results), "--png", str(png)]) == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_without_poll_cost_results_says_so(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"benchmarks": [{"name": "sweep"}]}))
    with pytest.raises(SystemExit, match="no poll_cost results"):
        main(["--plot", "--results", str(results), "--png", str(tmp_path / "x.png")])
    assert not (tmp_path / "x.png").exists()
