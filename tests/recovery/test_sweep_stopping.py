"""Table tests of the sweep's database-side decisions (pure): what becomes of the Job of a
dispatch ended FAILED or CANCELLED (`stop_step`), and of a dispatch whose Job was edited by
hand (`tamper_step`, `hidden`)."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest
from test_sweep import COMPLETED, CREATED, FAILED, GRACE, NOW, REF, dispatch, job

from k8s_dispatch.recovery.plan import StopStep, TamperStep, hidden, owner_by_name, stop_step, tamper_step
from k8s_dispatch.store.models import DispatchState
from k8s_dispatch.workers import labels as job_labels

CANCELLED = DispatchState.CANCELLED
DEPLOYMENT = "prod"
TAMPER_GRACE = timedelta(seconds=300)


def ended(state: DispatchState = CANCELLED, *, finished_ago_s: float = 60.0, job_recorded: bool = True):
    view = dispatch(state)
    return replace(
        view,
        finished_at=NOW - timedelta(seconds=finished_ago_s),
        job_created_at=NOW - timedelta(seconds=120) if job_recorded else None,
    )


# (id, view, job, expected)
STOP_CASES = [
    ("cancelled, its job still running -> stop it (the lost cancel)", ended(), job(), StopStep.STOP),
    ("failed, its job running (a delete that met a 5xx) -> stop it", ended(FAILED), job(), StopStep.STOP),
    ("job finished and released -> stopped", ended(FAILED), job(condition="Failed", finalizer=False), StopStep.MARK),
    ("job finished, still holding our finalizer (its release comes after the end) -> stopped",
     ended(FAILED), job(condition="Failed"), StopStep.MARK),
    ("job being deleted before it finished, held by our finalizer -> stop (release it)",
     ended(), job(deleting=True), StopStep.STOP),
    ("job being deleted, finished -> stopped", ended(), job(condition="Complete", deleting=True), StopStep.MARK),
    ("interim condition only counts as finished", ended(), job(condition="FailureTarget"), StopStep.MARK),
    ("no job, one was recorded -> stopped", ended(finished_ago_s=1), None, StopStep.MARK),
    ("no job, none recorded, ended inside the grace -> wait (a create may be under way)",
     ended(finished_ago_s=1, job_recorded=False), None, StopStep.WAIT),
    ("no job, none recorded, ended past the grace -> stopped",
     ended(finished_ago_s=GRACE.total_seconds(), job_recorded=False), None, StopStep.MARK),
]  # fmt: skip


@pytest.mark.parametrize(("view", "the_job", "expected"), [pytest.param(*c[1:], id=c[0]) for c in STOP_CASES])
def test_stop_step(view, the_job, expected: StopStep) -> None:
    assert stop_step(view, the_job, now=NOW, grace=GRACE) is expected


def noted(ago_s: float | None):
    view = dispatch(CREATED)
    return replace(view, job_tampered_at=None if ago_s is None else NOW - timedelta(seconds=ago_s))


RUNNING, FINISHED = job(), job(condition="Complete")

# (id, view, job, refused, hidden, expected)
TAMPER_CASES = [
    ("refused, first seen now -> wait for the grace", noted(None), FINISHED, True, False, TamperStep.WAIT),
    ("refused, inside the grace -> wait", noted(299), FINISHED, True, False, TamperStep.WAIT),
    ("refused, the grace over -> fail JobTampered", noted(300), FINISHED, True, False, TamperStep.FAIL),
    ("refused and running, the grace over -> fail (its result is never trusted)",
     noted(301), RUNNING, True, True, TamperStep.FAIL),
    ("only hidden (delivered=true), finished -> deliver it", noted(None), FINISHED, False, True, TamperStep.DELIVER),
    ("only hidden, long past the grace, finished -> deliver it", noted(3600), FINISHED, False, True,
     TamperStep.DELIVER),
    ("only hidden, running -> it is ours: wait for it, by name", noted(3600), RUNNING, False, True, TamperStep.RUNS),
    ("put right by hand -> forget the note", noted(100), FINISHED, False, False, TamperStep.FORGET),
    ("noted, no job any more (removed by the delete policy, or since) -> missing: run it again from the row",
     noted(100), None, False, False, TamperStep.MISSING),
    ("never noted and no job -> forget (category 5 re-creates or fails it)", noted(None), None, False, False,
     TamperStep.FORGET),
    ("refused, the delete policy -> removed at once", noted(None), RUNNING, True, False, TamperStep.DELETE),
    ("ended meanwhile, its job refused -> clean it up", replace(noted(100), record=replace(
        noted(100).record, state=COMPLETED)), FINISHED, True, False, TamperStep.CLEAN),
    ("ended meanwhile, its job only hidden (no LIST of ours finds it) -> clean it up", replace(noted(100),
        record=replace(noted(100).record, state=COMPLETED)), FINISHED, False, True, TamperStep.CLEAN),
]  # fmt: skip


@pytest.mark.parametrize(
    ("view", "the_job", "refused", "is_hidden", "expected"), [pytest.param(*c[1:], id=c[0]) for c in TAMPER_CASES]
)
def test_tamper_step(view, the_job, refused: bool, is_hidden: bool, expected: TamperStep) -> None:
    delete = expected is TamperStep.DELETE
    step = tamper_step(view, the_job, refused=refused, hidden=is_hidden, now=NOW, grace=TAMPER_GRACE, delete=delete)
    assert step is expected


def test_zero_grace_fails_at_the_first_finding_once_noted() -> None:
    assert tamper_step(noted(0), FINISHED, refused=True, hidden=False, now=NOW, grace=timedelta(0)) is TamperStep.FAIL


@pytest.mark.parametrize(
    ("labels", "expected"),
    [
        ({job_labels.DEPLOYMENT_LABEL: DEPLOYMENT}, False),
        ({job_labels.DEPLOYMENT_LABEL: DEPLOYMENT, job_labels.DELIVERED_LABEL: "true"}, True),
        ({job_labels.DEPLOYMENT_LABEL: "someone-else"}, True),
        ({}, True),  # no deployment label at all (the fixture's Jobs carry none)
    ],
)
def test_hidden(labels: dict[str, str], expected: bool) -> None:
    the_job = job(labels=labels)
    if not labels:
        the_job["metadata"]["labels"].pop(job_labels.DEPLOYMENT_LABEL, None)
    assert hidden(the_job, DEPLOYMENT) is expected


def test_owner_by_name_is_the_databases_word_not_the_labels() -> None:
    view = dispatch(CREATED)
    rows = {view.dispatch_id: view}
    assert owner_by_name(job(replace(REF, tenancy_id="x")), rows) is view  # type: ignore[arg-type]
    assert owner_by_name(job(namespace="elsewhere"), rows) is None  # a copy, not its Job
    assert owner_by_name(job(name="kd-copy"), rows) is None
    assert owner_by_name(job(), {}) is None
