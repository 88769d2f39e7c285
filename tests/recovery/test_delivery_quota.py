"""A 403 "exceeded quota" on a Job's create is passing: the dispatch stays scheduled, the create
is retried (a Transient error), and `status` says why it waits; once the quota has room, the
same create goes through. Real PostgreSQL and localcluster, whose namespace annotation
`quota-jobs` answers as a ResourceQuota `count/jobs.batch` does. Before, the 403 failed the
dispatch at once (WORKER_FAILED Forbidden) for a namespace that was only full for now.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from runtimes import set_job_quota

from k8s_dispatch.core.errors import QuotaExceeded, Transient
from k8s_dispatch.core.settings import load_settings
from k8s_dispatch.delivery.cancel import cancel_dispatch
from k8s_dispatch.delivery.create import CreateOutcome, create_jobs_for
from k8s_dispatch.delivery.records import load_record
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.demo.localcluster import LocalCluster
from k8s_dispatch.ops.status import read_status
from k8s_dispatch.store import dispatches, migrate, scheduling
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import DispatchState, EventType, utcnow
from k8s_dispatch.workers.resolver import CapabilityResolver

SIM = "localcluster.k8s-dispatch.io/"
CAPABILITIES = {
    "capabilities": {"sim.hang": {"worker": "sim", "image": "sim:1", "annotations": {SIM + "outcome": "hang"}}}
}


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(mode="simulate") as c:
        yield c


@pytest.fixture
def rt(cluster, new_pg_database, redis_url, key_prefix) -> Iterator[Runtime]:
    url = new_pg_database()  # status reads the whole database: a database of this test's own
    migrate.upgrade(url)
    settings = load_settings(
        {
            "K8S_DISPATCH_DATABASE_URL": url,
            "K8S_DISPATCH_REDIS_URL": redis_url,
            "K8S_DISPATCH_KEY_PREFIX": f"{key_prefix}-quota",
            "K8S_DISPATCH_NAMESPACE": f"quota-{uuid.uuid4().hex[:8]}",
            "K8S_DISPATCH_KUBECONFIG": str(cluster.kubeconfig),
        }
    )
    runtime = Runtime.from_settings(settings, resolver=CapabilityResolver.from_mapping(CAPABILITIES, source="<test>"))
    yield runtime
    runtime.close()


def schedule(rt: Runtime) -> str:
    case_id = f"case-{uuid.uuid4().hex[:8]}"
    with transaction(rt.sessions) as session:
        scheduling.create_case(session, case_id=case_id, tenancy_id="tenant-q")
        return scheduling.schedule(
            session, case_id=case_id, tenancy_id="tenant-q", capability="sim.hang", input={"n": 1},
            idempotency_key=f"key-{uuid.uuid4()}", router=rt.resolver, max_input_bytes=rt.settings.max_input_bytes,
        ).dispatch_id  # fmt: skip


def test_a_full_quota_keeps_the_dispatch_scheduled_retried_and_shown_in_status(cluster, rt):
    namespace = rt.settings.namespace
    first = schedule(rt)
    assert create_jobs_for(rt, [first]) == {first: CreateOutcome.CREATED}
    set_job_quota(cluster, namespace, 1)  # the namespace holds one Job: full

    waiting = schedule(rt)
    with pytest.raises(QuotaExceeded) as raised:  # Transient: the task retries it with backoff
        create_jobs_for(rt, [waiting])
    assert isinstance(raised.value, Transient) and "exceeded quota" in str(raised.value)
    record = load_record(rt, waiting)
    assert record.state is DispatchState.SCHEDULED  # not failed
    with transaction(rt.sessions) as session:
        assert [e.type for e in dispatches.events_for(session, waiting)] == [EventType.WORKER_SCHEDULED]
        report = read_status(session, now=utcnow())
    assert report.create_waiting == 1
    [wait] = report.create_waits
    assert (wait.dispatch_id, wait.capability) == (waiting, "sim.hang")
    assert wait.error.startswith("QuotaExceeded: ") and "exceeded quota: " in wait.error
    assert report.to_dict()["create_waits"][0]["dispatch_id"] == waiting

    cancel_dispatch(rt, first)  # its Job deleted: the quota has room again
    assert create_jobs_for(rt, [waiting]) == {waiting: CreateOutcome.CREATED}
    assert load_record(rt, waiting).state is DispatchState.CREATED
    with transaction(rt.sessions) as session:
        assert read_status(session, now=utcnow()).create_waiting == 0  # created since: no longer waiting
    set_job_quota(cluster, namespace, None)
    cancel_dispatch(rt, waiting)
