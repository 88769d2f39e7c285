"""An admission pass makes the Jobs of what it admitted itself (`tasks.admission.run_pass`), on
real PostgreSQL and localcluster: a slot is held from admission, so a Job that waits for a
`create_jobs` message to reach a free worker thread (behind a jobs queue of re-sent schedules,
while sweeps hold the threads) keeps the slot held by nothing that runs, and admission admits
nothing meanwhile. Only what the API refuses for now (a full quota) goes to the message, and a
message that cannot be sent leaves the dispatch SCHEDULED for the sweep.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import kubernetes
import pytest
from celery import Celery
from kombu.exceptions import OperationalError

from k8s_dispatch import celeryconfig as names
from k8s_dispatch.core.settings import load_settings
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.demo.localcluster import LocalCluster
from k8s_dispatch.store import dispatches, migrate, scheduling
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import DispatchState, EventType
from k8s_dispatch.tasks.admission import run_pass
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.manifest import job_name
from k8s_dispatch.workers.resolver import CapabilityResolver
from tests.recovery.runtimes import set_job_quota

SIM = "localcluster.k8s-dispatch.io/"
CAPABILITIES = {
    "capabilities": {"sim.hang": {"worker": "sim", "image": "sim:1", "annotations": {SIM + "outcome": "hang"}}},
    "limits": {"tenancies": {"tenant-l": {"maxRunning": 2}}},
}


class Broker:
    """The pass's sender: records what it is asked to send (nobody consumes it); `down` refuses
    every send as kombu does when Redis is unreachable."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, list[Any]]] = []
        self.down = False

    def send_task(self, name: str, args: list[Any] | None = None, **_: Any) -> None:
        if self.down:
            raise OperationalError("Error 111 connecting to the broker. Connection refused.")
        self.sent.append((name, list(args or [])))


@contextmanager
def admission_runtime(
    cluster: LocalCluster, new_pg_database: Any, redis_url: str, key_prefix: str, capabilities: dict[str, Any]
) -> Iterator[Runtime]:
    """A Runtime on a database of the test's own (admission reads every queue), a namespace and
    Redis prefix no other test shares, with `capabilities` (and their limits); closed at the end."""
    url = new_pg_database()
    migrate.upgrade(url)
    settings = load_settings(
        {
            "K8S_DISPATCH_DATABASE_URL": url,
            "K8S_DISPATCH_REDIS_URL": redis_url,
            "K8S_DISPATCH_KEY_PREFIX": f"{key_prefix}-{uuid.uuid4().hex[:8]}",
            "K8S_DISPATCH_NAMESPACE": f"adm-{uuid.uuid4().hex[:8]}",
            "K8S_DISPATCH_KUBECONFIG": str(cluster.kubeconfig),
        }
    )
    runtime = Runtime.from_settings(settings, resolver=CapabilityResolver.from_mapping(capabilities, source="<test>"))
    try:
        yield runtime
    finally:
        runtime.close()


@pytest.fixture
def rt(sim_cluster: LocalCluster, new_pg_database: Any, redis_url: str, key_prefix: str) -> Iterator[Runtime]:
    with admission_runtime(sim_cluster, new_pg_database, redis_url, key_prefix, CAPABILITIES) as runtime:
        yield runtime


def queue(rt: Runtime, n: int) -> list[str]:
    """`n` dispatches of the limited tenancy, written QUEUED (oldest first)."""
    case_id = f"case-{uuid.uuid4().hex[:8]}"
    with transaction(rt.sessions) as session:
        scheduling.create_case(session, case_id=case_id, tenancy_id="tenant-l")
    ids = []
    for i in range(n):
        with transaction(rt.sessions) as session:
            result = scheduling.schedule(
                session, case_id=case_id, tenancy_id="tenant-l", capability="sim.hang", input={"i": i},
                idempotency_key=f"key-{uuid.uuid4()}", router=rt.resolver, max_input_bytes=rt.settings.max_input_bytes,
            )  # fmt: skip
        assert result.state is DispatchState.QUEUED
        ids.append(result.dispatch_id)
    return ids


def make_namespace(cluster: LocalCluster, namespace: str) -> None:
    api = kubernetes.config.new_client_from_config(config_file=str(cluster.kubeconfig))
    try:
        kubernetes.client.CoreV1Api(api).create_namespace(
            kubernetes.client.V1Namespace(metadata=kubernetes.client.V1ObjectMeta(name=namespace))
        )
    finally:
        api.close()


def states(rt: Runtime, ids: list[str]) -> list[DispatchState]:
    with transaction(rt.sessions) as session:
        rows = dispatches.get_dispatches(session, ids)
    return [DispatchState(rows[d].state) for d in ids]


def job_names(rt: Runtime) -> set[str]:
    ours = job_labels.selector(rt.settings.effective_deployment)
    return {
        job["metadata"]["name"]
        for page in rt.kube.iter_jobs(rt.settings.namespace, label_selector=ours)
        for job in page
    }


def test_the_pass_makes_the_jobs_it_admitted_without_a_message(rt: Runtime) -> None:
    first, second, third = queue(rt, 3)
    broker = Broker()

    admitted = run_pass(rt, cast(Celery, broker))

    assert sorted(a.dispatch_id for a in admitted) == sorted([first, second])
    # Their Jobs exist when the pass returns: the slots hold Jobs that run, not a message in a queue.
    assert states(rt, [first, second, third]) == [DispatchState.CREATED, DispatchState.CREATED, DispatchState.QUEUED]
    assert job_names(rt) == {job_name(first), job_name(second)}
    assert broker.sent == []


def test_what_the_api_refuses_for_now_goes_to_create_jobs_and_an_unsent_message_to_the_sweep(
    sim_cluster: LocalCluster, rt: Runtime
) -> None:
    first, second = queue(rt, 2)
    make_namespace(sim_cluster, rt.settings.namespace)
    set_job_quota(sim_cluster, rt.settings.namespace, 0)  # a full ResourceQuota: 403 exceeded quota, a Transient
    broker = Broker()

    assert len(run_pass(rt, cast(Celery, broker))) == 2

    assert states(rt, [first, second]) == [DispatchState.SCHEDULED, DispatchState.SCHEDULED]  # not failed
    assert [(name, set(batch)) for name, (batch,) in broker.sent] == [(names.CREATE_JOBS_TASK, {first, second})]
    assert job_names(rt) == set()

    third, fourth = queue(rt, 2)
    broker.down = True
    assert run_pass(rt, cast(Celery, broker)) == []  # both slots held by the SCHEDULED two: none admitted
    with transaction(rt.sessions) as session:
        dispatches.record_terminals(
            session, [dispatches.TerminalEvent(d, EventType.WORKER_CANCELLED, {}) for d in (first, second)]
        )
        dispatches.mark_jobs_stopped(session, [first, second])  # no Job was ever made: their slots free
    assert len(run_pass(rt, cast(Celery, broker))) == 2  # the sends fail: logged, left to the sweep
    assert states(rt, [third, fourth]) == [DispatchState.SCHEDULED, DispatchState.SCHEDULED]
