"""Fixtures for the localcluster tests: one simulate-mode and one exec-mode cluster per session,
official-client API objects bound to them, a fresh namespace per test, and polling helpers.

`sim` runs a test on localcluster AND on the real control plane (kube-apiserver, etcd, the real
Job controller, our node agent in simulate mode): the tests that state Kubernetes semantics are
the differential fidelity suite, and a divergence fails one side. `lsim` is localcluster alone,
for what only it has (fault injection, its request audit, its state file)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
from clusters import ClusterHandle, local_handle
from kubernetes import client

from k8s_dispatch.demo.localcluster import LocalCluster

T = TypeVar("T")
_ns_counter = itertools.count(1)


def wait_for(fn: Callable[[], T], *, timeout: float = 10.0, interval: float = 0.02, what: str = "condition") -> T:
    """Poll `fn` until it returns something truthy; fail the test at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def job_manifest(
    name: str,
    *,
    annotations: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
    command: list[str] | None = None,
    env: list[dict[str, Any]] | None = None,
    container: dict[str, Any] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    c: dict[str, Any] = {"name": "main", "image": "python:3.11"}
    if command is not None:
        c["command"] = command
    if env is not None:
        c["env"] = env
    c.update(container or {})
    template: dict[str, Any] = {"spec": {"restartPolicy": "Never", "containers": [c]}}
    if annotations:
        template["metadata"] = {"annotations": annotations}
    meta: dict[str, Any] = {"name": name}
    if labels:
        meta["labels"] = labels
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": {"template": template, **spec}}


def raw_request(
    cluster: LocalCluster | ClusterHandle,
    method: str,
    path: str,
    body: Any = None,
    *,
    content_type: str = "application/json",
    token: str | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """One request as sent (for what the typed client cannot send): to a handle's URL (https for the
    real control plane), or to a LocalCluster's plain-http listener."""
    handle = cluster if isinstance(cluster, ClusterHandle) else local_handle(cluster)
    return handle.raw(method, path, body, content_type=content_type, token=token, headers=headers)


def condition_types(job: Any) -> list[str]:
    return [c.type for c in (job.status.conditions or []) if c.status == "True"]


@dataclass
class Api:
    cluster: ClusterHandle
    client: client.ApiClient
    batch: client.BatchV1Api
    core: client.CoreV1Api
    namespace: str

    def job(self, name: str) -> Any:
        return self.batch.read_namespaced_job(name, self.namespace)

    def create_job(self, manifest: dict[str, Any]) -> Any:
        return self.batch.create_namespaced_job(self.namespace, manifest)

    def wait_job(self, name: str, *types: str, timeout: float = 10.0) -> Any:
        wanted = set(types or ("Complete", "Failed"))
        return wait_for(
            lambda: (lambda j: j if wanted & set(condition_types(j)) else None)(self.job(name)),
            timeout=timeout,
            what=f"job {name} to reach {sorted(wanted)}",
        )

    def pods_of(self, name: str) -> list[Any]:
        return self.core.list_namespaced_pod(
            self.namespace, label_selector=f"batch.kubernetes.io/job-name={name}"
        ).items

    def gone(self, read: Callable[[], Any]) -> bool:
        try:
            read()
        except client.ApiException as e:
            if e.status == 404:
                return True
            raise
        return False


def _api(cluster: LocalCluster | ClusterHandle, namespace: str) -> Iterator[Api]:
    handle = cluster if isinstance(cluster, ClusterHandle) else local_handle(cluster)
    handle.ensure_namespace(namespace)
    api_client = handle.api_client()
    try:
        yield Api(handle, api_client, client.BatchV1Api(api_client), client.CoreV1Api(api_client), namespace)
    finally:
        api_client.close()


@pytest.fixture(scope="session")
def sim_cluster() -> Iterator[LocalCluster]:
    with LocalCluster(mode="simulate") as cluster:
        yield cluster


@pytest.fixture(scope="session")
def exec_cluster() -> Iterator[LocalCluster]:
    with LocalCluster(mode="exec", max_running=4) as cluster:
        yield cluster


@pytest.fixture
def namespace() -> str:
    return f"t{next(_ns_counter)}-{int(time.time() * 1000) % 100000}"


@pytest.fixture
def sim(cluster_under_test: ClusterHandle, namespace: str) -> Iterator[Api]:
    """Simulate mode, on each cluster in turn."""
    yield from _api(cluster_under_test, namespace)


@pytest.fixture
def lsim(sim_cluster: LocalCluster, namespace: str) -> Iterator[Api]:
    """Simulate mode on localcluster only."""
    yield from _api(sim_cluster, namespace)


@pytest.fixture
def ex(exec_cluster: LocalCluster, namespace: str) -> Iterator[Api]:
    yield from _api(exec_cluster, namespace)
