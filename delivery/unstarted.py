"""A Job whose container never starts (a bad image, a missing Secret, no node that fits): read its
Pending Pods, and give up on it with the cause the start clocks name (`workers.pod_health`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from k8s_dispatch.core.errors import DispatchError
from k8s_dispatch.delivery import terminal
from k8s_dispatch.delivery.cleanup import SELECTOR_CHUNK, pods_by_job, release_job, release_pods
from k8s_dispatch.delivery.records import load_record
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.store.models import DispatchState
from k8s_dispatch.workers import failure_detail
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.pod_health import Verdict

log = logging.getLogger(__name__)


def pending_pods(rt: Runtime, namespace: str, dispatch_ids: Sequence[str]) -> list[dict[str, Any]]:
    """Our Pending Pods of these dispatches in one namespace: ONE LIST per SELECTOR_CHUNK ids (a
    label selector on our deployment and the dispatch ids, a field selector on the phase), so a
    sweep's page of unstarted Jobs costs one request."""
    ids = sorted(set(dispatch_ids))
    base = job_labels.selector(rt.settings.effective_deployment)
    pods: list[dict[str, Any]] = []
    for start in range(0, len(ids), SELECTOR_CHUNK):
        selector = f"{base},{job_labels.DISPATCH_ID_KEY} in ({','.join(ids[start : start + SELECTOR_CHUNK])})"
        for page in rt.kube.iter_pods(
            namespace, label_selector=selector, field_selector=PENDING_PODS, page_size=rt.settings.poll_page_size
        ):
            pods.extend(page)
    return pods


PENDING_PODS = "status.phase=Pending"


def fail_unstarted(
    rt: Runtime,
    namespace: str,
    name: str,
    *,
    dispatch_id: str,
    attempts: int,
    snapshot: Mapping[str, Any],
    decide: Callable[[list[dict[str, Any]], list[dict[str, Any]]], Verdict],
) -> Verdict | None:
    """Give up on a Job whose container never started: WORKER_FAILED with the cause `decide`
    names (the one terminal-event path: `fail_dispatch`), with the failure's structured detail
    (the Pod's state, the Job's and its Pods' Warning Events), then the Job released and deleted,
    which stops its Pods; the verdict if this call recorded it, else None.

    `decide(pods, events)` judges the Job; the Warning Events are read (one LIST for the Job and
    one per Pod, with field selectors) only once it says to give up, and it is asked again with
    them, so a Job whose Pods were refused ends with the controller's FailedCreate.

    Under the dispatch's guard claim, the row must still be CREATED with the `attempts` counted
    when planned; the Job's Pods are read again, every phase (a Pod that started since the
    Pending LIST, or whose start the Job's status had not counted yet, says wait), and `decide`
    judges them. A crash after the event leaves the Job to the sweep's clean-up (category 4).

    Raises:
        Transient: the API, database or Redis is unavailable; the next sweep tries again.
    """
    claim = rt.guard.claim(dispatch_id)
    if claim is None:
        return None  # another replica is delivering it
    try:
        record = load_record(rt, dispatch_id)
        if record is None or record.state is not DispatchState.CREATED or record.attempts != attempts:
            return None
        pods = pods_by_job(rt, namespace, [name])[name]
        if not decide(pods, []).fail:
            return None
        events = _warnings_about(rt, namespace, [name, *(_pod_name(pod) for pod in pods)])
        verdict = decide(pods, events)
        if not verdict.fail:
            return None
        log.warning(
            "dispatch %s: job %s/%s never started its container: %s: %s",
            dispatch_id, namespace, name, verdict.reason, verdict.message,
        )  # fmt: skip
        detail = failure_detail.detail(snapshot, pods[0] if pods else None, events=events)
        reason = verdict.reason or "StartTimeout"
        if not terminal.fail_dispatch(rt, dispatch_id, reason=reason, message=verdict.message, detail=detail):
            return None
    finally:
        rt.guard.release(claim)
    release_pods(rt, namespace, pods)
    release_job(rt, namespace, name, snapshot=snapshot)
    rt.kube.delete_job(namespace, name, propagation="Background", uid=(snapshot.get("metadata") or {}).get("uid"))
    return verdict


def _warnings_about(rt: Runtime, namespace: str, names: Sequence[str]) -> list[dict[str, Any]]:
    """The Warning Events whose object is one of `names` (a Job, its Pods); none if unreadable."""
    events: list[dict[str, Any]] = []
    try:
        for name in dict.fromkeys(n for n in names if n):
            selector = f"involvedObject.name={name},type={failure_detail.WARNING}"
            for page in rt.kube.iter_events(namespace, field_selector=selector):
                events += page
    except DispatchError as e:
        log.info("the warning events of %s/%s could not be read (%s)", namespace, names[0], e.reason)
    return events


def _pod_name(pod: Mapping[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("name") or "")
