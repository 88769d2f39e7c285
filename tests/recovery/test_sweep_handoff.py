"""The sweep's category 2 against real PostgreSQL, Redis and localcluster: finished Jobs poll has
handed to a queued completion are left to it while its marker lives and delivered once it is
gone; Redis failing the check defers nothing; a page's finished Jobs share one Pod LIST.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
import yaml
from forged_jobs import SIM

from k8s_dispatch.core.settings import load_settings
from k8s_dispatch.delivery import create, handoff
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.demo.localcluster import LocalCluster
from k8s_dispatch.ops.processes import free_port, wait_until
from k8s_dispatch.recovery.plan import Category
from k8s_dispatch.recovery.report import SweepReport
from k8s_dispatch.recovery.sweep import run_sweep
from k8s_dispatch.store import dispatches, migrate, scheduling
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import EventType
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.job_status import job_state
from k8s_dispatch.workers.manifest import job_name

C2 = Category.FINISHED_UNRECORDED
CAPABILITIES = {
    "capabilities": {
        "sim.ok": {
            "worker": "sim",
            "image": "sim:1",
            "activeDeadlineSeconds": None,
            "annotations": {SIM + "duration-ms": "20"},
        }
    }
}


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(mode="simulate") as c:
        yield c


@pytest.fixture
def make_runtime(cluster, new_pg_database, redis_url, key_prefix, tmp_path) -> Iterator[Callable[..., Runtime]]:
    """Runtimes of this test: its own database, namespace and Redis prefix; `overrides` are settings."""
    database_url = new_pg_database()
    migrate.upgrade(database_url)
    caps = tmp_path / "capabilities.yaml"
    caps.write_text(yaml.safe_dump(CAPABILITIES))
    env = {
        "K8S_DISPATCH_DATABASE_URL": database_url,
        "K8S_DISPATCH_REDIS_URL": redis_url,
        "K8S_DISPATCH_KEY_PREFIX": f"{key_prefix}-{uuid.uuid4().hex[:8]}",
        "K8S_DISPATCH_NAMESPACE": f"ho-{uuid.uuid4().hex[:8]}",
        "K8S_DISPATCH_KUBECONFIG": str(cluster.kubeconfig),
        "K8S_DISPATCH_CAPABILITIES": str(caps),
        "K8S_DISPATCH_SWEEP_GRACE_S": "0",
    }
    made: list[Runtime] = []

    def make(**overrides: str) -> Runtime:
        values = {**env, **{f"K8S_DISPATCH_{k.upper()}": v for k, v in overrides.items()}}
        rt = Runtime.from_settings(load_settings(values), notifier=lambda dispatch_id: None)
        made.append(rt)
        return rt

    yield make
    for rt in made:
        rt.close()


# --- helpers -------------------------------------------------------------------------------


def finished_jobs(rt: Runtime, count: int) -> list[str]:
    """`count` dispatches whose Jobs have finished, not yet delivered; their ids."""
    ids = []
    for i in range(count):
        case_id = f"case-{uuid.uuid4().hex[:8]}"
        with transaction(rt.sessions) as session:
            scheduling.create_case(session, case_id=case_id, tenancy_id="tenant-a")
            ids.append(
                scheduling.schedule(
                    session,
                    case_id=case_id,
                    tenancy_id="tenant-a",
                    capability="sim.ok",
                    input={"i": i},
                    idempotency_key=f"key-{uuid.uuid4()}",
                    router=rt.resolver,
                    max_input_bytes=rt.settings.max_input_bytes,
                ).dispatch_id
            )
    for dispatch_id in ids:
        create.create_job_for(rt, dispatch_id)

    def done() -> bool:
        current = listed(rt)
        return all(job_name(d) in current and job_state(current[job_name(d)]).terminal for d in ids)

    wait_until(done, what=f"{count} jobs finished", timeout=15.0)
    return ids


def listed(rt: Runtime) -> dict[str, dict[str, Any]]:
    """Our undelivered Jobs, by name, as poll's LIST reads them."""
    pages = rt.kube.iter_jobs(
        rt.settings.namespace, label_selector=job_labels.undelivered_selector(rt.settings.effective_deployment)
    )
    return {job["metadata"]["name"]: job for page in pages for job in page}


def hand_off(rt: Runtime, dispatch_ids: list[str], ttl_s: float = 60.0) -> None:
    """What poll does before it sends `complete_batch` for these Jobs: mark them."""
    current = listed(rt)
    jobs = [current[job_name(d)] for d in dispatch_ids]
    assert handoff.mark(rt.redis, rt.settings.key_prefix, rt.settings.namespace, jobs, ttl_s) == [True] * len(jobs)


def marker_keys(rt: Runtime, dispatch_ids: list[str]) -> list[str]:
    current = listed(rt)
    return [handoff.key(rt.settings.key_prefix, rt.settings.namespace, current[job_name(d)]) for d in dispatch_ids]


def terminal_events(rt: Runtime, dispatch_id: str) -> list[str]:
    with transaction(rt.sessions) as session:
        return [e.type for e in dispatches.events_for(session, dispatch_id) if e.type != EventType.WORKER_SCHEDULED]


def counts(report: SweepReport) -> tuple[int, int, int, int]:
    c = report.categories[C2]
    return c.found, c.acted, c.skipped, c.errors


def redis_state(rt: Runtime) -> dict[bytes, tuple[bytes, int]]:
    """Every key of the runtime's prefix: (value, has a TTL)."""
    keys = sorted(rt.redis.scan_iter(match=f"{rt.settings.key_prefix}*", count=1000))
    return {k: (rt.redis.dump(k), rt.redis.pttl(k) > 0) for k in keys}


# --- deferring to a queued completion ------------------------------------------------------


def test_a_job_handed_to_a_queued_completion_is_left_to_it_until_its_marker_is_gone(make_runtime):
    rt = make_runtime()
    handed, other = finished_jobs(rt, 2)
    hand_off(rt, [handed])

    report = run_sweep(rt)
    assert counts(report) == (2, 1, 0, 0) and report.completions_deferred == 1
    assert report.to_dict()["completions_deferred"] == 1 and "deferred=1" in report.summary()
    assert terminal_events(rt, handed) == [] and terminal_events(rt, other) == [EventType.WORKER_COMPLETED]
    assert job_name(handed) in listed(rt)  # untouched: still waiting for its queued message

    # The message was lost (a broker flush) and the marker expired: the next sweep delivers it.
    rt.redis.delete(*marker_keys(rt, [handed]))
    again = run_sweep(rt)
    assert counts(again) == (1, 1, 0, 0) and again.completions_deferred == 0
    assert terminal_events(rt, handed) == [EventType.WORKER_COMPLETED]
    assert listed(rt) == {}


def test_a_recorded_job_whose_queued_completion_is_releasing_it_is_left_to_it(make_runtime):
    """Category 4 too: the completion wrote the event and is about to patch the Job."""
    rt = make_runtime()
    releasing, stuck = finished_jobs(rt, 2)
    hand_off(rt, [releasing])
    with transaction(rt.sessions) as session:  # what complete_batch wrote before its patch
        for dispatch_id in (releasing, stuck):
            dispatches.record_terminal(session, dispatch_id, EventType.WORKER_COMPLETED, {"output": {}})

    report = run_sweep(rt)
    cleanup = report.categories[Category.CLEANUP]
    assert (cleanup.found, cleanup.acted, report.completions_deferred) == (2, 1, 1)
    assert set(listed(rt)) == {job_name(releasing)}  # the other released and deleted

    rt.redis.delete(*marker_keys(rt, [releasing]))  # that completion died before its patch
    again = run_sweep(rt)
    assert (again.categories[Category.CLEANUP].acted, again.completions_deferred) == (1, 0)
    assert listed(rt) == {}


def test_a_marker_that_expires_by_its_ttl_lets_the_sweep_deliver(make_runtime):
    rt = make_runtime()
    (dispatch_id,) = finished_jobs(rt, 1)
    hand_off(rt, [dispatch_id])
    (key,) = marker_keys(rt, [dispatch_id])
    assert run_sweep(rt).completions_deferred == 1
    # Its TTL runs out: shortened once the sweep above read it (a TTL set short from the start
    # could run out during that sweep on a loaded machine, which then delivered the Job itself).
    assert rt.redis.pexpire(key, 200)
    wait_until(lambda: not rt.redis.exists(key), what="the marker expired", timeout=5.0)
    report = run_sweep(rt)
    assert counts(report) == (1, 1, 0, 0) and report.completions_deferred == 0
    assert terminal_events(rt, dispatch_id) == [EventType.WORKER_COMPLETED]


def test_a_dry_run_reports_the_deferred_job_and_writes_nothing_to_redis(make_runtime):
    rt = make_runtime()
    handed, other = finished_jobs(rt, 2)
    hand_off(rt, [handed])
    before = redis_state(rt)

    report = run_sweep(rt, dry_run=True)
    assert counts(report) == (2, 0, 0, 0) and report.completions_deferred == 1
    assert redis_state(rt) == before  # no marker set, none refreshed, no claim, no counter
    assert terminal_events(rt, handed) == terminal_events(rt, other) == []


def test_with_redis_unreachable_for_the_marker_check_the_sweep_defers_nothing(make_runtime, caplog):
    """Only the sweep's marker check reads `rt.redis`; the guard and the stats keep their own
    (working) client, so the delivery itself still runs as it would."""
    rt = make_runtime(poll_page_size="1")  # a page per Job: the failure is met three times, logged once
    ids = finished_jobs(rt, 3)
    hand_off(rt, ids)  # a live marker for each: with Redis readable, all would be deferred
    unreachable = redis.Redis(port=free_port(), socket_connect_timeout=1, socket_timeout=1)
    blind = dataclasses.replace(rt, redis=unreachable)

    with caplog.at_level(logging.WARNING, logger="recovery.sweep"):
        report = run_sweep(blind)
    unreachable.close()
    assert counts(report) == (3, 3, 0, 0) and report.completions_deferred == 0 and report.errors == 0
    assert all(terminal_events(rt, d) == [EventType.WORKER_COMPLETED] for d in ids)
    assert len([r for r in caplog.records if "hand-off markers unreadable" in r.getMessage()]) == 1


# --- one delivery call per page ------------------------------------------------------------


def test_a_pages_finished_jobs_are_delivered_with_one_pod_list(cluster, make_runtime):
    rt = make_runtime()
    ids = finished_jobs(rt, 5)
    before = Counter({(r.labels.verb, r.labels.resource): r.count for r in cluster.request_counts()})

    report = run_sweep(rt)
    after = Counter({(r.labels.verb, r.labels.resource): r.count for r in cluster.request_counts()})
    after.subtract(before)
    assert counts(report) == (5, 5, 0, 0) and report.jobs_listed == 5
    # One for the batch (one per Job without it), one for the pass over our finished Pods.
    assert after[("LIST", "pods")] == 2
    assert after[("GET", "jobs")] == 0  # the LIST's snapshots, no fresh read per Job
    assert all(terminal_events(rt, d) == [EventType.WORKER_COMPLETED] for d in ids)
    wait_until(lambda: not listed(rt), what="the delivered jobs released", timeout=15.0)
