"""The usual Celery pattern for Kubernetes Jobs, the baseline of the API-load benchmark (issue 8,
figure 2): one task per Job creates it, then a task GETs the Job and re-schedules itself with
`countdown` until the Job has ended, then deletes it.

Run as its own worker on the bench's Redis, under its own key prefix and queue:
`celery -A k8s_dispatch.lab.bench.baseline_app worker`, configured by BENCH_BASELINE_* variables (broker URL,
key prefix, kubeconfig, countdown). Written as such code usually is, with the official client's
typed models; no labels, finalizers or database: it measures the API calls of the pattern alone.
"""

from __future__ import annotations

import os
import threading
from typing import Any, cast

from celery import Celery
from kubernetes import client as k8s

from k8s_dispatch.lab import kubeclient

QUEUE = "bench-baseline"
CREATE_TASK = "bench-baseline.create"
CHECK_TASK = "bench-baseline.check"
SIM_DURATION = "localcluster.k8s-dispatch.io/duration-ms"

BROKER_URL = os.environ.get("BENCH_BASELINE_BROKER_URL", "redis://127.0.0.1:6379/0")
KEY_PREFIX = os.environ.get("BENCH_BASELINE_KEY_PREFIX", "bench-baseline")
KUBECONFIG = os.environ.get("BENCH_BASELINE_KUBECONFIG", "")
COUNTDOWN_S = float(os.environ.get("BENCH_BASELINE_COUNTDOWN_S", "5"))

app = Celery("bench-baseline", broker=BROKER_URL, set_as_current=False)
app.conf.update(
    broker_transport_options={"global_keyprefix": f"{KEY_PREFIX}:", "visibility_timeout": 3600},
    task_default_queue=QUEUE,
    task_ignore_result=True,
    task_serializer="json",
    accept_content=["json"],
    worker_pool="threads",
    broker_connection_retry_on_startup=True,
)

_batch: k8s.BatchV1Api | None = None
_batch_lock = threading.Lock()


def batch() -> k8s.BatchV1Api:
    """This process's client, made on first use (the kubeconfig is read once)."""
    global _batch
    with _batch_lock:
        if _batch is None:
            _batch = k8s.BatchV1Api(kubeclient.api_client(KUBECONFIG))
        return _batch


def job_body(name: str, duration_ms: int) -> dict[str, Any]:
    """A Job localcluster simulates for `duration_ms`."""
    container = {"name": "main", "image": "k8s-dispatch-bench:simulated", "command": ["true"]}
    template = {
        "metadata": {"annotations": {SIM_DURATION: str(duration_ms)}},
        "spec": {"restartPolicy": "Never", "containers": [container]},
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {"backoffLimit": 0, "template": template},
    }


def finished(job: k8s.V1Job) -> bool:
    conditions = (job.status.conditions or []) if job.status else []
    return any(c.type in ("Complete", "Failed") and c.status == "True" for c in conditions)


@app.task(name=CREATE_TASK)
def create(namespace: str, name: str, duration_ms: int) -> None:
    # a dict body, as the client takes it (validated into its V1Job) though typed V1Job
    batch().create_namespaced_job(namespace, cast(k8s.V1Job, job_body(name, duration_ms)))
    check.apply_async((namespace, name), countdown=COUNTDOWN_S)


@app.task(name=CHECK_TASK)
def check(namespace: str, name: str) -> None:
    job = batch().read_namespaced_job(name, namespace)
    if finished(job):
        batch().delete_namespaced_job(name, namespace, propagation_policy="Background")
    else:
        check.apply_async((namespace, name), countdown=COUNTDOWN_S)
