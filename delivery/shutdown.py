"""A stopping worker's last pass: what our Pods being deleted hold is recorded, then they are let go.

A node drain evicts our Job Pods and the workers on that node together, and waits for every Pod it
evicted to be gone. Our finalizer keeps an evicted Pod until a worker has read it; when the
drained node ran every worker (one node, or all replicas on it), no worker is left to read it and
the drain never ends. So a worker told to stop (SIGTERM, Celery's warm shutdown) first waits for
its deployment's Pods being deleted to end, each at most its own grace period and `SETTLE_S`, and
delivers each through the path a running deployment uses: a disrupted Pod is recorded once as
WORKER_DISRUPTED, spending no attempt (`disruptions.record_pods`; the Job runs it again once a node
takes its new Pod); a finished Job's end is recorded once (`complete.complete_jobs`). Each releases
our finalizer after the record, never before. What the bound leaves keeps the finalizer, for the
next worker's poll and sweep: a worker killed mid-pass loses nothing either.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from k8s_dispatch.core.errors import NotFound, Transient
from k8s_dispatch.delivery import complete, disruptions
from k8s_dispatch.delivery.cleanup import JOB_NAME_LABEL
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.workers import failure_detail
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.job_status import job_state
from k8s_dispatch.workers.manifest import FINALIZER

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


@dataclass(frozen=True)
class Leaving:
    """Our Pods being deleted in one namespace, as one LIST read them, sorted (pure)."""

    disrupted: list[Mapping[str, Any]] = field(default_factory=list)  # ended by an eviction: recorded, then freed
    finished: dict[str, list[Mapping[str, Any]]] = field(default_factory=dict)  # ended otherwise, by Job name
    running: list[Mapping[str, Any]] = field(default_factory=list)  # not ended yet: waited for

    @property
    def pods(self) -> list[Mapping[str, Any]]:
        return [*self.disrupted, *(p for pods in self.finished.values() for p in pods), *self.running]


def leaving(pods: Sequence[Mapping[str, Any]]) -> Leaving:
    """Sort the Pods being deleted that our finalizer still holds by what frees them (pure)."""
    sorted_ = Leaving()
    for pod in pods:
        metadata = pod.get("metadata") or {}
        if not metadata.get("deletionTimestamp") or FINALIZER not in (metadata.get("finalizers") or []):
            continue
        if (pod.get("status") or {}).get("phase") not in ENDED:
            sorted_.running.append(pod)
        elif failure_detail.disruptions([pod]):
            sorted_.disrupted.append(pod)
        else:
            job = str((metadata.get("labels") or {}).get(JOB_NAME_LABEL, ""))
            sorted_.finished.setdefault(job, []).append(pod)
    return sorted_


def waited_s(pod: Mapping[str, Any]) -> float:
    """How long the pass waits for a Pod from when it first saw it being deleted (pure): its grace
    period (what the kubelet gives it to end) and SETTLE_S."""
    grace = (pod.get("metadata") or {}).get("deletionGracePeriodSeconds")
    return (grace if isinstance(grace, int) and grace > 0 else 0) + SETTLE_S


@dataclass
class Pass:
    """What a last pass did: the Pods it saw being deleted (uids) by what it made of them, and
    those still held when it stopped."""

    disrupted: set[str] = field(default_factory=set)  # handed to the disruptions' record (then freed)
    finished: set[str] = field(default_factory=set)  # whose Job's end was delivered
    left: list[str] = field(default_factory=list)  # namespace/name still held when it stopped


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
        held: list[str] = []
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
                held.append(f"{namespace}/{metadata.get('name')}")
                waiting = waiting or now < seen + waited_s(pod)
        if not held and not waiting:
            break
        if not waiting or clock() - started >= max_s:
            done.left = sorted(held)
            log.warning("stopping with %d pod(s) of ours still being deleted: %s", len(held), ", ".join(done.left))
            break
        pause(interval_s)
    if first_seen:
        log.info(
            "last pass: %d pod(s) of ours were being deleted: %d disrupted, %d finished delivered, %d left",
            len(first_seen), len(done.disrupted), len(done.finished), len(done.left),
        )  # fmt: skip
    return done


def _uid(pod: Mapping[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("uid", ""))


def _look(rt: Runtime, namespace: str, done: Pass) -> list[Mapping[str, Any]]:
    """One look at `namespace`: our Pods being deleted there (as listed, before this look acted),
    and what they hold delivered where it can be now: the disrupted ones recorded, the finished
    ones' Jobs completed once their Job has ended too (the Job controller counts a Pod a moment
    after its end).

    Raises:
        Transient: the API, the database or Redis is unavailable.
    """
    pods: list[Mapping[str, Any]] = []
    for page in rt.kube.iter_pods(
        namespace,
        label_selector=job_labels.selector(rt.settings.effective_deployment),
        page_size=rt.settings.poll_page_size,
    ):
        pods += page
    found = leaving(pods)
    if found.disrupted:
        disruptions.record_pods(rt, namespace, found.disrupted)
        done.disrupted |= {_uid(p) for p in found.disrupted}
    jobs = []
    for name in sorted(found.finished):
        if not name:  # not a Job's Pod (no job-name label): nothing here reads it
            continue
        try:
            job = rt.kube.get_job(namespace, name)
        except NotFound:  # a Pod whose Job is gone: the sweep's to judge, never freed unread here
            continue
        if job_state(job).terminal:
            jobs.append(job)
    if jobs:
        outcome = complete.complete_jobs(rt, namespace, jobs)
        for job, result in zip(jobs, outcome.outcomes, strict=False):
            if result in (complete.CompleteOutcome.COMPLETED, complete.CompleteOutcome.ALREADY_TERMINAL):
                done.finished |= {_uid(p) for p in found.finished.get(str(job["metadata"]["name"]), [])}
        if outcome.error is not None:
            raise outcome.error
    return found.pods
