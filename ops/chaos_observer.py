"""The chaos run's witness of Job creation: a watch on our Jobs in every namespace, kept up through
API errors and restarts, noting each Job's dispatch, namespace and uid. A Job made and deleted
between two of its looks (a watch broken by a restart, then a LIST) is missed; any Job it sees is
judged (`ops.chaos_checks`: one Job per dispatch, in the namespace the dispatch recorded).
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

from k8s_dispatch.ops.kubeclient import new_watch, opened
from k8s_dispatch.workers.labels import DISPATCH_ID_KEY, selector

log = logging.getLogger(__name__)

WATCH_S = 30  # each watch's timeoutSeconds: then a new one from the version reached
RETRY_S = 0.5


class JobObserver:
    def __init__(self, kubeconfig: Path) -> None:
        self.kubeconfig = kubeconfig
        self._seen: defaultdict[str, set[tuple[str, str]]] = defaultdict(set)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-observer", daemon=True)
        self.errors = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=WATCH_S + 10)

    def seen(self) -> dict[str, set[tuple[str, str]]]:
        """dispatch id -> {(namespace, uid)} of every Job of it seen so far (a final LIST first)."""
        try:
            self._list()
        except Exception as e:
            log.warning("observer: the final list failed: %s", e)
        with self._lock:
            return {k: set(v) for k, v in self._seen.items()}

    def _note(self, job: Any) -> None:
        metadata = job.metadata
        dispatch_id = (metadata.labels or {}).get(DISPATCH_ID_KEY)
        if dispatch_id:
            with self._lock:
                self._seen[dispatch_id].add((metadata.namespace, metadata.uid))

    def _list(self) -> str:
        from kubernetes import client

        with opened(self.kubeconfig) as api:
            listed = client.BatchV1Api(api).list_job_for_all_namespaces(label_selector=selector(), _request_timeout=10)
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
                        if event["type"] in ("ADDED", "MODIFIED"):
                            self._note(event["object"])
                        if self._stop.is_set():
                            stream.stop()
            except Exception as e:
                self.errors += 1
                if isinstance(e, client.ApiException) and e.status == 410:
                    version = None
                log.debug("observer: %s; watching again", e)
                self._stop.wait(RETRY_S)
