"""What the Job controller decides for one Indexed Job in one sync (pure), ported from
pkg/controller/job (Kubernetes 1.36: syncJob, manageJob, trackJobStatusAndRemoveFinalizers and
indexed_job_utils.go): which index each new Pod runs (the lowest not succeeded, failed, active or,
with podReplacementPolicy Failed, terminating), at most `parallelism` active; duplicate or
out-of-range Pods deleted; `completedIndexes` and, with `backoffLimitPerIndex`, `failedIndexes`
as interval strings; per-index backoff (a failed Pod keeps its tracking finalizer until its
index's replacement exists, which carries `job-index-failure-count`); `maxFailedIndexes`
(MaxFailedIndexesExceeded), all indexes done with some failed (FailedIndexes), podFailurePolicy
FailIndex/FailJob/Ignore/Count, successPolicy (SuccessCriteriaMet, reason SuccessPolicy), and
the two status writes around the removal of tracking finalizers: failed Pods' uids first go to
`uncountedTerminatedPods.failed`, then into `failed` once their finalizer is off (a succeeded
Pod needs no uid: its index in completedIndexes is the record).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Any

from k8s_dispatch.demo.localcluster import indexes as ix
from k8s_dispatch.demo.localcluster.jobsync import PodView, condition, pod_view
from k8s_dispatch.demo.localcluster.timestamps import parse_rfc3339, rfc3339

COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
FAILURE_COUNT = "batch.kubernetes.io/job-index-failure-count"
IGNORED_FAILURE_COUNT = "batch.kubernetes.io/job-index-ignored-failure-count"
INDEX_ENV = "JOB_COMPLETION_INDEX"
MAX_GENERATED_NAME = 58  # names.MaxGeneratedNameLength: 63 less the 5-character suffix
MAX_UNCOUNTED = 500  # MaxUncountedPods
MAX_CREATE_DELETE = 500  # MaxPodCreateDeletePerSync
MAX_INT32 = 2**31 - 1

BACKOFF_LIMIT_EXCEEDED = ("BackoffLimitExceeded", "Job has reached the specified backoff limit")
DEADLINE_EXCEEDED = ("DeadlineExceeded", "Job was active longer than specified deadline")
MAX_FAILED_INDEXES = ("MaxFailedIndexesExceeded", "Job has exceeded the specified maximal number of failed indexes")
FAILED_INDEXES = ("FailedIndexes", "Job has failed indexes")
COMPLETIONS_REACHED = ("CompletionsReached", "Reached expected number of succeeded pods")
SUCCESS_POLICY = "SuccessPolicy"
POD_FAILURE_POLICY = "PodFailurePolicy"


@dataclass(frozen=True, kw_only=True)
class IndexedPod(PodView):
    """What the controller needs to know of one Pod of an Indexed Job: a Pod's view and its index."""

    index: int  # -1: none or not a number
    failure_count: int
    ignored_count: int
    finished_at: float
    scheduled: bool


def _count(text: Any) -> int:
    """An index-failure-count annotation as parseInt32 reads it: 0 unless a number in int32."""
    try:
        value = int(str(text))
    except ValueError:
        return 0
    return value if 0 <= value <= MAX_INT32 else 0


def completion_index(annotations: dict[str, Any] | None) -> int:
    text = (annotations or {}).get(COMPLETION_INDEX)
    if text is None:
        return -1
    try:
        value = ix._atoi(str(text))
    except ValueError:
        return -1
    return value if value >= 0 else -1


def _time(text: Any) -> float | None:
    if not text:
        return None
    try:
        return parse_rfc3339(str(text))
    except ValueError:
        return None


def finished_time(pod: dict[str, Any]) -> float:
    """getFinishedTime: the containers' last finish, else Ready=False's transition, else the
    deletion time less its grace, else the creation time."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    latest = None
    statuses = status.get("containerStatuses") or []
    for cs in statuses:
        term = (cs.get("state") or {}).get("terminated") or {}
        t = _time(term.get("finishedAt"))
        if t is None:
            latest = None
            break
        latest = t if latest is None else max(latest, t)
    if latest is not None:
        return latest
    for c in status.get("conditions") or []:
        if c.get("type") == "Ready" and c.get("status") == "False":
            t = _time(c.get("lastTransitionTime"))
            if t is not None:
                return t
    deleted = _time(meta.get("deletionTimestamp"))
    if deleted is not None:
        return deleted - float(meta.get("deletionGracePeriodSeconds") or 0)
    return _time(meta.get("creationTimestamp")) or 0.0


def indexed_pod(pod: dict[str, Any], policy: dict[str, Any] | None) -> IndexedPod:
    view = pod_view(pod, policy)
    ann = pod["metadata"].get("annotations") or {}
    # a finish time serves the backoff of a Pod not counted yet: the others are many and need none
    ended = view.tracked and (view.terminal or view.deleting)
    return IndexedPod(
        **{f.name: getattr(view, f.name) for f in fields(PodView)},
        index=completion_index(ann),
        failure_count=_count(ann.get(FAILURE_COUNT, 0)),
        ignored_count=_count(ann.get(IGNORED_FAILURE_COUNT, 0)),
        finished_at=finished_time(pod) if ended else 0.0,
        scheduled=bool((pod.get("spec") or {}).get("nodeName")),
    )


@dataclass(frozen=True)
class NewPod:
    index: int
    failure_count: int | None  # None: no backoffLimitPerIndex, no annotation
    ignored_count: int


@dataclass
class BackoffRecord:
    """The controller's memory of a Job's failures since its last success (backoffRecord)."""

    failures: int = 0
    last_failure: float | None = None


@dataclass
class IndexedPlan:
    first: dict[str, Any] | None  # the status written before finalizers come off (None: no write)
    final: dict[str, Any] | None  # the status written after (None: no write)
    remove_finalizer: list[IndexedPod] = field(default_factory=list)
    delete: list[IndexedPod] = field(default_factory=list)  # deleteActivePods: finalizers kept
    delete_uncounted: list[IndexedPod] = field(default_factory=list)  # deleteJobPods: finalizer off first
    create: list[NewPod] = field(default_factory=list)
    backoff: BackoffRecord | None = None  # the new record, kept once the first write is made
    finished: dict[str, Any] | None = None  # the terminal condition added now
    requeue_at: float | None = None

    def wake_at(self, when: float) -> None:
        self.requeue_at = when if self.requeue_at is None else min(self.requeue_at, when)


def _has(conditions: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    return next((c for c in conditions if c.get("type") == kind and c.get("status") == "True"), None)


def _backoff(base: float, cap: float, failures: int) -> float:
    delay = base
    for _ in range(1, failures):
        delay *= 2
        if delay >= cap:
            return cap
    return delay


def _new_backoff(old: BackoffRecord, succeeded: list[IndexedPod], failed: list[IndexedPod]) -> BackoffRecord:
    """newBackoffRecord: failures after the last success, and when the last of them happened."""
    succ = sorted(p.finished_at for p in succeeded)
    fail = sorted(p.finished_at for p in failed)
    if not succ:
        if not fail:
            return BackoffRecord(old.failures, old.last_failure)
        return BackoffRecord(old.failures + len(fail), fail[-1])
    record = BackoffRecord()
    for t in reversed(fail):
        if t <= succ[-1]:
            break
        if record.last_failure is None:
            record.last_failure = t
        record.failures += 1
    return record


def _ensure_condition(
    conditions: list[dict[str, Any]], kind: str, status: str, reason: str, message: str, now: float
) -> bool:
    """ensureJobConditionStatus: set or add `kind`; whether anything changed."""
    for i, c in enumerate(conditions):
        if c.get("type") == kind:
            if c.get("status") != status or c.get("reason") != reason or c.get("message") != message:
                conditions[i] = condition(kind, reason, message, now, status=status)
                return True
            return False
    if status != "False":
        conditions.append(condition(kind, reason, message, now, status=status))
        return True
    return False


def _removal_order(p: IndexedPod) -> tuple[int, int, int, int, float]:
    """controller.ActivePods: unscheduled, pending, not ready, more restarts, newer come first."""
    phase_rank = {"Pending": 0, "Unknown": 1, "Running": 2}.get(p.phase, 1)
    return (int(p.scheduled), phase_rank, int(p.ready), -p.restarts, -(_time(p.created) or 0.0))


def pods_for_removal(pods: list[IndexedPod], completions: int, at_least: int) -> list[IndexedPod]:
    """activePodsForRemoval for an Indexed Job: Pods without a valid index, the extra Pods of a
    repeated index (the one kept is the last in removal order), then more in removal order."""
    rm: list[IndexedPod] = []
    left: list[IndexedPod] = []
    by_index: dict[int, list[IndexedPod]] = {}
    for p in sorted(pods, key=lambda p: p.index):
        if p.index < 0 or p.index >= completions:
            rm.append(p)
        else:
            by_index.setdefault(p.index, []).append(p)
    for group in by_index.values():
        group = sorted(group, key=_removal_order)
        rm += group[:-1]
        left.append(group[-1])
    if len(rm) < at_least:
        rm += sorted(left, key=_removal_order)[: at_least - len(rm)]
    return rm


def plan_indexed(
    job: dict[str, Any],
    pods: list[IndexedPod],
    now: float,
    *,
    backoff: BackoffRecord,
    backoff_base: float,
    backoff_max: float,
) -> IndexedPlan:
    """Decide one sync of the unfinished Indexed Job `job` (a finished one is not synced)."""
    spec = job.get("spec") or {}
    meta = job["metadata"]
    old = job.get("status") or {}
    status: dict[str, Any] = copy.deepcopy(old)
    conditions: list[dict[str, Any]] = status.get("conditions") or []
    completions = int(spec.get("completions") or 0)
    parallelism = int(spec.get("parallelism", 1))
    per_index = spec.get("backoffLimitPerIndex") is not None
    policy = spec.get("podFailurePolicy")
    suspended = bool(spec.get("suspend"))
    only_failed = spec.get("podReplacementPolicy") == "Failed" or policy is not None
    deleting_job = bool(meta.get("deletionTimestamp"))
    plan = IndexedPlan(None, None)

    uncounted = status.get("uncountedTerminatedPods") or {}
    unc_succeeded = list(uncounted.get("succeeded") or [])
    unc_failed = list(uncounted.get("failed") or [])

    def is_failed(p: IndexedPod) -> bool:
        if p.phase == "Failed":
            return True
        return not only_failed and p.deleting and p.phase != "Succeeded"

    def valid(p: IndexedPod) -> bool:
        return p.tracked and 0 <= p.index < completions

    def counts(p: IndexedPod) -> bool:  # not matched by an Ignore rule
        return policy is None or p.policy is None or p.policy.action != "Ignore"

    active = [p for p in pods if p.active]
    terminating = sum(1 for p in pods if p.terminating)
    ready = sum(1 for p in active if p.ready)
    new_succeeded = [p for p in pods if valid(p) and p.uid not in unc_succeeded and p.phase == "Succeeded"]
    new_failed = [p for p in pods if valid(p) and p.uid not in unc_failed and is_failed(p)]
    failed_total = old.get("failed", 0) + sum(1 for p in new_failed if counts(p)) + len(unc_failed)
    if not status.get("startTime") and not suspended:
        status["startTime"] = rfc3339(now)
    new_record = _new_backoff(backoff, new_succeeded, new_failed)

    finished: dict[str, Any] | None = _has(conditions, "SuccessCriteriaMet")
    if finished is None:
        target = _has(conditions, "FailureTarget")
        if target is not None:
            finished = condition("Failed", target.get("reason", ""), target.get("message", ""), now)
        else:
            fail_job = next(
                (p.policy for p in pods if is_failed(p) and p.policy is not None and p.policy.action == "FailJob"),
                None,
            )
            if fail_job is not None:
                finished = condition("FailureTarget", POD_FAILURE_POLICY, fail_job.message, now)
    if finished is None:
        restart_limit = spec.get("backoffLimit", 6)
        on_failure = ((spec.get("template") or {}).get("spec") or {}).get("restartPolicy") == "OnFailure"
        restarts = sum(p.restarts for p in pods if p.phase in ("Running", "Pending")) if on_failure else 0
        past_restarts = on_failure and (restarts > 0 if restart_limit == 0 else restarts >= restart_limit)
        deadline = spec.get("activeDeadlineSeconds")
        started = (_time(status.get("startTime")) or now) if status.get("startTime") else None
        if failed_total > restart_limit or past_restarts:
            finished = condition("FailureTarget", *BACKOFF_LIMIT_EXCEEDED, now)
        elif deadline is not None and started is not None and not suspended and now - started >= deadline:
            finished = condition("FailureTarget", *DEADLINE_EXCEEDED, now)
        elif deadline is not None and started is not None and not suspended:
            plan.wake_at(started + deadline)

    prev_succeeded = ix.parse(old.get("completedIndexes"), completions)
    succeeded = ix.with_indexes(prev_succeeded, (p.index for p in pods if valid(p) and p.phase == "Succeeded"))
    failed_indexes: list[ix.Interval] | None = None
    delayed: dict[int, IndexedPod] = {}
    if per_index:
        limit = int(spec["backoffLimitPerIndex"])

        def index_failed(p: IndexedPod) -> bool:
            if not is_failed(p):
                return False
            if policy is not None and p.policy is not None and p.policy.action == "FailIndex":
                return True
            return counts(p) and p.failure_count >= limit

        failed_indexes = ix.with_indexes(
            ix.parse(old.get("failedIndexes"), completions), (p.index for p in pods if valid(p) and index_failed(p))
        )
        if finished is None:
            max_failed = spec.get("maxFailedIndexes")
            n_failed = ix.total(failed_indexes)
            if max_failed is not None and n_failed > max_failed:
                finished = condition("FailureTarget", *MAX_FAILED_INDEXES, now)
            elif n_failed > 0 and n_failed + ix.total(succeeded) >= completions:
                finished = condition("FailureTarget", *FAILED_INDEXES, now)
        active_indexes = {p.index for p in active if p.index >= 0}
        for p in pods:  # getPodsWithDelayedDeletionPerIndex
            if not (valid(p) and is_failed(p)):
                continue
            if ix.has(succeeded, p.index) or ix.has(failed_indexes, p.index) or p.index in active_indexes:
                continue
            last = delayed.get(p.index)
            if last is None or (
                last.failure_count + last.ignored_count <= p.failure_count + p.ignored_count
                and p.finished_at >= last.finished_at
            ):
                delayed[p.index] = p
    if finished is None:
        message = ix.match_success_policy(spec.get("successPolicy"), completions, succeeded)
        if message is not None:
            finished = condition("SuccessCriteriaMet", SUCCESS_POLICY, message, now)

    n_active = len(active)
    suspend_changed = False
    if finished is not None:
        plan.delete = list(active)  # deleteActivePods: their tracking finalizers stay
        n_active = 0
        terminating += len(active)
        ready -= sum(1 for p in active if p.ready)
    else:
        managed = False
        if not deleting_job:
            managed = True
            n_active, terminating, ready = _manage(
                plan, spec, active, pods, succeeded, failed_indexes, delayed, new_record, now,
                completions=completions, parallelism=parallelism, per_index=per_index,
                only_failed=only_failed, terminating=terminating, ready=ready,
                backoff_base=backoff_base, backoff_max=backoff_max,
            )  # fmt: skip
        if ix.total(succeeded) >= completions and n_active == 0:
            finished = condition("SuccessCriteriaMet", *COMPLETIONS_REACHED, now)
        elif managed:
            if suspended:
                suspend_changed = _ensure_condition(
                    conditions, "Suspended", "True", "JobSuspended", "Job suspended", now
                )
                if suspend_changed:
                    status.pop("startTime", None)
            else:
                suspend_changed = _ensure_condition(conditions, "Suspended", "False", "JobResumed", "Job resumed", now)
                if suspend_changed:
                    status["startTime"] = rfc3339(now)

    needs_flush = (
        suspend_changed
        or n_active != old.get("active", 0)
        or ready != old.get("ready")
        or terminating != old.get("terminating")
    )
    _set(status, "active", n_active)
    status["ready"] = ready
    status["terminating"] = terminating

    # --- trackJobStatusAndRemoveFinalizers ---
    with_finalizer = {p.uid for p in pods if p.tracked}
    if _clean_uncounted(status, unc_succeeded, unc_failed, with_finalizer):
        needs_flush = True
    new_indexes: list[int] = []
    reached_max = False
    success_met = finished is not None and finished["type"] == "SuccessCriteriaMet"
    for p in sorted(pods, key=lambda p: p.index):
        if not p.tracked:
            continue
        considered_failed = is_failed(p)
        can_remove = deleting_job or finished is not None or p.phase == "Succeeded"
        if not can_remove and considered_failed:
            can_remove = not (per_index and p.index in delayed and delayed[p.index].uid == p.uid)
        if not can_remove:
            continue
        plan.remove_finalizer.append(p)
        if p.phase == "Succeeded" and p.uid not in unc_failed:
            if 0 <= p.index < completions and not ix.has(prev_succeeded, p.index):
                new_indexes.append(p.index)
                needs_flush = True
        elif (
            (considered_failed or (finished is not None and not success_met))
            and p.uid not in unc_failed
            and 0 <= p.index < completions
            and counts(p)
        ):
            # a Pod that ends with the Job failing counts as failed; one stopped by success does not
            unc_failed.append(p.uid)
            needs_flush = True
        if len(new_indexes) + len(unc_succeeded) + len(unc_failed) >= MAX_UNCOUNTED:
            reached_max = True  # the rest waits for the next sync, as the status stays small
            break
    _set_uncounted(status, unc_succeeded, unc_failed)
    succeeded = ix.with_indexes(succeeded, new_indexes)
    text = ix.format_intervals(succeeded)
    if text != old.get("completedIndexes", ""):
        needs_flush = True
    _set(status, "succeeded", ix.total(succeeded))
    if text:
        status["completedIndexes"] = text
    else:
        status.pop("completedIndexes", None)
    if failed_indexes is not None:
        failed_text = ix.format_intervals(failed_indexes)
        if old.get("failedIndexes") != failed_text:
            needs_flush = True
        status["failedIndexes"] = failed_text
    if finished is not None and finished["type"] == "FailureTarget":
        conditions.append(finished)
        needs_flush = True
        finished = condition("Failed", finished["reason"], finished["message"], now)
    elif success_met:
        assert finished is not None
        if _has(conditions, "SuccessCriteriaMet") is None:
            conditions.append(finished)
            needs_flush = True
        finished = condition("Complete", finished["reason"], finished["message"], now)
    _set_conditions(status, conditions)
    if needs_flush:
        plan.first = copy.deepcopy(status)
        plan.backoff = new_record
    removed = {p.uid for p in plan.remove_finalizer}
    final_flush = _clean_uncounted(status, unc_succeeded, unc_failed, with_finalizer - removed)
    unc = status.get("uncountedTerminatedPods") or {}
    if (
        finished is not None
        and not unc.get("succeeded")
        and not unc.get("failed")
        and terminating == 0
        and not reached_max
    ):
        _ensure_condition(conditions, finished["type"], "True", finished["reason"], finished["message"], now)
        _set_conditions(status, conditions)
        if finished["type"] == "Complete":
            status["completionTime"] = rfc3339(now)
        plan.finished = finished
        final_flush = True
    if final_flush:
        plan.final = status
    return plan


def _set(status: dict[str, Any], key: str, value: int) -> None:
    if value:
        status[key] = value
    else:
        status.pop(key, None)


def _set_conditions(status: dict[str, Any], conditions: list[dict[str, Any]]) -> None:
    if conditions:
        status["conditions"] = conditions
    else:
        status.pop("conditions", None)


def _set_uncounted(status: dict[str, Any], succeeded: list[str], failed: list[str]) -> None:
    value: dict[str, Any] = {}
    if succeeded:
        value["succeeded"] = list(succeeded)
    if failed:
        value["failed"] = list(failed)
    status["uncountedTerminatedPods"] = value


def _clean_uncounted(status: dict[str, Any], succeeded: list[str], failed: list[str], with_finalizer: set[str]) -> bool:
    """cleanUncountedPodsWithoutFinalizers: uids whose finalizer is off move into the counters
    (`succeeded`/`failed` are the lists kept in step, changed in place)."""
    changed = False
    for key, uids in (("succeeded", succeeded), ("failed", failed)):
        keep = [u for u in uids if u in with_finalizer]
        if len(keep) != len(uids):
            changed = True
            if key == "failed":
                _set(status, key, status.get(key, 0) + len(uids) - len(keep))
            uids[:] = keep
    _set_uncounted(status, succeeded, failed)
    return changed


def _manage(
    plan: IndexedPlan,
    spec: dict[str, Any],
    active: list[IndexedPod],
    pods: list[IndexedPod],
    succeeded: list[ix.Interval],
    failed_indexes: list[ix.Interval] | None,
    delayed: dict[int, IndexedPod],
    record: BackoffRecord,
    now: float,
    *,
    completions: int,
    parallelism: int,
    per_index: bool,
    only_failed: bool,
    terminating: int,
    ready: int,
    backoff_base: float,
    backoff_max: float,
) -> tuple[int, int, int]:
    """manageJob for an Indexed Job: returns active, terminating and ready after its deletes and
    creates."""
    n_active = len(active)
    if spec.get("suspend"):
        rm = pods_for_removal(active, completions, n_active)
        plan.delete_uncounted += rm
        return n_active - len(rm), terminating + len(rm), ready - sum(1 for p in rm if p.ready)
    want = max(0, min(completions - ix.total(succeeded), parallelism))
    rm = pods_for_removal(active, completions, max(0, n_active - want))[:MAX_CREATE_DELETE]
    if rm:
        plan.delete_uncounted += rm
        return n_active - len(rm), terminating + len(rm), ready - sum(1 for p in rm if p.ready)
    diff = want - (terminating if only_failed else 0) - n_active
    if diff <= 0:
        return n_active, terminating, ready
    if not per_index and record.failures and record.last_failure is not None:
        wait = _backoff(backoff_base, backoff_max, record.failures) - (now - record.last_failure)
        if wait > 0:
            plan.wake_at(now + wait)
            return n_active, terminating, ready
    diff = min(diff, MAX_CREATE_DELETE)
    busy = ix.with_indexes(succeeded, (p.index for p in active if p.index >= 0))
    if only_failed:
        busy = ix.with_indexes(busy, (p.index for p in pods if p.terminating and p.index >= 0))
    if failed_indexes is not None:
        busy = ix.merge(busy, failed_indexes)
    pending = ix.first_missing(busy, completions, diff)
    if per_index:
        now_ok, soonest = [], None
        for i in pending:
            last = delayed.get(i)
            wait = 0.0
            if last is not None:
                delay = _backoff(backoff_base, backoff_max, last.failure_count + last.ignored_count + 1)
                wait = max(0.0, delay - (now - last.finished_at))
            if wait <= 0:
                now_ok.append(i)
            elif soonest is None or wait < soonest:
                soonest = wait
        if not now_ok and soonest is not None:
            plan.wake_at(now + soonest)
            return n_active, terminating, ready
        pending = now_ok
    for i in pending:
        failures: int | None = None
        ignored = 0
        if per_index:
            last = delayed.get(i)
            failures = 0
            if last is not None:
                failures, ignored = last.failure_count, last.ignored_count
                if last.policy is None or last.policy.action != "Ignore" or spec.get("podFailurePolicy") is None:
                    failures += 1
                else:
                    ignored += 1
        plan.create.append(NewPod(i, failures, ignored))
    return n_active + len(pending), terminating, ready


def generate_name(job_name: str, index: int) -> str:
    """podGenerateNameWithIndex: `<job>-<index>-`, the job name cut so that it fits."""
    suffix = f"-{index}-"
    prefix = job_name + suffix
    if len(prefix) > MAX_GENERATED_NAME:
        prefix = prefix[: MAX_GENERATED_NAME - len(suffix)] + suffix
    return prefix


def add_index(pod: dict[str, Any], job_name: str, new: NewPod) -> None:
    """What manageJob adds to an Indexed Job's Pod: the index (annotation, label, env from the
    label through the downward API), the hostname, the per-index failure counts."""
    meta = pod["metadata"]
    meta["generateName"] = generate_name(job_name, new.index)
    annotations = dict(meta.get("annotations") or {})
    annotations[COMPLETION_INDEX] = str(new.index)
    if new.failure_count is not None:
        annotations[FAILURE_COUNT] = str(new.failure_count)
        if new.ignored_count > 0:
            annotations[IGNORED_FAILURE_COUNT] = str(new.ignored_count)
    meta["annotations"] = annotations
    meta["labels"] = {**(meta.get("labels") or {}), COMPLETION_INDEX: str(new.index)}
    spec = pod["spec"]
    for key in ("initContainers", "containers"):
        for c in spec.get(key) or []:
            env = list(c.get("env") or [])
            if not any(v.get("name") == INDEX_ENV for v in env):
                env.append(
                    {
                        "name": INDEX_ENV,
                        "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{COMPLETION_INDEX}']"}},
                    }
                )
            c["env"] = env
    spec["hostname"] = f"{job_name}-{new.index}"
