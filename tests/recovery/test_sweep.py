"""Table tests of the sweep's pure decisions (`recovery.plan.plan`): every category and edge."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from k8s_dispatch.core.settings import OrphanPolicy, load_settings
from k8s_dispatch.delivery.reconstruct import DispatchRecord
from k8s_dispatch.recovery.plan import (
    Category,
    CleanUpJob,
    CompleteJob,
    CreateJob,
    DispatchView,
    FailJobLost,
    FreePod,
    Policy,
    RecreateJob,
    ReportOrphan,
    ReportRunning,
    TamperedJob,
    by_category,
    plan,
    plan_dispatches,
    plan_held,
    plan_jobs,
    plan_pods,
    present_jobs,
)
from k8s_dispatch.store.models import DispatchState
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.manifest import FINALIZER, job_name
from k8s_dispatch.workers.types import DispatchRef

NOW = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)
GRACE = timedelta(seconds=30)
POLICY = Policy(grace=GRACE, max_job_attempts=3, orphan_policy=OrphanPolicy.REPORT)
DELETE_POLICY = replace(POLICY, orphan_policy=OrphanPolicy.DELETE)
OLD = NOW - GRACE - timedelta(seconds=1)
YOUNG = NOW - GRACE + timedelta(seconds=1)

DID = "3f2b8a4e-0000-4000-8000-000000000001"
NAME = job_name(DID)
NS = "work"
REF = DispatchRef(
    dispatch_id=DID,  # type: ignore[arg-type]
    case_id="case-1",  # type: ignore[arg-type]
    tenancy_id="tenant-a",  # type: ignore[arg-type]
    capability="resize",  # type: ignore[arg-type]
    worker_name="imaging",  # type: ignore[arg-type]
    idempotency_key="key-1",  # type: ignore[arg-type]
)
WHERE = dict(dispatch_id=DID, namespace=NS, job_name=NAME)
OTHER = "3f2b8a4e-0000-4000-8000-000000000002"


def ref_for(dispatch_id: str) -> DispatchRef:
    return replace(REF, dispatch_id=dispatch_id)  # type: ignore[arg-type]


def dispatch(
    state: DispatchState = DispatchState.CREATED,
    *,
    ref: DispatchRef = REF,
    created_at: datetime = OLD,
    updated_at: datetime = OLD,
    attempts: int = 0,
) -> DispatchView:
    recorded = state is not DispatchState.SCHEDULED
    record = DispatchRecord(
        dispatch_id=ref.dispatch_id,
        case_id=ref.case_id,
        tenancy_id=ref.tenancy_id,
        capability=ref.capability,
        worker_name=ref.worker_name,
        idempotency_key=ref.idempotency_key,
        state=state,
        input={"n": 1},
        job_name=job_name(ref.dispatch_id) if recorded else None,
        job_namespace=NS if recorded else None,
        attempts=attempts,
    )
    return DispatchView(record=record, namespace=NS, created_at=created_at, updated_at=updated_at)


def job(
    ref: DispatchRef = REF,
    *,
    condition: str | None = None,
    finalizer: bool = True,
    deleting: bool = False,
    namespace: str = NS,
    name: str | None = None,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A Job as the API lists it: our labels, our finalizer, a condition when it finished."""
    our_labels, our_annotations = job_labels.encode(ref)
    metadata: dict[str, Any] = {
        "name": name or job_name(ref.dispatch_id),
        "namespace": namespace,
        "uid": "uid-" + ref.dispatch_id,
        "labels": {**our_labels, **(labels or {})},
        "annotations": {**our_annotations, **(annotations or {})},
        "finalizers": [FINALIZER] if finalizer else ["example.com/other"],
    }
    if deleting:
        metadata["deletionTimestamp"] = "2025-01-01T11:00:00Z"
    status: dict[str, Any] = {}
    if condition is not None:
        status["conditions"] = [{"type": condition, "status": "True", "reason": "BackoffLimitExceeded"}]
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "status": status}


def orphan(
    reason: str, *, delete: bool = False, namespace: str = NS, name: str = NAME, dispatch_id: str | None = DID
) -> ReportOrphan:
    return ReportOrphan(namespace=namespace, job_name=name, dispatch_id=dispatch_id, reason=reason, delete=delete)


SCHEDULED, CREATED = DispatchState.SCHEDULED, DispatchState.CREATED
COMPLETED, FAILED, CANCELLED = DispatchState.COMPLETED, DispatchState.FAILED, DispatchState.CANCELLED

# (id, dispatches, jobs, policy, expected actions)
CASES = [
    # --- 1: scheduled without a Job ---
    ("1 scheduled, no job, past grace -> create",
     [dispatch(SCHEDULED)], [], POLICY, [CreateJob(**WHERE)]),
    ("1 scheduled, no job, inside grace -> wait",
     [dispatch(SCHEDULED, created_at=YOUNG, updated_at=YOUNG)], [], POLICY, []),
    ("1 scheduled exactly at the grace period -> create",
     [dispatch(SCHEDULED, created_at=NOW - GRACE, updated_at=NOW - GRACE)], [], POLICY, [CreateJob(**WHERE)]),
    ("1 zero grace creates at once",
     [dispatch(SCHEDULED, created_at=NOW, updated_at=NOW)], [], replace(POLICY, grace=timedelta(0)),
     [CreateJob(**WHERE)]),
    ("1 grace counts from the row's last change",
     [dispatch(SCHEDULED, created_at=OLD, updated_at=YOUNG)], [], POLICY, []),
    ("1 scheduled, its job exists (crash before mark_created) -> running, adopt",
     [dispatch(SCHEDULED)], [job()], POLICY, [ReportRunning(**WHERE, adopt=True)]),
    ("1 scheduled, a job of its only in another namespace -> a copy; ours is created",
     [dispatch(SCHEDULED)], [job(namespace="elsewhere")], POLICY,
     [orphan("LabelMismatch", namespace="elsewhere"), CreateJob(**WHERE)]),
    # --- 2: finished Job without a terminal event ---
    ("2 succeeded job, created dispatch -> complete",
     [dispatch()], [job(condition="Complete")], POLICY, [CompleteJob(**WHERE)]),
    ("2 failed job -> complete (the failure is the result)",
     [dispatch()], [job(condition="Failed")], POLICY, [CompleteJob(**WHERE)]),
    ("2 finished job, dispatch never marked created -> complete",
     [dispatch(SCHEDULED)], [job(condition="Complete")], POLICY, [CompleteJob(**WHERE)]),
    ("2 a finished job needs no grace period",
     [dispatch(created_at=NOW, updated_at=NOW)], [job(condition="Complete")], POLICY, [CompleteJob(**WHERE)]),
    ("2 finished job being deleted still delivers (our finalizer kept the result)",
     [dispatch()], [job(condition="Complete", deleting=True)], POLICY, [CompleteJob(**WHERE)]),
    ("2 running job deleted by someone (deletionTimestamp) -> complete as JobDeleted",
     [dispatch()], [job(deleting=True)], POLICY, [CompleteJob(**WHERE)]),
    # --- 3: running ---
    ("3 running job -> report",
     [dispatch()], [job()], POLICY, [ReportRunning(**WHERE)]),
    ("3 interim condition only (not final) still counts as finished",
     [dispatch()], [job(condition="SuccessCriteriaMet")], POLICY, [CompleteJob(**WHERE)]),
    ("3 running job of a young dispatch -> report",
     [dispatch(created_at=NOW, updated_at=NOW)], [job()], POLICY, [ReportRunning(**WHERE)]),
    # --- 4: terminal recorded, Job still there ---
    ("4 completed dispatch, finished job with our finalizer -> clean up",
     [dispatch(COMPLETED)], [job(condition="Complete")], POLICY, [CleanUpJob(**WHERE)]),
    ("4 failed dispatch, job without our finalizer but not deleted -> clean up (delete it)",
     [dispatch(FAILED)], [job(condition="Failed", finalizer=False)], POLICY, [CleanUpJob(**WHERE)]),
    ("4 terminal dispatch, job deleting with our finalizer -> clean up (remove it)",
     [dispatch(COMPLETED)], [job(condition="Complete", deleting=True)], POLICY, [CleanUpJob(**WHERE)]),
    ("4 terminal dispatch, job deleting without our finalizer -> clean up (idempotent no-op)",
     [dispatch(COMPLETED)], [job(condition="Complete", finalizer=False, deleting=True)], POLICY,
     [CleanUpJob(**WHERE)]),
    ("4 dispatch cancelled while its job runs -> clean up, never complete",
     [dispatch(CANCELLED)], [job()], POLICY, [CleanUpJob(**WHERE)]),
    ("4 dispatch cancelled, its job finished afterwards -> clean up, never complete",
     [dispatch(CANCELLED)], [job(condition="Complete")], POLICY, [CleanUpJob(**WHERE)]),
    ("4 terminal dispatch without a job -> nothing",
     [dispatch(COMPLETED)], [], POLICY, []),
    # --- 5: created, Job gone ---
    ("5 created, first job gone -> recreate",
     [dispatch(attempts=0)], [], POLICY, [RecreateJob(**WHERE, attempts=0)]),
    ("5 created, second job gone, one attempt left -> recreate",
     [dispatch(attempts=1)], [], POLICY, [RecreateJob(**WHERE, attempts=1)]),
    ("5 created, third job gone, attempts used up -> WORKER_FAILED JobLost",
     [dispatch(attempts=2)], [], POLICY, [FailJobLost(**WHERE, attempts=2)]),
    ("5 attempts past the limit (the limit was lowered) -> JobLost",
     [dispatch(attempts=7)], [], POLICY, [FailJobLost(**WHERE, attempts=7)]),
    ("5 max_job_attempts=1 -> the first loss is final",
     [dispatch(attempts=0)], [], replace(POLICY, max_job_attempts=1), [FailJobLost(**WHERE, attempts=0)]),
    ("5 created, job gone, updated inside the grace period -> wait",
     [dispatch(updated_at=YOUNG)], [], POLICY, []),
    ("5 created dispatch's job only under another name -> the copy reported, ours recreated",
     [dispatch()], [job(name="kd-copy")], POLICY,
     [orphan("LabelMismatch", name="kd-copy"), RecreateJob(**WHERE, attempts=0)]),
    # --- 6: orphans and mismatches ---
    ("6 forged job, no dispatch, report policy",
     [], [job(condition="Complete")], POLICY, [orphan("UnknownDispatch")]),
    ("6 forged job, no dispatch, delete policy",
     [], [job(condition="Complete")], DELETE_POLICY, [orphan("UnknownDispatch", delete=True)]),
    ("6 delete policy, forged job already deleting without our finalizer -> only reported",
     [], [job(finalizer=False, deleting=True)], DELETE_POLICY, [orphan("UnknownDispatch")]),
    ("6 delete policy, forged job deleting held by our finalizer -> deleted (finalizer removed)",
     [], [job(deleting=True)], DELETE_POLICY, [orphan("UnknownDispatch", delete=True)]),
    ("6 managed-by label only, nothing else readable",
     [], [{"metadata": {"name": "x", "namespace": NS,
                                  "labels": {job_labels.MANAGED_BY_LABEL: job_labels.MANAGED_BY}}}], POLICY,
     [orphan("LabelMismatch", name="x", dispatch_id=None)]),
    # --- 8: the dispatch's own Job (its name, its namespace), hand-edited: never completed ---
    ("8 label and annotation disagree",
     [dispatch()], [job(condition="Complete", annotations={job_labels.CASE_ID_KEY: "case-9"})], POLICY,
     [TamperedJob(**WHERE)]),
    ("8 tenancy mismatch: a finished job is never completed",
     [dispatch()], [job(replace(REF, tenancy_id="tenant-b"), condition="Complete")], POLICY,  # type: ignore[arg-type]
     [TamperedJob(**WHERE)]),
    ("8 tenancy differing only in letter case is a mismatch",
     [dispatch()], [job(replace(REF, tenancy_id="Tenant-A"), condition="Complete")], POLICY,  # type: ignore[arg-type]
     [TamperedJob(**WHERE)]),
    ("8 case id mismatch",
     [dispatch()], [job(replace(REF, case_id="case-2"), condition="Complete")], POLICY,  # type: ignore[arg-type]
     [TamperedJob(**WHERE)]),
    ("8 case id differing only in letter case is a mismatch",
     [dispatch()], [job(replace(REF, case_id="CASE-1"), condition="Complete")], POLICY,  # type: ignore[arg-type]
     [TamperedJob(**WHERE)]),
    ("8 capability mismatch",
     [dispatch()], [job(replace(REF, capability="other"), condition="Complete")], POLICY,  # type: ignore[arg-type]
     [TamperedJob(**WHERE)]),
    ("8 worker mismatch",
     [dispatch()], [job(replace(REF, worker_name="other"), condition="Complete")], POLICY,  # type: ignore[arg-type]
     [TamperedJob(**WHERE)]),
    ("8 idempotency key mismatch",
     [dispatch()], [job(replace(REF, idempotency_key="key-2"), condition="Complete")], POLICY,  # type: ignore[arg-type]
     [TamperedJob(**WHERE)]),
    ("8 malformed attempt annotation",
     [dispatch()], [job(condition="Complete", annotations={job_labels.ATTEMPT_KEY: "one"})], POLICY,
     [TamperedJob(**WHERE)]),
    ("8 dispatch-id label naming another dispatch: still the one its name says",
     [dispatch(), dispatch(ref=ref_for(OTHER))], [job(ref_for(OTHER), name=NAME, condition="Complete")], POLICY,
     [TamperedJob(**WHERE), RecreateJob(dispatch_id=OTHER, namespace=NS, job_name=job_name(OTHER), attempts=0)]),
    ("8 mismatched job of a terminal dispatch: its own, removed whatever the orphan policy",
     [dispatch(COMPLETED)], [job(replace(REF, tenancy_id="tenant-b"), condition="Complete")],  # type: ignore[arg-type]
     POLICY, [TamperedJob(**WHERE)]),
    ("8 a mismatched job under our name counts as present: nothing is created over it",
     [dispatch()], [job(replace(REF, tenancy_id="tenant-b"))], POLICY,  # type: ignore[arg-type]
     [TamperedJob(**WHERE)]),
    ("6 a mismatched job under a name of no dispatch is an orphan",
     [], [job(replace(REF, tenancy_id="tenant-b"))], POLICY,  # type: ignore[arg-type]
     [orphan("UnknownDispatch")]),
    ("6 copy in another namespace of a created dispatch's job -> orphan; the real one completes",
     [dispatch()], [job(condition="Complete"), job(condition="Complete", namespace="elsewhere")], POLICY,
     [CompleteJob(**WHERE), orphan("LabelMismatch", namespace="elsewhere")]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("dispatches", "jobs", "policy", "expected"),
    [pytest.param(*case[1:], id=case[0]) for case in CASES],
)
def test_plan(
    dispatches: list[DispatchView], jobs: list[dict[str, Any]], policy: Policy, expected: list[object]
) -> None:
    assert plan(dispatches, jobs, now=NOW, policy=policy) == expected


def test_every_category_is_covered_by_the_table() -> None:
    seen = {
        action.category
        for _, dispatches, jobs, policy, _expected in CASES
        for action in plan(dispatches, jobs, now=NOW, policy=policy)
    }
    # Category 7 is decided from the database's side alone (`stop_step`, tests/recovery/test_sweep_stopping.py).
    assert seen == set(Category) - {Category.STOPPING}


def test_orphans_and_tampered_jobs_say_what_disagreed() -> None:
    (action,) = plan([dispatch()], [job(replace(REF, tenancy_id="Tenant-A"))], now=NOW, policy=POLICY)  # type: ignore[arg-type]
    assert isinstance(action, TamperedJob)
    assert "'Tenant-A'" in action.detail and "'tenant-a'" in action.detail
    copy = job(replace(REF, tenancy_id="Tenant-A"), namespace="elsewhere")  # type: ignore[arg-type]
    (action,) = plan([dispatch()], [copy, job()], now=NOW, policy=POLICY)[:1]
    assert isinstance(action, ReportOrphan)
    assert "elsewhere" in action.detail


def test_categories_of_actions() -> None:
    assert CreateJob(**WHERE).category is Category.SCHEDULED_WITHOUT_JOB
    assert CompleteJob(**WHERE).category is Category.FINISHED_UNRECORDED
    assert ReportRunning(**WHERE).category is Category.RUNNING
    assert CleanUpJob(**WHERE).category is Category.CLEANUP
    assert RecreateJob(**WHERE, attempts=1).category is Category.JOB_LOST
    assert FailJobLost(**WHERE, attempts=3).category is Category.JOB_LOST
    assert FailJobLost(**WHERE, attempts=3).reason == "JobLost"
    assert orphan("UnknownDispatch").category is Category.ORPHAN
    assert [c.label for c in Category][:2] == ["scheduled_without_job", "finished_unrecorded"]


def test_actions_are_frozen_and_hashable() -> None:
    action = CreateJob(**WHERE)
    with pytest.raises(AttributeError):
        action.dispatch_id = "x"  # type: ignore[misc]
    assert len({action, CreateJob(**WHERE)}) == 1


def test_plan_does_not_change_its_inputs() -> None:
    dispatches, jobs = [dispatch()], [job(name="kd-copy", condition="Complete")]
    first = plan(dispatches, jobs, now=NOW, policy=POLICY)
    assert plan(dispatches, jobs, now=NOW, policy=POLICY) == first
    assert dispatches == [dispatch()] and jobs == [job(name="kd-copy", condition="Complete")]


def test_paged_halves_give_the_whole_plan() -> None:
    """The executor's halves, over any split of the Jobs into pages, equal the whole-world plan."""
    ids = [f"3f2b8a4e-0000-4000-8000-{i:012d}" for i in range(12)]
    states = [SCHEDULED, CREATED, COMPLETED, CANCELLED]
    dispatches = [dispatch(states[i % 4], ref=ref_for(d), attempts=i % 4) for i, d in enumerate(ids)]
    jobs = [job(ref_for(d), condition="Complete" if i % 2 else None) for i, d in enumerate(ids) if i % 3]
    jobs.append(job(ref_for("3f2b8a4e-ffff-4000-8000-000000000000")))  # forged
    whole = plan(dispatches, jobs, now=NOW, policy=POLICY)
    by_id = {d.dispatch_id: d for d in dispatches}
    for split in range(len(jobs) + 1):
        halves = plan_jobs(jobs[:split], by_id, now=NOW, policy=POLICY)
        halves += plan_jobs(jobs[split:], by_id, now=NOW, policy=POLICY)
        halves += plan_dispatches(dispatches, present_jobs(jobs), now=NOW, policy=POLICY)
        assert sorted(map(repr, halves)) == sorted(map(repr, whole))
    assert {type(a) for a in whole} == {CreateJob, CompleteJob, ReportRunning, CleanUpJob, RecreateJob, ReportOrphan}


def test_many_dispatches_each_get_their_own_decision() -> None:
    ids = [f"3f2b8a4e-0000-4000-8000-{i:012d}" for i in range(50)]
    actions = plan([dispatch(SCHEDULED, ref=ref_for(d)) for d in ids], [], now=NOW, policy=POLICY)
    assert [a.dispatch_id for a in actions] == ids
    assert all(isinstance(a, CreateJob) and a.job_name == job_name(a.dispatch_id) for a in actions)


def test_by_category_lists_every_category() -> None:
    grouped = by_category([CreateJob(**WHERE), CleanUpJob(**WHERE), CreateJob(**WHERE)])
    assert set(grouped) == set(Category)
    assert len(grouped[Category.SCHEDULED_WITHOUT_JOB]) == 2
    assert grouped[Category.CLEANUP] == [CleanUpJob(**WHERE)]
    assert grouped[Category.ORPHAN] == []


def test_policy_from_settings() -> None:
    settings = load_settings(
        {
            "K8S_DISPATCH_SWEEP_GRACE_S": "2.5",
            "K8S_DISPATCH_MAX_JOB_ATTEMPTS": "5",
            "K8S_DISPATCH_ORPHAN_POLICY": "delete",
        }
    )
    assert Policy.from_settings(settings) == Policy(
        grace=timedelta(seconds=2.5), max_job_attempts=5, orphan_policy=OrphanPolicy.DELETE
    )


# --- category 4 for Pods ------------------------------------------------------------------


def pod(ref: DispatchRef = REF, *, finalizer: bool = True, owner: str | None = NAME) -> dict[str, Any]:
    """A finished Pod of `ref`'s Job: its template's labels, our finalizer, its Job as controller."""
    labels, annotations = job_labels.encode(ref)
    metadata: dict[str, Any] = {"name": f"{NAME}-x1y2z", "namespace": NS, "labels": labels, "annotations": annotations}
    if finalizer:
        metadata["finalizers"] = [FINALIZER]
    if owner is not None:
        metadata["ownerReferences"] = [{"kind": "Job", "name": owner, "uid": "u", "controller": True}]
    return {"metadata": metadata, "status": {"phase": "Succeeded"}}


@pytest.mark.parametrize(
    ("the_pod", "rows", "releasing", "freed"),
    [
        (pod(), {DID: dispatch(DispatchState.COMPLETED)}, set(), True),  # its Job gone unreleased
        (pod(owner=None), {DID: dispatch(DispatchState.CANCELLED)}, set(), True),  # orphaned
        (pod(), {DID: dispatch(DispatchState.CREATED)}, set(), False),  # open: its result may be wanted
        (pod(), {}, set(), False),  # no dispatch: an orphan's, reported with its Job
        (pod(finalizer=False), {DID: dispatch(DispatchState.COMPLETED)}, set(), False),  # nothing to free
        (pod(), {DID: dispatch(DispatchState.FAILED)}, {(NS, NAME)}, False),  # its Job's clean-up frees it
    ],
)
def test_plan_pods(the_pod: dict[str, Any], rows: dict[str, DispatchView], releasing: set, freed: bool) -> None:
    actions = plan_pods([the_pod], rows, releasing=releasing)
    expected = [FreePod(DID, NS, the_pod["metadata"]["name"], the_pod)] if freed else []
    assert actions == expected
    assert all(a.category is Category.CLEANUP for a in actions)


# --- category 8 for Jobs labelled delivered by hand, our finalizer still on ------------------

HAND_DELIVERED = {job_labels.DELIVERED_LABEL: job_labels.DELIVERED}


@pytest.mark.parametrize(
    ("the_job", "rows", "expected"),
    [
        # its end recorded, its release lost: released and deleted (`tamper_step` CLEAN)
        (job(condition="Complete", labels=HAND_DELIVERED), {DID: dispatch(COMPLETED)}, [TamperedJob(**WHERE)]),
        # open, finished or running: delivered by name once it finishes (DELIVER, RUNS)
        (job(condition="Complete", labels=HAND_DELIVERED), {DID: dispatch(CREATED)}, [TamperedJob(**WHERE)]),
        (job(labels=HAND_DELIVERED), {DID: dispatch(CREATED)}, [TamperedJob(**WHERE)]),
        # released by us (finalizer off in the same patch as the label): the bulk delete's
        (job(condition="Complete", labels=HAND_DELIVERED, finalizer=False), {DID: dispatch(COMPLETED)}, []),
        # no dispatch of ours: an orphan, as any other LIST says
        (job(condition="Complete", labels=HAND_DELIVERED), {}, [orphan("UnknownDispatch")]),
    ],
)
def test_plan_held(the_job: dict[str, Any], rows: dict[str, DispatchView], expected: list[Any]) -> None:
    actions = plan_held([the_job], rows, now=NOW, policy=POLICY)
    assert actions == expected
    assert all(a.job is the_job for a in actions if isinstance(a, TamperedJob))
