"""A stopping worker's last pass: what our Pods being deleted hold is recorded, then they are let go.

A node drain evicts our Job Pods and the workers on that node together, and waits for every Pod it
evicted to be gone. Our finalizer keeps an evicted Pod until a worker has read it; when the
drained node ran every worker (one node, or all replicas on it), no worker is left to read it and
the drain never ends. So a worker told to stop (SIGTERM, Celery's warm shutdown) sorts its
deployment's Pods being deleted (`leaving`, then `may_end_job`, pure) and delivers each through the
path a running deployment uses, or lets it go where it holds nothing anyone wants:
- a Pod whose dispatch has ended in the database (cancelled, failed, delivered by another replica)
  is let go at once (one read of the database for the look);
- a disrupted Pod is recorded once as WORKER_DISRUPTED, spending no attempt
  (`disruptions.record_pods`; the Job runs it again once a node takes its new Pod);
- a map's finished Pod is delivered as its item (`items.deliver_maps`), while its Job runs;
- a finished Job's end is recorded once (`complete.complete_jobs`);
- a failed Pod its running Job will run again (`may_end_job` False) is let go: the Job's end is
  told by the Pod it ends on (the latest failure, or a success), never by an earlier failure;
- the rest (still running, or a failure the Job may end on) is waited for, each at most its own
  grace period and `SETTLE_S`.
Each is freed after its record, never before. What the bound leaves keeps the finalizer, for the
next worker's poll and sweep: a worker killed mid-pass loses nothing either.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from k8s_dispatch.core.errors import LabelMismatch, NotFound, Transient
from k8s_dispatch.delivery import complete, disruptions, items
from k8s_dispatch.delivery.cleanup import JOB_NAME_LABEL, controller_uids, release_pods
from k8s_dispatch.delivery.records import load_records
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.workers import failure_detail
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.indexed import is_map_job
from k8s_dispatch.workers.job_status import job_state
from k8s_dispatch.workers.manifest import FINALIZER
from k8s_dispatch.workers.types import DispatchRef

log = logging.getLogger(__name__)

# After a Pod's grace period, how long the kubelet's report of its end and the Job controller's
# count of it may take before the pass stops waiting for it.
SETTLE_S = 15.0
# The whole pass, however many Pods keep being deleted: the chart's worker grace period
# (terminationGracePeriodSeconds, 120 s) holds Celery's warm shutdown (running tasks end first:
# poll's watch is held up to 30 s) and this.
MAX_S = 60.0
INTERVAL_S = 1.0  # between two looks at the Pods still being deleted
ENDED = ("Succeeded", "Failed")
DEFAULT_BACKOFF_LIMIT = 6  # the Job API's default `backoffLimit`
# What a podFailurePolicy rule does with a failed Pod: it cannot end the Job (Ignore), counts
# against backoffLimit (Count), or ends it (FailJob; FailIndex, a map's, ends its index).
_NOT_COUNTED, _COUNTED = "Ignore", "Count"


@dataclass(frozen=True)
class Leaving:
    """Our Pods being deleted in one namespace, as one LIST read them, sorted (pure)."""

    ended: list[Mapping[str, Any]] = field(default_factory=list)  # their dispatch ended: freed at once
    disrupted: list[Mapping[str, Any]] = field(default_factory=list)  # ended by an eviction: recorded, then freed
    finished: dict[str, list[Mapping[str, Any]]] = field(default_factory=dict)  # ended otherwise, by Job name
    running: list[Mapping[str, Any]] = field(default_factory=list)  # not ended yet: waited for

    @property
    def pods(self) -> list[Mapping[str, Any]]:
        finished = (p for pods in self.finished.values() for p in pods)
        return [*self.ended, *self.disrupted, *finished, *self.running]


def held(pods: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The Pods being deleted that our finalizer still holds (pure)."""
    return [
        pod
        for pod in pods
        if (metadata := pod.get("metadata") or {}).get("deletionTimestamp")
        and FINALIZER in (metadata.get("finalizers") or [])
    ]


def dispatch_ref(pod: Mapping[str, Any]) -> DispatchRef | None:
    """The dispatch a Pod's labels name (its Job's template gave them), None if they are not ours."""
    metadata = pod.get("metadata") or {}
    try:
        return job_labels.decode(metadata.get("labels"), metadata.get("annotations"))
    except LabelMismatch:
        return None


def leaving(pods: Sequence[Mapping[str, Any]], *, ended: Collection[DispatchRef] = ()) -> Leaving:
    """Sort the Pods being deleted that our finalizer still holds by what frees them (pure).
    `ended`: the dispatches the database says have ended, as their rows name them (a Pod whose
    labels disagree with its row is no Pod of that dispatch: never freed for it)."""
    sorted_ = Leaving()
    for pod in held(pods):
        metadata = pod.get("metadata") or {}
        if ended and dispatch_ref(pod) in ended:
            sorted_.ended.append(pod)
        elif (pod.get("status") or {}).get("phase") not in ENDED:
            sorted_.running.append(pod)
        elif failure_detail.disruptions([pod]):
            sorted_.disrupted.append(pod)
        else:
            job = str((metadata.get("labels") or {}).get(JOB_NAME_LABEL, ""))
            sorted_.finished.setdefault(job, []).append(pod)
    return sorted_


def may_end_job(job: Mapping[str, Any], pod: Mapping[str, Any]) -> bool:
    """Whether a running (not map) Job may end on this failed Pod of its (pure), so that its
    termination may be the one that says why the dispatch failed: its exit code or conditions
    match a podFailurePolicy rule that ends the Job, or the Job's failures counted so far leave
    no backoff (`backoffLimit` ≤ failures: this Pod, counted or not yet, may be the one over it).
    A Pod the policy ignores cannot end it; nor can one counted while backoff is left, which the
    Job runs again: the latest failure, or a success, then speaks for the Job. A Pod of another
    Job (an earlier one of the same name), or a rule not understood here, may: it is waited for.

    Not weighed: the Job's `activeDeadlineSeconds` may end it while its next Pod runs or waits; the
    failure is then the deadline's (DeadlineExceeded), told by the latest Pod still there."""
    metadata, spec = job.get("metadata") or {}, job.get("spec") or {}
    if not controller_uids(pod) <= {metadata.get("uid")}:
        return True
    for rule in (spec.get("podFailurePolicy") or {}).get("rules") or []:
        if _matches(rule, pod):
            action = rule.get("action")
            if action == _NOT_COUNTED:
                return False
            if action != _COUNTED:
                return True
            break
    limit = spec.get("backoffLimit", DEFAULT_BACKOFF_LIMIT)
    if not isinstance(limit, int) or isinstance(limit, bool):
        return True
    status = job.get("status") or {}
    counted = status.get("failed")
    failures = counted if isinstance(counted, int) and not isinstance(counted, bool) else 0
    failures += len((status.get("uncountedTerminatedPods") or {}).get("failed") or [])
    return failures >= limit


def _matches(rule: Mapping[str, Any], pod: Mapping[str, Any]) -> bool:
    """Whether a podFailurePolicy rule matches a failed Pod, as the Job controller reads it."""
    status = pod.get("status") or {}
    codes = rule.get("onExitCodes")
    if isinstance(codes, Mapping):
        name, values = codes.get("containerName"), set(codes.get("values") or [])
        exits = [
            terminated.get("exitCode")
            for s in status.get("containerStatuses") or []
            if (name is None or s.get("name") == name)
            and isinstance(terminated := (s.get("state") or {}).get("terminated"), Mapping)
        ]
        exits = [code for code in exits if isinstance(code, int) and code != 0]
        if codes.get("operator") == "NotIn":
            return any(code not in values for code in exits)
        return any(code in values for code in exits)
    wanted = {(c.get("type"), c.get("status", "True")) for c in rule.get("onPodConditions") or []}
    return any((c.get("type"), c.get("status")) in wanted for c in status.get("conditions") or [])


def waited_s(pod: Mapping[str, Any]) -> float:
    """How long the pass waits for a Pod from when it first saw it being deleted (pure): its grace
    period (what the kubelet gives it to end) and SETTLE_S."""
    grace = (pod.get("metadata") or {}).get("deletionGracePeriodSeconds")
    return (grace if isinstance(grace, int) and grace > 0 else 0) + SETTLE_S


@dataclass
class Pass:
    """What a last pass did: the Pods it saw being deleted (uids) by what it made of them, and
    those still held when it stopped."""

    ended: set[str] = field(default_factory=set)  # their dispatch had ended: let go
    disrupted: set[str] = field(default_factory=set)  # handed to the disruptions' record (then freed)
    finished: set[str] = field(default_factory=set)  # whose Job's end, or map item, was delivered
    retried: set[str] = field(default_factory=set)  # failures their Job runs again: let go
    left: list[str] = field(default_factory=list)  # namespace/name still held when it stopped
    # A running map's Pods handed to `deliver_maps`: counted finished once no look finds them held.
    handed: set[str] = field(default_factory=set)


def last_pass(
    rt: Runtime,
    *,
    clock: Callable[[], float] = time.monotonic,
    wait: Callable[[float], object] | None = None,
    max_s: float = MAX_S,
    interval_s: float = INTERVAL_S,
) -> Pass:
    """Deliver what our Pods being deleted hold, in every namespace of ours, and look again until
    none is left or each has had its time (`waited_s`; `max_s` in all). Never raises a Transient
    error: one is logged and the next look tries again (for SETTLE_S at most when nothing else is
    waited for); whatever is left keeps our finalizer for the next worker."""
    pause = wait or threading.Event().wait
    done = Pass()
    started = clock()
    first_seen: dict[str, float] = {}
    while True:
        now = clock()
        still: list[str] = []
        waiting = False
        for namespace in rt.namespaces():
            try:
                found = _look(rt, namespace, done)
            except Transient as e:  # looked at again for SETTLE_S at most: an outage does not hold the stop
                log.warning("last pass in %s: %s", namespace, e)
                waiting = waiting or now < started + SETTLE_S
                continue
            for pod in found:
                metadata = pod.get("metadata") or {}
                seen = first_seen.setdefault(str(metadata.get("uid", "")), now)
                still.append(f"{namespace}/{metadata.get('name')}")
                waiting = waiting or now < seen + waited_s(pod)
        if not still and not waiting:
            break
        if not waiting or clock() - started >= max_s:
            done.left = sorted(still)
            log.warning("stopping with %d pod(s) of ours still being deleted: %s", len(still), ", ".join(done.left))
            break
        pause(interval_s)
    if first_seen:
        log.info(
            "last pass: %d pod(s) of ours were being deleted: %d disrupted, %d finished delivered, "
            "%d of ended dispatches and %d retried let go, %d left",
            len(first_seen), len(done.disrupted), len(done.finished), len(done.ended), len(done.retried),
            len(done.left),
        )  # fmt: skip
    return done


def _uid(pod: Mapping[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("uid", ""))


def _look(rt: Runtime, namespace: str, done: Pass) -> list[Mapping[str, Any]]:
    """One look at `namespace`: our Pods being deleted there (as listed, before this look acted),
    and what they hold delivered where it can be now: those of ended dispatches let go, the
    disrupted ones recorded, a map's finished ones delivered as items, the others' Jobs completed
    once their Job has ended too (the Job controller counts a Pod a moment after its end), and
    failures their running Job retries let go.

    Raises:
        Transient: the API, the database, Redis or the object store is unavailable.
    """
    pods: list[Mapping[str, Any]] = []
    for page in rt.kube.iter_pods(
        namespace,
        label_selector=job_labels.selector(rt.settings.effective_deployment),
        page_size=rt.settings.poll_page_size,
    ):
        pods += held(page)
    listed = {_uid(p) for p in pods}
    done.finished |= done.handed - listed  # a running map's Pods its hand-off freed
    done.handed &= listed
    if not pods:
        return []
    refs = {ref for ref in map(dispatch_ref, pods) if ref is not None}
    records = load_records(rt, sorted({ref.dispatch_id for ref in refs})) if refs else {}
    found = leaving(pods, ended={r.ref for r in records.values() if r.terminal})
    if found.ended:  # nothing they hold is wanted any more
        release_pods(rt, namespace, found.ended)
        done.ended |= {_uid(p) for p in found.ended}
    if found.disrupted:
        disruptions.record_pods(rt, namespace, found.disrupted)
        done.disrupted |= {_uid(p) for p in found.disrupted}
    maps, ended_jobs, retried = [], [], []
    for name in sorted(found.finished):
        if not name:  # not a Job's Pod (no job-name label): nothing here reads it
            continue
        try:
            job = rt.kube.get_job(namespace, name)
        except NotFound:  # a Pod whose Job is gone: the sweep's to judge, never freed unread here
            continue
        if is_map_job(job):  # running or ended: its items as their Pods finished
            maps.append(job)
        elif job_state(job).terminal:
            ended_jobs.append(job)
        else:
            retried += [p for p in found.finished[name] if _phase(p) == "Failed" and not may_end_job(job, p)]
    if retried:
        release_pods(rt, namespace, retried)
        done.retried |= {_uid(p) for p in retried}
    error: Transient | None = None
    if maps:
        mapped = items.deliver_maps(rt, namespace, maps)
        for job, result in zip(maps, mapped.outcomes, strict=False):
            uids = {_uid(p) for p in found.finished.get(str(job["metadata"]["name"]), [])}
            if result == items.RUNNING:
                done.handed |= uids
            elif result in (items.COMPLETED, items.ALREADY_TERMINAL):
                done.finished |= uids
        error = mapped.error
    if ended_jobs:
        outcome = complete.complete_jobs(rt, namespace, ended_jobs)
        for job, result in zip(ended_jobs, outcome.outcomes, strict=False):
            if result in (complete.CompleteOutcome.COMPLETED, complete.CompleteOutcome.ALREADY_TERMINAL):
                done.finished |= {_uid(p) for p in found.finished.get(str(job["metadata"]["name"]), [])}
        error = error or outcome.error
    if error is not None:
        raise error
    return found.pods


def _phase(pod: Mapping[str, Any]) -> str:
    return str((pod.get("status") or {}).get("phase", ""))
