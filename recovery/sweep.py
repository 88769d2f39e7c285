"""The recovery sweep's decisions (pure): what to do about each dispatch and each Job of ours.

`plan(...)` maps Jobs (API dicts), dispatch snapshots and "now" to actions tagged with the six
categories. A Job is matched to its dispatch by the rule delivery uses (`recovery.reconstruct`),
so the sweep never plans to deliver what the completion path would refuse.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import IntEnum
from typing import Any, ClassVar

from k8s_dispatch.engine.errors import LabelMismatch, TenancyMismatch, UnknownDispatch
from k8s_dispatch.engine.ids import is_dispatch_id
from k8s_dispatch.engine.models import DispatchState
from k8s_dispatch.engine.settings import OrphanPolicy, Settings
from k8s_dispatch.recovery.reconstruct import DispatchRecord, context_from_job
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.job_status import job_state
from k8s_dispatch.workers.manifest import FINALIZER, JOB_NAME_PREFIX, job_name

JOB_LOST_REASON = "JobLost"

JobDict = Mapping[str, Any]


class Category(IntEnum):
    """The six findings of a sweep, numbered as in the design (issue 5)."""

    SCHEDULED_WITHOUT_JOB = 1  # dispatch scheduled, no Job, older than the grace period
    FINISHED_UNRECORDED = 2  # Job finished, no terminal event yet
    RUNNING = 3  # Job running: the poller will pick it up
    CLEANUP = 4  # terminal event recorded, Job or our finalizer (on it or its Pods) still there
    JOB_LOST = 5  # dispatch marked created, its Job gone without a result
    ORPHAN = 6  # Job of ours with no dispatch, or labels disagreeing with the DB

    @property
    def label(self) -> str:
        return self.name.lower()


# --- inputs ----------------------------------------------------------------------------


@dataclass(frozen=True)
class DispatchView:
    """A dispatch as the sweep sees it: the row's snapshot, where its Job belongs, its times.

    The grace period counts from `updated_at`, the row's last change (for a scheduled row,
    its creation), as the database query that pages through them does.

    `namespace` is the recorded Job namespace, or else the capability's (where the Job would
    be created); a Job carrying this dispatch's labels anywhere else is a copy.
    """

    record: DispatchRecord
    namespace: str
    created_at: datetime
    updated_at: datetime
    job_created_at: datetime | None = None  # when its Job was recorded created: the start clock's origin

    @property
    def dispatch_id(self) -> str:
        return self.record.dispatch_id

    @property
    def job_name(self) -> str:
        return self.record.job_name or job_name(self.record.dispatch_id)

    @property
    def state(self) -> DispatchState:
        return self.record.state

    @property
    def terminal(self) -> bool:
        return self.record.terminal


@dataclass(frozen=True)
class Policy:
    """The settings that shape decisions."""

    grace: timedelta
    max_job_attempts: int  # Jobs per dispatch, the first included
    orphan_policy: OrphanPolicy

    @classmethod
    def from_settings(cls, settings: Settings) -> Policy:
        return cls(
            grace=timedelta(seconds=settings.sweep_grace_s),
            max_job_attempts=settings.max_job_attempts,
            orphan_policy=settings.orphan_policy,
        )


# --- actions ---------------------------------------------------------------------------


@dataclass(frozen=True)
class CreateJob:
    """Category 1: create the dispatch's Job (the deterministic name adopts one that exists)."""

    dispatch_id: str
    namespace: str
    job_name: str
    category: ClassVar[Category] = Category.SCHEDULED_WITHOUT_JOB


@dataclass(frozen=True)
class CompleteJob:
    """Category 2: deliver the finished Job through the single completion path.

    `job` is the Job as the sweep's LIST read it (final, being finished): no GET is needed.
    """

    dispatch_id: str
    namespace: str
    job_name: str
    job: JobDict | None = field(default=None, compare=False, repr=False)
    category: ClassVar[Category] = Category.FINISHED_UNRECORDED


@dataclass(frozen=True)
class ReportRunning:
    """Category 3: the Job runs; `adopt` when the dispatch was never marked created."""

    dispatch_id: str
    namespace: str
    job_name: str
    adopt: bool = False
    category: ClassVar[Category] = Category.RUNNING


@dataclass(frozen=True)
class CleanUpJob:
    """Category 4: the terminal event is recorded: release the Job (our finalizer off, the
    delivered label on, one patch exact by `job`'s uid); the sweep's bulk delete removes it."""

    dispatch_id: str
    namespace: str
    job_name: str
    job: JobDict | None = field(default=None, compare=False, repr=False)
    category: ClassVar[Category] = Category.CLEANUP


@dataclass(frozen=True)
class FreePod:
    """Category 4 for a Pod: its dispatch has ended, yet it holds our finalizer (its Job was
    deleted before it was released, or a Pod came after the release): take the finalizer off,
    one patch exact by `pod`'s uid, so that no Pod of ours is kept for ever."""

    dispatch_id: str
    namespace: str
    pod_name: str
    pod: JobDict = field(compare=False, repr=False)
    category: ClassVar[Category] = Category.CLEANUP


@dataclass(frozen=True)
class RecreateJob:
    """Category 5: the Job vanished without a result; create it again.

    `attempts` is the row's count when planned (re-creations so far): the executor acts only
    if it is unchanged, so two sweeps never count the same loss twice.
    """

    dispatch_id: str
    namespace: str
    job_name: str
    attempts: int
    category: ClassVar[Category] = Category.JOB_LOST


@dataclass(frozen=True)
class FailJobLost:
    """Category 5: the Job vanished and the attempts are used up: WORKER_FAILED `JobLost`."""

    dispatch_id: str
    namespace: str
    job_name: str
    attempts: int
    reason: str = JOB_LOST_REASON
    category: ClassVar[Category] = Category.JOB_LOST


@dataclass(frozen=True)
class ReportOrphan:
    """Category 6: never delivered; reported, and deleted when the policy says so.

    `reason` is the refusal's (LabelMismatch, TenancyMismatch, UnknownDispatch); `detail`
    says what disagreed.
    """

    namespace: str
    job_name: str
    dispatch_id: str | None
    reason: str
    delete: bool
    detail: str = field(default="", compare=False)
    category: ClassVar[Category] = Category.ORPHAN


Action = CreateJob | CompleteJob | ReportRunning | CleanUpJob | FreePod | RecreateJob | FailJobLost | ReportOrphan


# --- decisions -------------------------------------------------------------------------


def plan(
    dispatches: Iterable[DispatchView],
    jobs: Iterable[JobDict],
    *,
    now: datetime,
    policy: Policy,
) -> list[Action]:
    """Everything to do, given every relevant dispatch and every Job of ours.

    The executor pages through both sides and calls the two halves below; this whole-world
    form is the specification they partition.
    """
    dispatches = list(dispatches)
    jobs = list(jobs)
    by_id = {d.dispatch_id: d for d in dispatches}
    return plan_jobs(jobs, by_id, now=now, policy=policy) + plan_dispatches(
        dispatches, present_jobs(jobs), now=now, policy=policy
    )


@dataclass(frozen=True)
class NameOrder:
    """How far a LIST of Jobs in name order has got: its last name, and the last dispatch id
    whose Job name (`kd-<dispatch id>`) it passed.

    The API lists a namespace's Jobs by name (etcd's key order), and a dispatch's Job name
    sorts as its id: so the Jobs of the dispatch ids in (`last_id` before a page, `last_id`
    after it] are all in that page, and a dispatch of that range whose Job is not in the page
    has none. That matches dispatches to Jobs as both stream by, a page at a time.
    """

    last_name: str | None = None
    last_id: str | None = None

    def advance(self, names: Sequence[str]) -> NameOrder | None:
        """The order after one more page of names; None if the page breaks it (a listing that
        restarted after an expired continue token, or a server that does not list by name)."""
        last = self.last_name
        last_id = self.last_id
        for name in names:
            if last is not None and name <= last:
                return None
            last = name
            dispatch_id = name[len(JOB_NAME_PREFIX) :]
            if name.startswith(JOB_NAME_PREFIX) and is_dispatch_id(dispatch_id):
                last_id = dispatch_id
        return NameOrder(last_name=last, last_id=last_id)


def named_dispatch_ids(job: JobDict) -> list[str]:
    """The dispatch ids a Job's labels may name, unchecked (the label's value, and the
    annotation's when it holds the full value): what to look its dispatch up by, cheaply.
    Whether the Job may be delivered for that dispatch is `refusal`'s to say."""
    metadata = _metadata(job)
    found = []
    for source in (metadata.get("labels"), metadata.get("annotations")):
        value = source.get(job_labels.DISPATCH_ID_KEY) if isinstance(source, Mapping) else None
        if isinstance(value, str) and value not in found:
            found.append(value)
    return found


def present_jobs(jobs: Iterable[JobDict]) -> set[tuple[str, str]]:
    """(namespace, name) of each Job, the form `plan_dispatches` takes."""
    return {(_metadata(j).get("namespace", ""), _metadata(j).get("name", "")) for j in jobs}


def plan_jobs(
    jobs: Iterable[JobDict],
    dispatches: Mapping[str, DispatchView],
    *,
    now: datetime,
    policy: Policy,
) -> list[Action]:
    """Categories 2, 3, 4 and 6: one decision per Job.

    `dispatches` holds the rows for the dispatch ids the Jobs' labels name (missing = none).
    """
    return [_decide_job(job, dispatches, policy=policy) for job in jobs]


def plan_pods(
    pods: Iterable[JobDict],
    dispatches: Mapping[str, DispatchView],
    *,
    releasing: Container[tuple[str, str]] = frozenset(),
) -> list[Action]:
    """Category 4 for Pods: each Pod holding our finalizer whose dispatch has ended.

    `dispatches` holds the rows for the dispatch ids the Pods' labels (copied from their Job's
    template) name. A Pod of a dispatch still open keeps its finalizer: its result may be
    wanted (the Job's, or a re-run's); one naming no dispatch is an orphan's, left alone. So is
    one whose Job, (namespace, name) in `releasing`, is being cleaned up (`CleanUpJob`): that
    frees its Pods, or a queued completion does.
    """
    actions: list[Action] = []
    for pod in pods:
        metadata = _metadata(pod)
        if FINALIZER not in (metadata.get("finalizers") or []):
            continue
        owner = next(
            (o for o in metadata.get("ownerReferences") or [] if o.get("controller") and o.get("kind") == "Job"), None
        )
        if owner is not None and (metadata.get("namespace", ""), owner.get("name", "")) in releasing:
            continue
        dispatch = next((dispatches[i] for i in named_dispatch_ids(pod) if i in dispatches), None)
        if dispatch is not None and dispatch.terminal:
            actions.append(FreePod(dispatch.dispatch_id, metadata.get("namespace", ""), metadata.get("name", ""), pod))
    return actions


def plan_dispatches(
    dispatches: Iterable[DispatchView],
    present: Iterable[tuple[str, str]],
    *,
    now: datetime,
    policy: Policy,
) -> list[Action]:
    """Categories 1 and 5: non-terminal dispatches whose Job is not in `present`.

    `present` holds (namespace, name) of the Jobs that exist, at least among these dispatches'.
    """
    present = present if isinstance(present, (set, frozenset)) else set(present)
    actions: list[Action] = []
    for dispatch in dispatches:
        if dispatch.terminal or (dispatch.namespace, dispatch.job_name) in present:
            continue
        action = _decide_missing_job(dispatch, now=now, policy=policy)
        if action is not None:
            actions.append(action)
    return actions


def refusal(job: JobDict, dispatch: DispatchView | None) -> LabelMismatch | TenancyMismatch | UnknownDispatch | None:
    """Why this Job must never be delivered for `dispatch`, or None when it may be.

    `dispatch` is the row of the dispatch id the Job's labels name (None: no such row).
    """
    try:
        context_from_job(
            job,
            dispatch.record if dispatch is not None else None,
            expected_namespace=dispatch.namespace if dispatch is not None else None,
        )
    except (LabelMismatch, TenancyMismatch, UnknownDispatch) as e:
        return e
    return None


def _decide_job(job: JobDict, dispatches: Mapping[str, DispatchView], *, policy: Policy) -> Action:
    metadata = _metadata(job)
    namespace, name = metadata.get("namespace", ""), metadata.get("name", "")
    has_finalizer = FINALIZER in (metadata.get("finalizers") or [])
    deleting = bool(metadata.get("deletionTimestamp"))
    # Looked up by the raw label (or its annotation); `refusal` decodes and checks it all.
    dispatch = next((dispatches[i] for i in named_dispatch_ids(job) if i in dispatches), None)
    refused = refusal(job, dispatch)
    if refused is not None:
        try:
            dispatch_id: str | None = job_labels.decode(metadata.get("labels"), metadata.get("annotations")).dispatch_id
        except LabelMismatch:
            dispatch_id = None
        # Deleting needs our finalizer gone; a Job already going away without it is only reported.
        return ReportOrphan(
            namespace=namespace,
            job_name=name,
            dispatch_id=dispatch_id,
            reason=refused.reason,
            delete=policy.orphan_policy is OrphanPolicy.DELETE and (has_finalizer or not deleting),
            detail=str(refused),
        )
    assert dispatch is not None  # `refusal` refuses a Job without a dispatch
    where = dict(dispatch_id=dispatch.dispatch_id, namespace=namespace, job_name=name)
    if dispatch.terminal:
        # Recorded already (completed, failed, or cancelled while the Job ran): never delivered
        # again, only cleaned up, even when the Job finished afterwards.
        return CleanUpJob(**where, job=job)
    if job_state(job).terminal:
        # Finished, or deleted before it finished (job_status reads that as failed, JobDeleted):
        # our finalizer kept the Job and its result, the completion path delivers it.
        return CompleteJob(**where, job=job)
    return ReportRunning(**where, adopt=dispatch.state is DispatchState.SCHEDULED)


def _decide_missing_job(dispatch: DispatchView, *, now: datetime, policy: Policy) -> Action | None:
    # Changed within the grace period: the normal path is probably creating its Job right now.
    if now - dispatch.updated_at < policy.grace:
        return None
    where = dict(dispatch_id=dispatch.dispatch_id, namespace=dispatch.namespace, job_name=dispatch.job_name)
    if dispatch.state is DispatchState.SCHEDULED:
        return CreateJob(**where)
    # CREATED: the Job existed (it is created before the row is marked), so it was lost.
    attempts = dispatch.record.attempts  # re-creations so far: attempts + 1 Jobs were made
    if out_of_attempts(attempts, policy.max_job_attempts):
        return FailJobLost(**where, attempts=attempts)
    return RecreateJob(**where, attempts=attempts)


def out_of_attempts(attempts: int, max_job_attempts: int) -> bool:
    """Whether a dispatch whose Job of attempt `attempts` (re-creations before it) was lost, or
    lost its result, fails `JobLost` rather than runs again: `max_job_attempts` counts Jobs."""
    return attempts + 1 >= max_job_attempts


def by_category(actions: Sequence[Action]) -> dict[Category, list[Action]]:
    """Actions grouped by category, every category present (possibly empty)."""
    grouped: dict[Category, list[Action]] = {c: [] for c in Category}
    for action in actions:
        grouped[action.category].append(action)
    return grouped


def _metadata(job: JobDict) -> Mapping[str, Any]:
    metadata = job.get("metadata")
    return metadata if isinstance(metadata, Mapping) else {}
