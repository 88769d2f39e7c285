"""What the Job controller decides for one Job (pure): given the Job, its Pods and "now", the new
status, which finished Pods to count (their tracking finalizer then comes off), how many Pods to
create, which to delete, whether the Job's TTL has run out and when to look again.

Semantics follow pkg/controller/job (Kubernetes 1.31+): SuccessCriteriaMet then Complete;
FailureTarget then Failed (BackoffLimitExceeded, DeadlineExceeded) once no Pod is terminating;
backoffLimit counts failed Pods (and container restarts for restartPolicy OnFailure); pods are
re-created after an exponential backoff; suspend deletes active Pods, uncounted (their tracking
finalizer comes off first, as deleteJobPods does: a suspend is not a failure). A podFailurePolicy's rule
(demo/localcluster/failurepolicy.py) leaves a failed Pod uncounted (Ignore: it is replaced, once it has
failed, without counting against backoffLimit) or fails the Job at once (FailJob: reason
PodFailurePolicy).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from k8s_dispatch.demo.localcluster.failurepolicy import REASON as POLICY_REASON
from k8s_dispatch.demo.localcluster.failurepolicy import Match, match
from k8s_dispatch.demo.localcluster.timestamps import parse_rfc3339, rfc3339

TRACKING_FINALIZER = "batch.kubernetes.io/job-tracking"
BACKOFF_LIMIT_EXCEEDED = ("BackoffLimitExceeded", "Job has reached the specified backoff limit")
DEADLINE_EXCEEDED = ("DeadlineExceeded", "Job was active longer than specified deadline")
COMPLETIONS_REACHED = ("CompletionsReached", "Reached expected number of succeeded pods")


@dataclass(frozen=True)
class PodView:
    """What the controller needs to know of one of its Pods."""

    namespace: str
    name: str
    uid: str
    phase: str
    deleting: bool
    tracked: bool
    ready: bool
    restarts: int
    created: str
    policy: Match | None = None  # the podFailurePolicy rule a failed Pod matches

    @property
    def terminal(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    @property
    def active(self) -> bool:
        return not self.terminal and not self.deleting

    @property
    def terminating(self) -> bool:
        return not self.terminal and self.deleting


def pod_view(pod: dict[str, Any], policy: dict[str, Any] | None = None) -> PodView:
    """What the controller needs of `pod`; with the Job's `policy`, the rule a failed Pod matches."""
    meta = pod["metadata"]
    status = pod.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    restarts = sum(cs.get("restartCount", 0) for cs in status.get("containerStatuses") or [])
    return PodView(
        meta.get("namespace", ""),
        meta["name"],
        meta.get("uid", ""),
        status.get("phase", "Pending"),
        bool(meta.get("deletionTimestamp")),
        TRACKING_FINALIZER in (meta.get("finalizers") or []),
        ready,
        restarts,
        meta.get("creationTimestamp", ""),
        match(policy, pod),
    )


@dataclass
class Plan:
    status: dict[str, Any]
    count: list[PodView] = field(default_factory=list)  # terminal pods counted now: drop their finalizer
    create: int = 0
    delete: list[PodView] = field(default_factory=list)  # their ends counted (a failed Job's, a finished one's)
    # Deleted with their tracking finalizer off first (deleteJobPods: suspended, past the
    # parallelism): their ends are never counted, so a suspend costs no backoffLimit.
    uncount: list[PodView] = field(default_factory=list)
    new_failures: int = 0
    started: bool = False  # startTime was set now
    finished: bool = False  # a terminal condition was added now
    delete_job: bool = False  # ttlSecondsAfterFinished ran out
    requeue_at: float | None = None

    def wake_at(self, when: float) -> None:
        self.requeue_at = when if self.requeue_at is None else min(self.requeue_at, when)


def condition(kind: str, reason: str, message: str, ts: float, *, status: str = "True") -> dict[str, Any]:
    t = rfc3339(ts)
    return {
        "type": kind,
        "status": status,
        "lastProbeTime": t,
        "lastTransitionTime": t,
        "reason": reason,
        "message": message,
    }


def _has(conditions: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    return next((c for c in conditions if c.get("type") == kind and c.get("status") == "True"), None)


def is_finished(job: dict[str, Any]) -> bool:
    conds = (job.get("status") or {}).get("conditions") or []
    return bool(_has(conds, "Complete") or _has(conds, "Failed"))


def _time(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return parse_rfc3339(text)
    except ValueError:
        return None


def plan_job(
    job: dict[str, Any],
    pods: list[PodView],
    now: float,
    *,
    start_at: float | None = None,
    finished_at: float | None = None,
    last_failure_at: float | None = None,
    backoff_base: float = 10.0,
    backoff_max: float = 360.0,
) -> Plan:
    """Decide one sync of `job`. `start_at`/`finished_at` are precise times the caller remembers
    (status times have second precision); `last_failure_at` is when a Pod failure was last counted."""
    spec = job.get("spec") or {}
    old = job.get("status") or {}
    status: dict[str, Any] = {k: v for k, v in old.items()}
    conditions = [dict(c) for c in old.get("conditions") or []]
    plan = Plan(status)

    succeeded, failed = old.get("succeeded", 0), old.get("failed", 0)
    fail_job: Match | None = None
    for p in pods:
        if p.tracked and p.terminal:
            plan.count.append(p)
            if p.phase == "Succeeded":
                succeeded += 1
            elif p.policy is not None and p.policy.action == "Ignore":
                continue  # a disruption: replaced, never counted
            else:
                failed += 1
                plan.new_failures += 1
                if p.policy is not None and p.policy.action == "FailJob" and fail_job is None:
                    fail_job = p.policy
    if plan.new_failures:
        last_failure_at = now
    active = [p for p in pods if p.active]
    terminating = [p for p in pods if p.terminating]
    # podReplacementPolicy Failed (the default with a podFailurePolicy): a terminating Pod is
    # replaced only once it has failed.
    replacing = terminating if spec.get("podReplacementPolicy") == "Failed" else []

    def write_counts(active_pods: list[PodView], created: int = 0) -> None:
        # as manageJob does, Pods this sync creates count as active at once (not yet as ready)
        for key, value in (("active", len(active_pods) + created), ("succeeded", succeeded), ("failed", failed)):
            if value:
                status[key] = value
            else:
                status.pop(key, None)
        status["ready"] = sum(1 for p in active_pods if p.ready)
        status["terminating"] = len(terminating)
        status["uncountedTerminatedPods"] = {}
        if conditions:
            status["conditions"] = conditions
        else:
            status.pop("conditions", None)

    if _has(conditions, "Complete") or _has(conditions, "Failed"):
        write_counts(active)
        ttl = spec.get("ttlSecondsAfterFinished")
        if ttl is not None and not (job["metadata"].get("deletionTimestamp")):
            done = finished_at
            if done is None:
                end = _has(conditions, "Complete") or _has(conditions, "Failed")
                done = _time(old.get("completionTime")) or _time((end or {}).get("lastTransitionTime")) or now
            if now >= done + ttl:
                plan.delete_job = True
            else:
                plan.wake_at(done + ttl)
        return plan
    if job["metadata"].get("deletionTimestamp"):
        write_counts(active)
        return plan

    if spec.get("suspend"):
        plan.uncount = list(active)
        if not _has(conditions, "Suspended"):
            conditions = [c for c in conditions if c.get("type") != "Suspended"]
            conditions.append(condition("Suspended", "JobSuspended", "Job suspended", now))
        status.pop("startTime", None)
        write_counts([])
        return plan
    suspended = next((c for c in conditions if c.get("type") == "Suspended"), None)
    if suspended is not None and suspended.get("status") == "True":
        conditions = [c for c in conditions if c.get("type") != "Suspended"]
        conditions.append(condition("Suspended", "JobResumed", "Job resumed", now, status="False"))
        status.pop("startTime", None)
        start_at = None
    if not status.get("startTime"):
        status["startTime"] = rfc3339(now)
        start_at = now
        plan.started = True
    start = start_at if start_at is not None else (_time(status.get("startTime")) or now)

    target = _has(conditions, "FailureTarget")
    if target is None:
        restarts = (
            sum(p.restarts for p in active)
            if (spec.get("template") or {}).get("spec", {}).get("restartPolicy") == "OnFailure"
            else 0
        )
        deadline = spec.get("activeDeadlineSeconds")
        why = None
        if fail_job is not None:
            why = (POLICY_REASON, fail_job.message)
        elif failed + restarts > spec.get("backoffLimit", 6):
            why = BACKOFF_LIMIT_EXCEEDED
        elif deadline is not None and now >= start + deadline:
            why = DEADLINE_EXCEEDED
        elif deadline is not None:
            plan.wake_at(start + deadline)
        if why is not None:
            target = condition("FailureTarget", why[0], why[1], now)
            conditions.append(target)
    if target is not None:
        plan.delete = list(active)
        if not active and not terminating:
            conditions.append(condition("Failed", target["reason"], target["message"], now))
            plan.finished = True
        write_counts([])
        return plan

    completions = spec.get("completions")
    parallelism = spec.get("parallelism", 1)
    done = (completions is not None and succeeded >= completions) or (
        completions is None and succeeded > 0 and not active
    )
    if done or _has(conditions, "SuccessCriteriaMet"):
        if not _has(conditions, "SuccessCriteriaMet"):
            conditions.append(condition("SuccessCriteriaMet", *COMPLETIONS_REACHED, now))
        plan.delete = list(active)
        if not active and not terminating:
            conditions.append(condition("Complete", *COMPLETIONS_REACHED, now))
            status["completionTime"] = rfc3339(now)
            plan.finished = True
        write_counts([])
        return plan

    wanted = parallelism if completions is None else min(parallelism, completions - succeeded)
    need = wanted - len(active)
    if need > 0:
        need = max(0, need - len(replacing))
    if need > 0 and failed and last_failure_at is not None:
        delay = min(backoff_base * 2 ** (failed - 1), backoff_max)
        if now < last_failure_at + delay:
            plan.wake_at(last_failure_at + delay)
            need = 0
    if need > 0:
        plan.create = need
    elif need < 0:
        plan.uncount = sorted(active, key=lambda p: p.created, reverse=True)[:-need]
    write_counts(active, plan.create)
    return plan
