"""lab/bench/sweep_scale.py at the smoke size, against the real services: figures 4 and 5 come out
with sane values, and the sweep lists its Jobs once, one LIST per page, with no LIST per dispatch.

Not a timed assertion: at this size on a shared machine the times say nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from k8s_dispatch.lab.bench import services, sweep_scale
from k8s_dispatch.lab.bench.sizes import SIZES

PG_ADMIN_URL = os.environ.get("K8S_DISPATCH_TEST_PG_ADMIN_URL", services.PG_ADMIN_URL)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_smoke_sweep_figures(tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    ctx = services.BenchContext(
        work_dir=tmp_path, pg_admin_url=PG_ADMIN_URL, redis_url=redis_url, key_prefix=key_prefix
    )

    result = sweep_scale.run(ctx, SIZES["smoke"])

    figures = {f.name: f for f in result.figures}
    small, big = sweep_scale.SMALL_JOBS["smoke"], sweep_scale.JOBS["smoke"]
    assert set(figures) == {
        "sweep_s", "client_list_s", "sweep_vs_list", "sweep_job_lists", "sweep_requests_per_action",
        f"sweep_peak_rss_{small}", f"sweep_peak_rss_{big}", "sweep_rss_growth",
    }  # fmt: skip
    memory = {f"sweep_peak_rss_{small}", f"sweep_peak_rss_{big}", "sweep_rss_growth"}
    for name, f in figures.items():
        rounds = result.params["memory_rounds"] if name in memory else result.rounds
        assert len(f.samples) == rounds and all(s > 0 for s in f.samples), name
    assert 0 < figures["sweep_s"].median < 120 and 0 < figures["client_list_s"].median < 120
    # One LIST per page of Jobs (here one page), none per dispatch.
    assert figures["sweep_job_lists"].samples == [float(result.params["job_lists_expected"])] * result.rounds
    assert result.params["list_pages"] == 1
    assert result.params["job_lists_expected"] == 2  # the page, and the one namespace's unlabelled Jobs
    # A completion and a re-creation take a few requests each, not one per listed Job.
    assert 1 <= figures["sweep_requests_per_action"].median <= 6
    for n in (small, big):
        assert 20 < figures[f"sweep_peak_rss_{n}"].median < 1000  # MB: a Python process, not a leak
    assert 0.5 < figures["sweep_rss_growth"].median < 2
    assert figures["sweep_vs_list"].target is not None and figures[f"sweep_peak_rss_{big}"].target is not None
