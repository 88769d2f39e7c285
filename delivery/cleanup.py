"""After a dispatch's end: our finalizer off its Pods and its Job, the Job labelled delivered, and
delivered Jobs removed in bulk (one request per namespace); a Job that may still run stopped.
Each step is idempotent, exact by the uid a snapshot carries: a Job re-created under the same name
since is never touched."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

import redis

from k8s_dispatch import artifacts
from k8s_dispatch.artifacts import logs
from k8s_dispatch.core.errors import Transient
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.workers import failure_detail
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.manifest import FINALIZER

log = logging.getLogger(__name__)

JOB_NAME_LABEL = "batch.kubernetes.io/job-name"  # set by the Job controller on the Job's Pods
# Job names per `job-name in (...)` Pod selector: 100 names of 39 characters make ~4 KB.
SELECTOR_CHUNK = 100


def pods_by_job(rt: Runtime, namespace: str, names: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
    """The Pods of the named Jobs of one namespace, by Job name: one `job-name in (...)` LIST
    per chunk of names."""
    names = sorted(set(names))
    by_job: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for start in range(0, len(names), SELECTOR_CHUNK):
        chunk = names[start : start + SELECTOR_CHUNK]
        selector = f"{JOB_NAME_LABEL} in ({','.join(chunk)})" if len(chunk) > 1 else f"{JOB_NAME_LABEL}={chunk[0]}"
        for pod in rt.kube.list_pods(namespace, label_selector=selector):
            owner = ((pod.get("metadata") or {}).get("labels") or {}).get(JOB_NAME_LABEL)
            if owner in by_job:
                by_job[owner].append(pod)
    return by_job


def controller_uids(pod: Mapping[str, Any]) -> set[str]:
    """The uids of the Jobs a Pod names as its controller (ownerReference, or the label an orphan keeps)."""
    metadata = pod.get("metadata") or {}
    owners = {o.get("uid") for o in metadata.get("ownerReferences") or [] if o.get("controller")}
    return owners | {v for k, v in (metadata.get("labels") or {}).items() if k == "batch.kubernetes.io/controller-uid"}


def cleanup_job(
    rt: Runtime, namespace: str, name: str, *, snapshot: Mapping[str, Any] | None = None, delivered: bool = True
) -> None:
    """Release a Job that may still run (a cancelled dispatch's, an orphan) and its Pods, and
    delete it now, which stops it; idempotent. Released first, so that if the DELETE fails, a
    delivered Job is left to the next bulk delete (an orphan, `delivered=False`, to the next
    sweep). A Pod the Job controller creates after the Pods' LIST is freed by the sweep.
    """
    release_pods(rt, namespace, pods_by_job(rt, namespace, [name])[name])
    release_job(rt, namespace, name, snapshot=snapshot, delivered=delivered)
    rt.kube.delete_job(namespace, name, propagation="Background")


def release_job(
    rt: Runtime, namespace: str, name: str, *, snapshot: Mapping[str, Any] | None = None, delivered: bool = True
) -> bool:
    """The clean-up after a recorded end, in ONE patch: our finalizer off, the delivered label on
    (`KubeClient.release_job`, exact by uid); the bulk delete (`delete_delivered`) then removes it.

    `snapshot` is the Job as last read, so no GET is needed; without it the Job is read first.
    `delivered=False` (an orphan: no dispatch of its own ended) only takes the finalizer off.
    """
    label = (job_labels.DELIVERED_LABEL, job_labels.DELIVERED) if delivered else None
    return rt.kube.release_job(namespace, name, finalizer=FINALIZER, label=label, snapshot=snapshot)


def release_pods(rt: Runtime, namespace: str, pods: Iterable[Mapping[str, Any]], *, now: datetime | None = None) -> int:
    """Take our finalizer off Pods as a LIST read them, one patch per Pod that has it (none for
    the rest) that also labels it released (`labels.RELEASED_LABEL`); how many this call freed.
    Called once their result is recorded, or not wanted.
    First the logs their capability's `archiveLogs` keeps go to the object store (`artifacts.logs`;
    `now` against their containers' end, for a log that cannot be read).

    Raises:
        PodLogUnavailable: a log could not be read for now (its container ended less than
            `logs.UNREADABLE_GRACE_S` ago); no Pod was freed (retried later).
        ObjectStoreUnavailable: a log could not be stored; no Pod was freed (retried later).
    """
    held = [pod for pod in pods if FINALIZER in ((pod.get("metadata") or {}).get("finalizers") or [])]
    logs.archive_logs(
        artifacts.for_settings(rt.settings), rt.kube, rt.resolver, namespace,
        [failure_detail.pod_log(p) for p in held], now=now,
    )  # fmt: skip
    released = (job_labels.RELEASED_LABEL, job_labels.RELEASED)
    return sum(rt.kube.release_pod(namespace, pod, finalizer=FINALIZER, label=released) for pod in held)


def delete_delivered(rt: Runtime, namespace: str) -> list[dict[str, Any]]:
    """Delete every delivered Job of this deployment in the namespace, their Pods in the
    background: ONE request (another deployment's Jobs are never selected); the Jobs it matched.

    A failure here loses nothing: the next batch's bulk delete, or the sweep's, removes them.
    """
    selector = job_labels.delivered_selector(rt.settings.effective_deployment)
    return rt.kube.delete_jobs(namespace, label_selector=selector, propagation="Background")


def label_deployment(rt: Runtime, namespace: str, name: str, *, snapshot: Mapping[str, Any]) -> bool:
    """Put this deployment's label on a Job of its own made before the label existed (one
    patch, exact by the snapshot's uid): from then on poll, sweep and bulk delete select it."""
    label = (job_labels.DEPLOYMENT_LABEL, rt.settings.effective_deployment)
    return rt.kube.label_job(namespace, name, label=label, snapshot=snapshot)


def delete_delivered_later(rt: Runtime, namespace: str) -> None:
    """Leave the bulk delete of the Jobs just released in `namespace` to the next cleanup
    (`delete_noted`, beat's `cleanup` task), with a note in Redis: one bulk delete per cleanup
    interval, not one per batch. Where Redis cannot take the note, the bulk delete is made now (a failure of it only
    logged: the sweep's removes those Jobs)."""
    try:
        rt.redis.set(_noted_key(rt, namespace), "1")
        return
    except redis.RedisError as e:
        log.info("could not note delivered jobs in %s for the next cleanup (%s); deleting them now", namespace, e)
    try:
        delete_delivered(rt, namespace)
    except Transient as e:
        log.warning("bulk delete of delivered jobs in %s failed (%s); the sweep's removes them", namespace, e)


def delete_noted(rt: Runtime, namespace: str) -> int:
    """Cleanup's bulk delete: the delivered Jobs of `namespace`, if any were noted since the last
    one (`delete_delivered_later`); how many. A failure is logged and the note put back.

    Raises:
        redis.RedisError: Redis is unavailable (cleanup stops, as on any Redis error).
    """
    if not rt.redis.getdel(_noted_key(rt, namespace)):
        return 0
    try:
        return len(delete_delivered(rt, namespace))
    except Transient as e:
        log.warning("bulk delete of delivered jobs in %s failed (%s); the next cleanup tries again", namespace, e)
        rt.redis.set(_noted_key(rt, namespace), "1")
        return 0


def _noted_key(rt: Runtime, namespace: str) -> str:
    return f"{rt.settings.key_prefix}:delivered:{namespace}"
