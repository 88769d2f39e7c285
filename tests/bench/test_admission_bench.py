"""lab/bench/admission.py at the smoke size (200 vs 2,000 queued behind a full limit), against real
PostgreSQL and localcluster: its figures have the documented shape, a pass's SQL statements and
the buffers it touches do not grow with what waits, and the only API requests are the Jobs'
creates (the bench itself raises if a pass or a schedule sends one, or if the server counted
anything else).

Not a timed assertion: at this size on a shared machine the times say nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from k8s_dispatch.lab.bench import admission, services
from k8s_dispatch.lab.bench.sizes import SIZES

PG_ADMIN_URL = os.environ.get("K8S_DISPATCH_TEST_PG_ADMIN_URL", services.PG_ADMIN_URL)
QUEUE_READS = (
    "SELECT dispatches.tenancy_id, dispatches.capability FROM",
    "SELECT dispatches.dispatch_id, dispatches.priority,",
)
KINDS = ("fresh_ms", "freed_ms", "idle_ms", "other_ms", "other_pass_ms", "freed_path_ms")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_smoke_admission_figures(tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    ctx = services.BenchContext(
        work_dir=tmp_path, pg_admin_url=PG_ADMIN_URL, redis_url=redis_url, key_prefix=key_prefix
    )
    size = SIZES["smoke"]
    small, big = size.admission_queued
    assert (small, big) == (200, 2_000)

    result = admission.run(ctx, size)

    figures = {f.name: f for f in result.figures}
    ratios = {r.name: r for r in result.ratios}
    passes, paths = result.params["passes"], result.params["paths"]
    expected = {"admission_requests_per_job"}
    for n in (small, big):
        expected |= {f"admission_{kind}_{p}_{n}" for kind in KINDS for p in ("p50", "p99")}
        expected |= {f"admission_freed_statements_{n}", f"admission_idle_statements_{n}", f"admission_buffers_{n}"}
        expected |= {f"admission_fresh_statements_{n}", f"admission_buffers_fresh_{n}"}
    assert set(figures) == expected
    for n in (small, big):
        for kind in KINDS:
            p50, p99 = figures[f"admission_{kind}_p50_{n}"], figures[f"admission_{kind}_p99_{n}"]
            steps = paths if kind in ("other_ms", "other_pass_ms", "freed_path_ms") else passes
            steps = result.params["fresh_passes"] if kind == "fresh_ms" else steps
            assert len(p50.samples) == steps and all(0 < s < 10_000 for s in p50.samples), (kind, n)
            assert p99.samples == [admission.percentile(p50.samples, 99)] and p50.median <= p99.median
        # The path contains its pass.
        assert figures[f"admission_other_ms_p50_{n}"].median > figures[f"admission_other_pass_ms_p50_{n}"].median
    # O(freed slots), not O(queued): a pass sends the same statements with 10x as many waiting,
    # pass after pass (the probes of the queue index, the count, one head read, one update).
    freed = {n: figures[f"admission_freed_statements_{n}"].samples for n in (small, big)}
    idle = {n: figures[f"admission_idle_statements_{n}"].samples for n in (small, big)}
    assert len(set(freed[small])) == 1 and freed[big] == freed[small], freed
    assert len(set(idle[small])) == 1 and idle[big] == idle[small], idle
    for n in (small, big):  # the same statements before the table's statistics exist
        assert figures[f"admission_fresh_statements_{n}"].samples == [freed[small][0]] * result.params["fresh_passes"]
    assert idle[small][0] < freed[small][0] <= 10  # no slot free: no queue head read, no update
    assert ratios["admission_statements_ratio"].samples == [1.0] * result.rounds
    # What the database read: the same index pages, give or take a level of the B-tree.
    assert ratios["admission_buffers_ratio"].median < 2, result.params["plans"]
    for n in (small, big):
        plans = result.params["plans"][str(n)]
        assert len(plans) == freed[n][0]
        # The queue's reads (which queues have work, a queue's head) go through its index.
        queue_reads = [line for line in plans if line.split(" | ")[1].startswith(QUEUE_READS)]
        assert len(queue_reads) == freed[n][0] - 4  # less the turn, the two counts (before it and under it), the update
        assert all("ix_dispatches_queued" in line.split(" | ")[0] for line in queue_reads), queue_reads
    # Every Job created cost the server one request (its create); admission and schedule none.
    assert figures["admission_requests_per_job"].samples == [1.0]
    assert {"admission_pass_ratio", "admission_other_path_ratio", "admission_idle_ratio"} <= set(ratios)
    assert all(
        len(r.samples) == result.rounds and all(s > 0 for s in r.samples)
        for r in ratios.values()
        if "buffers" not in r.name
    )
