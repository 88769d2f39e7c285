"""The recovery sweep's decisions (pure): what to do about each dispatch and each Job of ours.

`plan(...)` maps Jobs (API dicts), dispatch snapshots and "now" to actions tagged with the
categories. A Job is matched to its dispatch by the rule delivery uses (`delivery.reconstruct`),
so the sweep never plans to deliver what the completion path would refuse. `stop_step` and
`tamper_step` decide, from the database's side, about the Jobs of ended dispatches (which hold
their slot until stopped) and about hand-edited Jobs (which must end their dispatch all the same).
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import Enum, IntEnum
from typing import Any, ClassVar, TypeVar

from k8s_dispatch.core.errors import LabelMismatch, TenancyMismatch, UnknownDispatch
from k8s_dispatch.core.ids import is_dispatch_id
from k8s_dispatch.core.settings import OrphanPolicy, Settings
from k8s_dispatch.delivery.attempts import JOB_LOST_REASON, out_of_attempts
from k8s_dispatch.delivery.reconstruct import DispatchRecord, context_from_job
from k8s_dispatch.store.models import DispatchState
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.job_status import job_state
from k8s_dispatch.workers.manifest import FINALIZER, JOB_NAME_PREFIX, job_name

# The failure of a dispatch whose Job stayed hand-edited (labels or annotations disagreeing with
# the database) past the tampered grace: its result is never trusted, so never delivered.
JOB_TAMPERED_REASON = "JobTampered"

JobDict = Mapping[str, Any]
Object = TypeVar("Object", bound=JobDict)  # a Job's or a Pod's dict, as the API lists it


class Category(IntEnum):
    """The findings of a sweep: the design's six, and two from the database's side."""

    SCHEDULED_WITHOUT_JOB = 1  # dispatch scheduled, no Job, older than the grace period
    FINISHED_UNRECORDED = 2  # Job finished, no terminal event yet
    RUNNING = 3  # Job running: the poller will pick it up
    CLEANUP = 4  # terminal event recorded, Job or our finalizer (on it or its Pods) still there
    JOB_LOST = 5  # dispatch marked created, its Job gone without a result
    ORPHAN = 6  # Job of ours with no dispatch, or labels disagreeing with the DB
    STOPPING = 7  # dispatch ended FAILED or CANCELLED, its Job not yet seen finished or gone
    TAMPERED = 8  # an open dispatch's Job (by name) hand-edited: refused, or out of our selectors

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
    finished_at: datetime | None = None  # when its end was recorded
    job_tampered_at: datetime | None = None  # when its Job was first found hand-edited
    reason: str | None = None  # its end's reason

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
    tampered_grace: timedelta = timedelta(seconds=300)  # a hand-edited Job's, before JobTampered

    @classmethod
    def from_settings(cls, settings: Settings) -> Policy:
        return cls(
            grace=timedelta(seconds=settings.sweep_grace_s),
            max_job_attempts=settings.max_job_attempts,
            orphan_policy=settings.orphan_policy,
            tampered_grace=timedelta(seconds=settings.tampered_grace_s),
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


@dataclass(frozen=True)
class TamperedJob:
    """Category 8: the Job named for an open dispatch, in its namespace, is refused (its labels or
    annotations disagree with the row) or hidden from our selectors (`delivered=true` or another
    deployment label put on by hand); or a dispatch whose Job was found so before (`job` None:
    look it up by name). The executor decides with `tamper_step` under the dispatch's claim.
    Also the refused Job of an ended dispatch: only cleaned up."""

    dispatch_id: str
    namespace: str
    job_name: str
    job: JobDict | None = field(default=None, compare=False, repr=False)
    detail: str = field(default="", compare=False)
    category: ClassVar[Category] = Category.TAMPERED


Action = (
    CreateJob | CompleteJob | ReportRunning | CleanUpJob | FreePod | RecreateJob | FailJobLost | ReportOrphan
    | TamperedJob
)  # fmt: skip


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


def name_dispatch_id(job: JobDict) -> str | None:
    """The dispatch id a Job's name (`kd-<dispatch id>`) stands for, whatever its labels say."""
    name = _metadata(job).get("name")
    if not isinstance(name, str) or not name.startswith(JOB_NAME_PREFIX):
        return None
    dispatch_id = name[len(JOB_NAME_PREFIX) :]
    return dispatch_id if is_dispatch_id(dispatch_id) else None


def owner_by_name(job: JobDict, dispatches: Mapping[str, DispatchView]) -> DispatchView | None:
    """The dispatch whose Job this is by name and namespace (the database's word), if any."""
    dispatch_id = name_dispatch_id(job)
    view = dispatches.get(dispatch_id) if dispatch_id is not None else None
    metadata = _metadata(job)
    if view is None or (view.namespace, view.job_name) != (metadata.get("namespace"), metadata.get("name")):
        return None
    return view


def hidden(job: JobDict, deployment: str) -> bool:
    """Whether the Job is out of our undelivered selector while carrying our managed-by label:
    `delivered=true`, or no or another deployment label (pure)."""
    labels = _metadata(job).get("labels")
    return job_labels.is_hidden(labels if isinstance(labels, Mapping) else {}, deployment)


def named_dispatch_ids(job: JobDict) -> list[str]:
    """The dispatch ids a Job's labels may name, unchecked (the label's value, and the
    annotation's when it holds the full value): what to look its dispatch up by, cheaply.
    Whether the Job may be delivered for that dispatch is `refusal`'s to say."""
    metadata = _metadata(job)
    return job_labels.named_dispatch_ids(metadata.get("labels"), metadata.get("annotations"))


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


def plan_held(
    jobs: Iterable[JobDict],
    dispatches: Mapping[str, DispatchView],
    *,
    now: datetime,
    policy: Policy,
) -> list[Action]:
    """Category 8 for the Jobs labelled delivered that still hold our finalizer (pure). Every
    release of ours takes the finalizer off in the same patch that puts the label on, so only a
    hand leaves both; no other LIST of ours selects such a Job, and the bulk delete leaves it
    held for ever. One of a dispatch of ours is a `TamperedJob` (`tamper_step`: released and
    deleted once its dispatch has ended, delivered by name once it finishes if not); any other
    is what `plan_jobs` says (an orphan)."""
    held = holding_finalizer(jobs)
    actions: list[Action] = []
    for job, action in zip(held, plan_jobs(held, dispatches, now=now, policy=policy), strict=True):
        if isinstance(action, (CleanUpJob, CompleteJob, ReportRunning)):
            action = TamperedJob(action.dispatch_id, action.namespace, action.job_name, job=job, detail="held")
        actions.append(action)
    return actions


def holding_finalizer(objects: Iterable[Object]) -> list[Object]:
    """The objects among these that our finalizer holds (pure)."""
    return [o for o in objects if FINALIZER in (_metadata(o).get("finalizers") or [])]


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
    for pod in holding_finalizer(pods):
        metadata = _metadata(pod)
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
        action = missing_job(dispatch, now=now, policy=policy)
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
        owner = owner_by_name(job, dispatches)
        if owner is not None:
            # Where this dispatch's Job belongs, under its name: the dispatch's own, hand-edited.
            return TamperedJob(owner.dispatch_id, namespace, name, job=job, detail=str(refused))
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


def missing_job(
    dispatch: DispatchView, *, now: datetime, policy: Policy
) -> CreateJob | RecreateJob | FailJobLost | None:
    """What to do about an open dispatch whose Job is missing (categories 1 and 5; None: inside
    the grace, the normal path is probably on it)."""
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


class StopStep(Enum):
    """What the sweep does about the Job of a dispatch ended FAILED or CANCELLED (`stop_step`)."""

    MARK = "mark"  # the Job runs no more (finished, or gone): record it, the dispatch's slot is free
    STOP = "stop"  # the Job may run: release it and its Pods and delete it, then look again
    WAIT = "wait"  # no Job, but a create that started before the end may yet make one


def stop_step(view: DispatchView, job: JobDict | None, *, now: datetime, grace: timedelta) -> StopStep:
    """Pure: `job` is the dispatch's Job as just read (None: there is none).

    A Job that has finished (a final condition: its Pods are done) runs no more, whatever clean-up
    is left (its release is the completion path's, or the LIST's). One that still runs, or was
    deleted before it finished (its Pods are not collected while our finalizer holds it), is
    stopped by deleting it. No Job: stopped, unless none was ever recorded and the end is younger
    than the grace period (a create that read the row before the end may still make one).
    """
    if job is not None:
        return StopStep.MARK if finished(job) else StopStep.STOP
    if view.job_created_at is not None or view.finished_at is None or now - view.finished_at >= grace:
        return StopStep.MARK
    return StopStep.WAIT


def finished(job: JobDict) -> bool:
    """Whether the Job carries a final condition (pure): unlike `job_state`, a Job being deleted
    before it finished is not finished here, its Pods may still run."""
    metadata = {k: v for k, v in _metadata(job).items() if k != "deletionTimestamp"}
    return job_state({**job, "metadata": metadata}).terminal


class TamperStep(Enum):
    """What the sweep does about a dispatch whose Job was found hand-edited (`tamper_step`)."""

    WAIT = "wait"  # refused, inside the tampered grace: a hand may yet put it right
    FAIL = "fail"  # refused past the grace: WORKER_FAILED JobTampered, then clean up the Job
    DELETE = "delete"  # refused, and the orphan policy deletes: removed now, the dispatch runs again
    DELIVER = "deliver"  # only hidden (its labels agree) and finished: deliver it, as poll would
    RUNS = "runs"  # only hidden and still running: it is ours; looked at by name every sweep
    CLEAN = "clean"  # the dispatch has ended, its Job refused: release and delete the Job
    MISSING = "missing"  # noted, and no Job now (removed by DELETE, or since): run it again (5)
    FORGET = "forget"  # no Job, never noted (category 5's), or nothing wrong any more: clear the note


def tamper_step(
    view: DispatchView,
    job: JobDict | None,
    *,
    refused: bool,
    hidden: bool,
    now: datetime,
    grace: timedelta,
    delete: bool = False,
) -> TamperStep:
    """Pure: `job` is the dispatch's Job by name (None: absent); `refused` whether delivery would
    refuse it for this dispatch (`refusal`); `hidden` whether it is out of our selectors. The
    grace counts from `view.job_tampered_at` (the database's clock; None: not noted yet).
    `delete` (ORPHAN_POLICY=delete): a refused Job is removed at once (the row noted first), and
    its dispatch gets a Job of its own as any whose Job is missing (category 5 within its
    attempts), found again from the note: no watch event or LIST needs to see the Job leave."""
    if view.terminal:
        # Refused, or hidden by hand (delivered=true) with our finalizer perhaps still on: no LIST
        # of ours selects it, and the bulk delete would leave it held for ever. Released and deleted here.
        return TamperStep.CLEAN if job is not None and (refused or hidden) else TamperStep.FORGET
    if job is None:
        return TamperStep.MISSING if view.job_tampered_at is not None else TamperStep.FORGET
    if not (refused or hidden):
        return TamperStep.FORGET
    if not refused:
        return TamperStep.DELIVER if job_state(job).terminal else TamperStep.RUNS
    if delete:
        return TamperStep.DELETE
    if view.job_tampered_at is not None and now - view.job_tampered_at >= grace:
        return TamperStep.FAIL
    return TamperStep.WAIT


def by_category(actions: Sequence[Action]) -> dict[Category, list[Action]]:
    """Actions grouped by category, every category present (possibly empty)."""
    grouped: dict[Category, list[Action]] = {c: [] for c in Category}
    for action in actions:
        grouped[action.category].append(action)
    return grouped


def _metadata(job: JobDict) -> Mapping[str, Any]:
    metadata = job.get("metadata")
    return metadata if isinstance(metadata, Mapping) else {}
