"""Helpers the recovery tests share: a notifier that records, and one dispatch scheduled."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes
import yaml

from k8s_dispatch.core.errors import BrokerUnavailable
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.demo.localcluster import LocalCluster
from k8s_dispatch.demo.localcluster.quota import QUOTA_JOBS
from k8s_dispatch.store import migrate, scheduling
from k8s_dispatch.store.db import transaction


class Notified:
    """A notifier recording the dispatch ids it is called with (thread-safe); `fail` makes it raise."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.fail = False
        self._lock = threading.Lock()

    def __call__(self, dispatch_id: str) -> None:
        if self.fail:
            raise BrokerUnavailable("the test's broker is down")
        with self._lock:
            self.ids.append(dispatch_id)


def schedule(rt: Runtime, capability: str = "sim.ok", input: Any = None, *, tenancy: str = "tenant-a") -> str:
    """One dispatch of `capability` on a new case (input `{"n": 1}` unless given); its id."""
    case_id = f"case-{uuid.uuid4().hex[:8]}"
    with transaction(rt.sessions) as session:
        scheduling.create_case(session, case_id=case_id, tenancy_id=tenancy)
        return scheduling.schedule(
            session,
            case_id=case_id,
            tenancy_id=tenancy,
            capability=capability,
            input={"n": 1} if input is None else input,
            idempotency_key=f"key-{uuid.uuid4()}",
            router=rt.resolver,
            max_input_bytes=rt.settings.max_input_bytes,
        ).dispatch_id


def runtime_values(
    *,
    database_url: str,
    redis_url: str,
    prefix: str,
    namespace: str,
    kubeconfig: Path,
    capabilities: Any,
    tmp: Path,
    **settings: str,
) -> dict[str, str]:
    """A test's K8S_DISPATCH_*: its database, Redis prefix, namespace, cluster and capabilities
    (written to a file under `tmp`), plus `settings` (K8S_DISPATCH_<NAME>)."""
    caps = tmp / "capabilities.yaml"
    caps.write_text(yaml.safe_dump(capabilities))
    return {
        "K8S_DISPATCH_DATABASE_URL": database_url,
        "K8S_DISPATCH_REDIS_URL": redis_url,
        "K8S_DISPATCH_KEY_PREFIX": prefix,
        "K8S_DISPATCH_NAMESPACE": namespace,
        "K8S_DISPATCH_KUBECONFIG": str(kubeconfig),
        "K8S_DISPATCH_CAPABILITIES": str(caps),
        **{f"K8S_DISPATCH_{k.upper()}": v for k, v in settings.items()},
    }


def set_job_quota(cluster: LocalCluster, namespace: str, limit: int | None) -> None:
    """localcluster's Job quota of a namespace (`count/jobs.batch`), or none."""
    api = kubernetes.config.new_client_from_config(config_file=str(cluster.kubeconfig))
    try:
        body = {"metadata": {"annotations": {QUOTA_JOBS: None if limit is None else str(limit)}}}
        kubernetes.client.CoreV1Api(api).patch_namespace(namespace, body)
    finally:
        api.close()


def own_database_values(
    *,
    cluster: LocalCluster,
    new_pg_database: Callable[[], str],
    redis_url: str,
    key_prefix: str,
    tmp: Path,
    namespace: str,
    capabilities: Any,
    **settings: str,
) -> dict[str, str]:
    """`runtime_values` on a new, migrated database of the test's own (a sweep reads all of it),
    a Redis prefix and a namespace `namespace-<8 hex>` no other test shares, on `cluster`."""
    database_url = new_pg_database()
    migrate.upgrade(database_url)
    return runtime_values(
        database_url=database_url,
        redis_url=redis_url,
        prefix=f"{key_prefix}-{uuid.uuid4().hex[:8]}",
        namespace=f"{namespace}-{uuid.uuid4().hex[:8]}",
        kubeconfig=cluster.kubeconfig,
        capabilities=capabilities,
        tmp=tmp,
        **settings,
    )
