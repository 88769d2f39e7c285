"""Poll's hand-off in batches (pure): how a page's finished Jobs are cut into `complete_batch` messages."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from k8s_dispatch.tasks.jobs import HANDOFF_BATCH_MAX, HANDOFF_BATCH_MIN, batches


@pytest.mark.parametrize(
    ("count", "workers", "sizes"),
    [
        (0, 8, []),
        (1, 8, [1]),
        (9, 8, [9]),  # too few to share: one message, one Pod LIST, one bulk delete
        (11, 8, [6, 5]),
        (33, 8, [6, 6, 6, 5, 5, 5]),  # shared among the threads, none under HANDOFF_BATCH_MIN
        (80, 8, [10] * 8),
        (500, 8, [63] * 4 + [62] * 4),
        (1000, 2, [100] * 10),  # never more than one Pod selector's chunk
    ],
)
def test_batches(count: int, workers: int, sizes: list[int]) -> None:
    assert [len(b) for b in batches(list(range(count)), workers=workers)] == sizes


@given(st.integers(min_value=0, max_value=2_000), st.integers(min_value=1, max_value=64))
def test_batches_keep_every_item_in_order_within_the_bounds(count: int, workers: int) -> None:
    cut = batches(list(range(count)), workers=workers)
    assert [i for batch in cut for i in batch] == list(range(count))
    assert all(1 <= len(batch) <= HANDOFF_BATCH_MAX for batch in cut)
    assert max(map(len, cut), default=0) - min(map(len, cut), default=0) <= 1  # even: no crumbs
    assert all(len(batch) >= min(count, HANDOFF_BATCH_MIN) for batch in cut)
    assert len(cut) <= max(workers, -(-count // HANDOFF_BATCH_MAX))
