"""The chaos run's witness of Job creation: a watch on our Jobs in every namespace, kept up through
API errors and restarts, noting each Job's dispatch, namespace and uid. A Job made and deleted
between two of its looks (a watch broken by a restart, then a LIST) is missed; any Job it sees is
judged (`lab.chaos.checks`: one Job per dispatch, in the namespace the dispatch recorded).

It also keeps the cluster's Jobs, and the Pods of map Jobs, as the watches last showed them (a
LIST replaces the lot) and samples them every `SAMPLE_S`: how many run at once per deployment and
tenancy, and per deployment and capability, by label, a map's Job counted as its running Pods
(it runs up to its parallelism); the peaks are judged against the limits. The two watches' events
are applied in the order of their resourceVersions (one counter for every object: etcd's revision,
localcluster's), each only once both watches have reached it (`VersionOrder`): so a sample never
counts a Job that had ended before a later Pod was created, nor the other way round; what it
counts, the cluster held at one moment.

Every Job and Pod it reads, in every version it sees, is handed to the run's `MarkerScan`, when it
has one: no secret input may appear in them.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k8s_dispatch.lab.kubeclient import new_watch, opened
from k8s_dispatch.workers.indexed import is_map_job
from k8s_dispatch.workers.job_status import job_state
from k8s_dispatch.workers.labels import CAPABILITY_KEY, DEPLOYMENT_LABEL, DISPATCH_ID_KEY, TENANCY_ID_KEY, selector

log = logging.getLogger(__name__)

WATCH_S = 30  # each watch's timeoutSeconds: then a new one from the version reached
RETRY_S = 0.5
SAMPLE_S = 0.1
TENANCY, CAPABILITY = "tenancy", "capability"
JOBS, PODS = "jobs", "pods"  # the two watches
Scope = tuple[str, str, str]  # (deployment, TENANCY or CAPABILITY, its name)


@dataclass(frozen=True)
class LiveJob:
    deployment: str
    tenancy: str
    capability: str
    running: bool  # no final condition yet, not being deleted: what the engine reads as running
    map: bool = False  # a map's Job: its Pods are counted, not it


def _scope(obj: Mapping[str, Any]) -> tuple[str, str, str]:
    metadata = obj.get("metadata") or {}
    labels, annotations = metadata.get("labels") or {}, metadata.get("annotations") or {}

    def value(key: str) -> str:
        return str(annotations.get(key) or labels.get(key) or "")

    return value(DEPLOYMENT_LABEL), value(TENANCY_ID_KEY), value(CAPABILITY_KEY)


def live_job(job: Mapping[str, Any]) -> LiveJob:
    """A Job (API dict) as the sampler counts it (pure): its deployment, tenancy and capability
    by label (the full value from the annotation when the label is a hash), and whether it runs
    as `workers.job_status.job_state` reads it (the engine's own reading)."""
    return LiveJob(*_scope(job), running=not job_state(job).terminal, map=is_map_job(job))


def live_pod(pod: Mapping[str, Any]) -> LiveJob | None:
    """A map Job's Pod (API dict) as the sampler counts it (pure), None for any other Pod: it runs
    while Pending or Running and not being deleted (what the Job controller counts `active`, and
    holds to the Job's parallelism)."""
    if not is_map_job(pod):
        return None
    metadata, status = pod.get("metadata") or {}, pod.get("status") or {}
    running = status.get("phase") in ("Pending", "Running") and not metadata.get("deletionTimestamp")
    return LiveJob(*_scope(pod), running=running, map=True)


def running_now(jobs: Mapping[str, LiveJob], pods: Mapping[str, LiveJob] | None = None) -> Counter[Scope]:
    """How many of `jobs` run, per (deployment, tenancy) and (deployment, capability) (pure); a
    map's Job counts as its running `pods`."""
    counts: Counter[Scope] = Counter()
    for job in itertools.chain((j for j in jobs.values() if not j.map), (pods or {}).values()):
        if job.running:
            counts[(job.deployment, TENANCY, job.tenancy)] += 1
            counts[(job.deployment, CAPABILITY, job.capability)] += 1
    return counts


class VersionOrder:
    """Changes seen by several watches, applied in resourceVersion order, each once every watch
    has reached its version (pure but for the changes it calls). A version that is not a number
    is applied at once (no API server of ours writes one)."""

    def __init__(self, streams: Iterable[str]) -> None:
        self._reached = dict.fromkeys(streams, -1)
        self._queue: list[tuple[int, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def add(self, stream: str, version: str | None, change: Callable[[], None] | None = None) -> None:
        """`stream` reached `version`, with `change` (None: a bookmark, or nothing to apply)."""
        try:
            at = int(version or "")
        except ValueError:
            if change is not None:
                change()
            return
        self._reached[stream] = max(self._reached[stream], at)
        if change is not None:
            heapq.heappush(self._queue, (at, next(self._order), change))
        upto = min(self._reached.values())
        while self._queue and self._queue[0][0] <= upto:
            heapq.heappop(self._queue)[2]()

    @property
    def held(self) -> int:
        """Changes waiting for another watch to reach them."""
        return len(self._queue)


class JobObserver:
    def __init__(self, kubeconfig: Path, *, scan: Any = None) -> None:
        self.kubeconfig = kubeconfig
        self.scan = scan  # lab.chaos.objects.MarkerScan, or None
        self._seen: defaultdict[str, set[tuple[str, str]]] = defaultdict(set)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(JOBS,), name="chaos-observer", daemon=True),
            threading.Thread(target=self._run, args=(PODS,), name="chaos-observer-pods", daemon=True),
        ]
        self._sampler = threading.Thread(target=self._sample, name="chaos-sampler", daemon=True)
        self._live: dict[str, LiveJob] = {}  # uid -> the Job as last seen
        self._pods: dict[str, LiveJob] = {}  # uid -> a map Job's Pod as last seen
        self._order = VersionOrder((JOBS, PODS))
        self._peaks: Counter[Scope] = Counter()
        self._serialise: Any = None  # ApiClient.sanitize_for_serialization: a model as its API dict
        self.samples = 0
        self.errors = 0

    def start(self) -> None:
        from kubernetes import client

        self._serialise = client.ApiClient().sanitize_for_serialization
        for thread in self._threads:
            thread.start()
        self._sampler.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=WATCH_S + 10)
        self._sampler.join(timeout=5)

    def peaks(self) -> dict[Scope, int]:
        """The most Jobs (a map's: its running Pods) seen running at once in one sample, per scope
        (scopes never seen running: absent)."""
        with self._lock:
            return dict(self._peaks)

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            with self._lock:
                counts = running_now(self._live, self._pods)
                for scope, n in counts.items():
                    if n > self._peaks[scope]:
                        self._peaks[scope] = n
                self.samples += 1

    def seen(self) -> dict[str, set[tuple[str, str]]]:
        """dispatch id -> {(namespace, uid)} of every Job of it seen so far (a final LIST first)."""
        try:
            self._list(JOBS)
        except Exception as e:
            log.warning("observer: the final list failed: %s", e)
        with self._lock:
            return {k: set(v) for k, v in self._seen.items()}

    def _scanned(self, stream: str, obj: Any) -> None:
        if self.scan is not None and self.scan.markers and obj.metadata is not None:
            self.scan.scan(stream[:-1] if stream.endswith("s") else stream, json.dumps(self._serialise(obj)),
                           where=f"{obj.metadata.namespace}/{obj.metadata.name}")  # fmt: skip

    def _note(self, stream: str, obj: Any, *, deleted: bool = False) -> None:
        metadata = obj.metadata
        uid = str(metadata.uid)
        self._scanned(stream, obj)
        if stream == JOBS:
            dispatch_id = (metadata.labels or {}).get(DISPATCH_ID_KEY)
            live: LiveJob | None = None if deleted else live_job(self._serialise(obj))
            table = self._live
        else:
            dispatch_id = None
            live = None if deleted else live_pod(self._serialise(obj))
            table = self._pods
            if live is None and uid not in table:  # not a map's Pod: only the version it reached
                with self._lock:
                    self._order.add(stream, metadata.resource_version)
                return

        def change() -> None:
            if live is None:
                table.pop(uid, None)
            else:
                table[uid] = live

        with self._lock:
            if dispatch_id:
                self._seen[dispatch_id].add((metadata.namespace, metadata.uid))
            self._order.add(stream, metadata.resource_version, change)

    def _list(self, stream: str) -> str:
        from kubernetes import client

        listed: Any
        with opened(self.kubeconfig) as api:
            if stream == JOBS:
                listed = client.BatchV1Api(api).list_job_for_all_namespaces(label_selector=selector(),
                                                                            _request_timeout=10)  # fmt: skip
            else:
                listed = client.CoreV1Api(api).list_pod_for_all_namespaces(label_selector=selector(),
                                                                           _request_timeout=10)  # fmt: skip
        assert listed.metadata is not None  # a LIST always carries its ListMeta
        version = str(listed.metadata.resource_version)
        read = live_job if stream == JOBS else live_pod
        for item in listed.items:
            self._scanned(stream, item)
        fresh = {str(o.metadata.uid): read(self._serialise(o)) for o in listed.items if o.metadata}
        kept = {uid: live for uid, live in fresh.items() if live is not None}
        table = self._live if stream == JOBS else self._pods

        def replace() -> None:  # the list is one moment of the cluster: what it lacks is gone
            table.clear()
            table.update(kept)

        with self._lock:
            if stream == JOBS:
                for job in listed.items:
                    dispatch_id = (job.metadata.labels or {}).get(DISPATCH_ID_KEY) if job.metadata else None
                    if dispatch_id:
                        self._seen[dispatch_id].add((str(job.metadata.namespace), str(job.metadata.uid)))
            self._order.add(stream, version, replace)
        return version

    def _run(self, stream: str) -> None:
        from kubernetes import client

        version: str | None = None
        while not self._stop.is_set():
            try:
                if version is None:
                    version = self._list(stream)
                with opened(self.kubeconfig) as api:
                    watched = (
                        client.BatchV1Api(api).list_job_for_all_namespaces
                        if stream == JOBS
                        else client.CoreV1Api(api).list_pod_for_all_namespaces
                    )
                    stream_ = new_watch()
                    for event in stream_.stream(
                        watched, label_selector=selector(), resource_version=version, timeout_seconds=WATCH_S,
                        allow_watch_bookmarks=True,
                    ):  # fmt: skip
                        if event["type"] == "ERROR":  # 410 Gone: the version is too old, list again
                            version = None
                            break
                        version = event["object"].metadata.resource_version or version
                        if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                            self._note(stream, event["object"], deleted=event["type"] == "DELETED")
                        elif event["type"] == "BOOKMARK":
                            with self._lock:
                                self._order.add(stream, version)
                        if self._stop.is_set():
                            stream_.stop()
            except Exception as e:
                self.errors += 1
                if isinstance(e, client.ApiException) and e.status == 410:
                    version = None
                log.debug("observer (%s): %s; watching again", stream, e)
                self._stop.wait(RETRY_S)
