"""Table tests of the sweep's streaming match (`recovery.plan.NameOrder`, `named_dispatch_ids`):
how far a name-ordered LIST has got, and which dispatch ids a Job's labels point at."""

from __future__ import annotations

from typing import Any

import pytest

from k8s_dispatch.recovery.plan import NameOrder, named_dispatch_ids
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.manifest import job_name

A = "10000000-0000-4000-8000-000000000000"
B = "20000000-0000-4000-8000-000000000000"
C = "30000000-0000-4000-8000-000000000000"


@pytest.mark.parametrize(
    ("before", "names", "after"),
    [
        (NameOrder(), [], NameOrder()),
        (NameOrder(), [job_name(A), job_name(B)], NameOrder(last_name=job_name(B), last_id=B)),
        # The next page goes on from where the last one stopped.
        (NameOrder(job_name(A), A), [job_name(B), job_name(C)], NameOrder(job_name(C), C)),
        # Names that are not a dispatch's Job move the order on, not the last id.
        (NameOrder(job_name(A), A), [job_name(B), "zz-other"], NameOrder("zz-other", B)),
        (NameOrder(), ["aa-other"], NameOrder("aa-other", None)),
        (NameOrder(), ["kd-not-a-uuid"], NameOrder("kd-not-a-uuid", None)),
    ],
)
def test_order_advances_over_a_page(before: NameOrder, names: list[str], after: NameOrder) -> None:
    assert before.advance(names) == after


@pytest.mark.parametrize(
    ("before", "names"),
    [
        (NameOrder(), [job_name(B), job_name(A)]),  # out of order within a page
        (NameOrder(), [job_name(A), job_name(A)]),  # a name twice
        (NameOrder(job_name(B), B), [job_name(A)]),  # a listing that started again
        (NameOrder(job_name(B), B), [job_name(B)]),
    ],
)
def test_a_page_out_of_name_order_breaks_the_order(before: NameOrder, names: list[str]) -> None:
    assert before.advance(names) is None


def job(labels: dict[str, Any] | None, annotations: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": "x", "labels": labels, "annotations": annotations}}


KEY = job_labels.DISPATCH_ID_KEY


@pytest.mark.parametrize(
    ("job_dict", "ids"),
    [
        (job({KEY: A}), [A]),
        (job({KEY: "h-123"}, {KEY: A}), ["h-123", A]),  # a hashed label: its annotation too
        (job({KEY: A}, {KEY: A}), [A]),
        (job({KEY: 7}), []),  # not a string: nothing to look up
        (job(None), []),
        ({"metadata": "broken"}, []),
        ({}, []),
    ],
)
def test_named_dispatch_ids(job_dict: dict[str, Any], ids: list[str]) -> None:
    assert named_dispatch_ids(job_dict) == ids
