"""The chaos run's witness of Job creation: a watch on our Jobs in every namespace, kept up through
API errors and restarts, noting each Job's dispatch, namespace and uid. A Job made and deleted
between two of its looks (a watch broken by a restart, then a LIST) is missed; any Job it sees is
judged (`lab.chaos.checks`: one Job per dispatch, in the namespace the dispatch recorded).

It also keeps the cluster's Jobs as the watch last showed them (a LIST replaces the lot) and
samples them every `SAMPLE_S`: how many run at once per deployment and tenancy, and per
deployment and capability, by label; the peaks are judged against the limits. A watch's events
come in the order of the writes, so a sample never counts a Job that had ended before a later
one was created: what it counts, the cluster held at one moment.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k8s_dispatch.lab.kubeclient import new_watch, opened
from k8s_dispatch.workers.job_status import job_state
from k8s_dispatch.workers.labels import CAPABILITY_KEY, DEPLOYMENT_LABEL, DISPATCH_ID_KEY, TENANCY_ID_KEY, selector

log = logging.getLogger(__name__)

WATCH_S = 30  # each watch's timeoutSeconds: then a new one from the version reached
RETRY_S = 0.5
SAMPLE_S = 0.1
TENANCY, CAPABILITY = "tenancy", "capability"
Scope = tuple[str, str, str]  # (deployment, TENANCY or CAPABILITY, its name)


@dataclass(frozen=True)
class LiveJob:
    deployment: str
    tenancy: str
    capability: str
    running: bool  # no final condition yet, not being deleted: what the engine reads as running


def live_job(job: Mapping[str, Any]) -> LiveJob:
    """A Job (API dict) as the sampler counts it (pure): its deployment, tenancy and capability
    by label (the full value from the annotation when the label is a hash), and whether it runs
    as `workers.job_status.job_state` reads it (the engine's own reading)."""
    metadata = job.get("metadata") or {}
    labels, annotations = metadata.get("labels") or {}, metadata.get("annotations") or {}

    def value(key: str) -> str:
        return str(annotations.get(key) or labels.get(key) or "")

    return LiveJob(value(DEPLOYMENT_LABEL), value(TENANCY_ID_KEY), value(CAPABILITY_KEY), not job_state(job).terminal)


def running_now(jobs: Mapping[str, LiveJob]) -> Counter[Scope]:
    """How many of `jobs` run, per (deployment, tenancy) and (deployment, capability) (pure)."""
    counts: Counter[Scope] = Counter()
    for job in jobs.values():
        if job.running:
            counts[(job.deployment, TENANCY, job.tenancy)] += 1
            counts[(job.deployment, CAPABILITY, job.capability)] += 1
    return counts


class JobObserver:
    def __init__(self, kubeconfig: Path) -> None:
        self.kubeconfig = kubeconfig
        self._seen: defaultdict[str, set[tuple[str, str]]] = defaultdict(set)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-observer", daemon=True)
        self._sampler = threading.Thread(target=self._sample, name="chaos-sampler", daemon=True)
        self._live: dict[str, LiveJob] = {}  # uid -> the Job as last seen
        self._peaks: Counter[Scope] = Counter()
        self._serialise: Any = None  # ApiClient.sanitize_for_serialization: a model as its API dict
        self.samples = 0
        self.errors = 0

    def start(self) -> None:
        from kubernetes import client

        self._serialise = client.ApiClient().sanitize_for_serialization
        self._thread.start()
        self._sampler.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=WATCH_S + 10)
        self._sampler.join(timeout=5)

    def peaks(self) -> dict[Scope, int]:
        """The most Jobs seen running at once in one sample, per scope (scopes never seen running: absent)."""
        with self._lock:
            return dict(self._peaks)

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            with self._lock:
                counts = running_now(self._live)
                for scope, n in counts.items():
                    if n > self._peaks[scope]:
                        self._peaks[scope] = n
                self.samples += 1

    def seen(self) -> dict[str, set[tuple[str, str]]]:
        """dispatch id -> {(namespace, uid)} of every Job of it seen so far (a final LIST first)."""
        try:
            self._list()
        except Exception as e:
            log.warning("observer: the final list failed: %s", e)
        with self._lock:
            return {k: set(v) for k, v in self._seen.items()}

    def _note(self, job: Any, *, deleted: bool = False) -> None:
        metadata = job.metadata
        dispatch_id = (metadata.labels or {}).get(DISPATCH_ID_KEY)
        live = None if deleted else live_job(self._serialise(job))
        with self._lock:
            if dispatch_id:
                self._seen[dispatch_id].add((metadata.namespace, metadata.uid))
            if live is None:
                self._live.pop(metadata.uid, None)
            else:
                self._live[metadata.uid] = live

    def _list(self) -> str:
        from kubernetes import client

        with opened(self.kubeconfig) as api:
            listed = client.BatchV1Api(api).list_job_for_all_namespaces(label_selector=selector(), _request_timeout=10)
        live = {str(job.metadata.uid): live_job(self._serialise(job)) for job in listed.items if job.metadata}
        with self._lock:
            self._live = live  # the list is one moment of the cluster: what it lacks is gone
        for job in listed.items:
            self._note(job)
        assert listed.metadata is not None  # a LIST always carries its ListMeta
        return str(listed.metadata.resource_version)

    def _run(self) -> None:
        from kubernetes import client

        version: str | None = None
        while not self._stop.is_set():
            try:
                if version is None:
                    version = self._list()
                with opened(self.kubeconfig) as api:
                    stream = new_watch()
                    for event in stream.stream(
                        client.BatchV1Api(api).list_job_for_all_namespaces, label_selector=selector(),
                        resource_version=version, timeout_seconds=WATCH_S, allow_watch_bookmarks=True,
                    ):  # fmt: skip
                        if event["type"] == "ERROR":  # 410 Gone: the version is too old, list again
                            version = None
                            break
                        version = event["object"].metadata.resource_version or version
                        if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                            self._note(event["object"], deleted=event["type"] == "DELETED")
                        if self._stop.is_set():
                            stream.stop()
            except Exception as e:
                self.errors += 1
                if isinstance(e, client.ApiException) and e.status == 410:
                    version = None
                log.debug("observer: %s; watching again", e)
                self._stop.wait(RETRY_S)
