"""The API-load benchmark (issue 8, figures 2 and 3) at its smoke size: a few Jobs for a few
seconds against the real services. The figures must come out, and sane: requests counted by
the server for every Job that finished, the request types each pattern makes, and latencies
between zero and a few poll intervals. Not a timed assertion: the smoke size says nothing
about speed."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import api_load, services
from bench.results import BenchResult
from bench.sizes import SIZES

PG_ADMIN_URL = os.environ.get("K8S_DISPATCH_TEST_PG_ADMIN_URL", services.PG_ADMIN_URL)


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[BenchResult]:
    with services.redis_prefix(redis_url) as prefix:
        ctx = services.BenchContext(
            work_dir=Path(tmp_path_factory.mktemp("api-load")), pg_admin_url=PG_ADMIN_URL,
            redis_url=redis_url, key_prefix=prefix,
        )  # fmt: skip
        yield api_load.run(ctx, SIZES["smoke"])


def figure(result: BenchResult, name: str) -> float:
    return next(f.median for f in result.figures if f.name == name)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_requests_per_job_and_per_second_are_counted_for_both_patterns(result: BenchResult) -> None:
    for n in api_load.KNOBS["smoke"].jobs:
        for variant in ("ours", "baseline"):
            counted = result.params[f"{variant}_{n}"]
            assert counted["jobs_finished"] > 0, counted
            # at least the create of each finished Job's successor, and far fewer than a GET a second
            assert 1 <= figure(result, f"requests_per_job_{variant}_{n}") <= 20, counted
            assert figure(result, f"requests_per_s_{variant}_{n}") > 0
        ours, baseline = result.params[f"ours_{n}"]["requests_by_verb"], result.params[f"baseline_{n}"]["requests_by_verb"]
        assert any(key.startswith("LIST jobs ") for key in ours), ours  # poll: one LIST per page
        assert any(key.startswith("POST jobs 201") for key in ours), ours
        assert any(key.startswith("GET jobs ") for key in baseline), baseline  # a GET per Job
        ratio = next(r for r in result.ratios if r.name == f"baseline_vs_ours_requests_per_s_{n}")
        assert ratio.median > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_completion_latency_is_between_zero_and_a_few_poll_intervals(result: BenchResult) -> None:
    for n in api_load.KNOBS["smoke"].jobs:
        p50 = figure(result, f"completion_latency_p50_s_{n}")
        p99 = figure(result, f"completion_latency_p99_s_{n}")
        assert 0 < p50 <= p99 < 10 * api_load.POLL_INTERVAL_S, (p50, p99)


def test_the_first_jobs_run_times_are_spread_over_the_whole_job_length() -> None:
    steps = api_load.initial_steps(600)
    assert min(steps) == 0 and max(steps) == api_load.STEPS
    # evenly: each tenth of the run length holds a tenth of the Jobs, and so does each tenth of
    # the Jobs in creation order (created over a while, they still finish at an even rate)
    first_tenth = Counter(min(9, k * 10 // api_load.STEPS) for k in steps[:60])
    assert all(4 <= t <= 8 for t in first_tenth.values()) and len(first_tenth) == 10, first_tenth
    tenths = Counter(min(9, k * 10 // api_load.STEPS) for k in steps)
    assert sorted(tenths) == list(range(10))
    assert all(50 <= t <= 70 for t in tenths.values()), tenths


@pytest.mark.parametrize(
    ("requests", "finished", "per_job"),
    [
        # steady: 10 creates, 10 finished, 10 patches and 5 LIST pages: all requests / finished
        ({api_load.CREATED: 10, ("PATCH", "jobs", "", 200): 10, ("LIST", "jobs", "", 200): 5}, 10, 2.5),
        # behind on creates (2 of 10): the missing creates are still counted, one per Job
        ({api_load.CREATED: 2, ("PATCH", "jobs", "", 200): 10, ("LIST", "jobs", "", 200): 5}, 10, 2.5),
        # failed requests count too
        ({api_load.CREATED: 4, ("GET", "jobs", "", 200): 30, ("DELETE", "jobs", "", 404): 2}, 4, 9.0),
    ],
)
def test_requests_per_job_counts_one_create_per_job_and_every_other_request(
    requests: dict[api_load.Key, int], finished: int, per_job: float
) -> None:
    window = api_load.Window(
        seconds=10.0, requests=Counter(requests), finished={f"j{i}": 0.0 for i in range(finished)}, in_flight=(1, 1)
    )
    assert window.per_job == pytest.approx(per_job)


def test_task_times_reads_the_workers_latest_start() -> None:
    log = "\n".join([
        "--- start #1: celery worker",
        "[..] Task k8s-dispatch.poll[a] succeeded in 9.0s: {}",
        "--- start #2: celery worker",
        "[..] Task k8s-dispatch.poll[b] succeeded in 0.25s: {'seen': 3}",
        "[..] Task k8s-dispatch.poll[c] succeeded in 0.75s: {'seen': 3}",
        "[..] Task k8s-dispatch.create_job[d] succeeded in 0.1s: 'created'",
    ])  # fmt: skip
    assert api_load.task_times(log) == "create_job 1x p50 0.10s p99 0.10s, poll 2x p50 0.25s p99 0.75s"
