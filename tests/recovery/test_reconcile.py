"""The sweep's executor against real PostgreSQL, Redis and localcluster over HTTP: the six
categories, grace, attempts, orphan policies, dry runs, stale actions, racing sweeps,
re-notification and the `k8s-dispatch sweep` command. Each test has its own database.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from forged_jobs import SIM, forge_job
from runtimes import Notified, runtime_values, schedule

from k8s_dispatch.delivery import complete, create, jobwatch, records
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.demo.localcluster import LocalCluster
from k8s_dispatch.ops.processes import wait_until
from k8s_dispatch.recovery.executor import ORPHANS_REPORTED, Executor
from k8s_dispatch.recovery.plan import Category, CompleteJob, CreateJob, RecreateJob
from k8s_dispatch.recovery.report import SweepReport
from k8s_dispatch.recovery.sweep import run_sweep
from k8s_dispatch.store import dispatches, migrate
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import Dispatch, DispatchState, EventType, utcnow
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.job_status import job_state
from k8s_dispatch.workers.manifest import FINALIZER, job_name
from k8s_dispatch.workers.resolver import CapabilityResolver
from k8s_dispatch.workers.types import DispatchRef

REPO = Path(__file__).resolve().parents[2]
SCHEDULED, CREATED = DispatchState.SCHEDULED, DispatchState.CREATED
C1, C2, C3, C4, C5, C6 = (
    Category.SCHEDULED_WITHOUT_JOB, Category.FINISHED_UNRECORDED, Category.RUNNING,
    Category.CLEANUP, Category.JOB_LOST, Category.ORPHAN,
)  # fmt: skip


def capability(**sim: str) -> dict[str, Any]:
    return {
        "worker": "sim",
        "image": "sim:1",
        "activeDeadlineSeconds": None,
        "annotations": {SIM + "duration-ms": "20", **{SIM + k.replace("_", "-"): v for k, v in sim.items()}},
    }


CAPABILITIES = {"capabilities": {"sim.ok": capability(), "sim.hang": capability(outcome="hang")}}


def expected_output(value: Any) -> dict[str, Any]:
    return {"simulated": True, "input": value}


@pytest.fixture
def cluster(sim_cluster: LocalCluster) -> LocalCluster:
    return sim_cluster


@pytest.fixture
def runtime_env(cluster, new_pg_database, redis_url, key_prefix, tmp_path) -> dict[str, str]:
    """K8S_DISPATCH_* of this test: its own database, namespace and Redis prefix."""
    database_url = new_pg_database()
    migrate.upgrade(database_url)
    return runtime_values(
        database_url=database_url, redis_url=redis_url, prefix=f"{key_prefix}-{uuid.uuid4().hex[:8]}",
        namespace=f"rc-{uuid.uuid4().hex[:8]}", kubeconfig=cluster.kubeconfig, capabilities=CAPABILITIES,
        tmp=tmp_path, sweep_grace_s="0", poll_page_size="7", guard_lease_ms="10000",
    )  # fmt: skip


# --- helpers -------------------------------------------------------------------------------


def jobs(rt: Runtime, namespace: str | None = None) -> dict[str, dict[str, Any]]:
    """Our Jobs in the namespace, by name."""
    ns = namespace or rt.settings.namespace
    return {
        j["metadata"]["name"]: j for page in rt.kube.iter_jobs(ns, label_selector=job_labels.selector()) for j in page
    }


def our_pods(rt: Runtime, namespace: str | None = None) -> dict[str, dict[str, Any]]:
    """Our Pods in the namespace (their Jobs' template labels), by name."""
    ns = namespace or rt.settings.namespace
    return {p["metadata"]["name"]: p for p in rt.kube.list_pods(ns, label_selector=job_labels.selector())}


def wait_finished(rt: Runtime, names: list[str], namespace: str | None = None) -> None:
    def done() -> bool:
        current = jobs(rt, namespace)
        return all(n in current and job_state(current[n]).terminal for n in names)

    wait_until(done, what=f"{len(names)} jobs finished", timeout=15.0)


def terminal_events(rt: Runtime, dispatch_id: str) -> list[tuple[str, Any]]:
    with transaction(rt.sessions) as session:
        return [
            (e.type, e.payload)
            for e in dispatches.events_for(session, dispatch_id)
            if e.type != EventType.WORKER_SCHEDULED
        ]


def record(rt: Runtime, dispatch_id: str) -> Any:
    return records.load_record(rt, dispatch_id)


def counts(report: SweepReport, category: Category) -> tuple[int, int, int, int]:
    c = report.categories[category]
    return c.found, c.acted, c.skipped, c.errors


def found(report: SweepReport) -> dict[int, int]:
    """Category number -> found, leaving out the zeros."""
    return {c.value: n.found for c, n in report.categories.items() if n.found}


def lose_job(rt: Runtime, dispatch_id: str) -> None:
    """Strip our finalizer and delete the Job, as an operator might: its result is gone."""
    namespace, name = rt.settings.namespace, job_name(dispatch_id)
    rt.kube.remove_finalizer(namespace, name, FINALIZER)
    rt.kube.delete_job(namespace, name)
    wait_until(lambda: name not in jobs(rt), what=f"job {name} gone", timeout=15.0)


# --- 1 and 2: created, then completed -------------------------------------------------------


def test_scheduled_dispatches_without_a_job_are_created_then_completed_once(rt, notified):
    values = [{"i": i} for i in range(10)]
    ids = [schedule(rt, "sim.ok", v) for v in values]

    first = run_sweep(rt)
    assert counts(first, C1) == (10, 10, 0, 0)
    assert first.dispatches_checked == 10 and first.errors == 0
    assert set(jobs(rt)) == {job_name(d) for d in ids}
    assert all(record(rt, d).state is CREATED for d in ids)

    wait_finished(rt, [job_name(d) for d in ids])
    second = run_sweep(rt)
    assert found(second) == {2: 10} and counts(second, C2) == (10, 10, 0, 0)
    assert second.jobs_listed == 10
    for dispatch_id, value in zip(ids, values, strict=True):
        assert terminal_events(rt, dispatch_id) == [(EventType.WORKER_COMPLETED, {"output": expected_output(value)})]
    assert sorted(notified.ids) == sorted(ids)
    wait_until(lambda: not jobs(rt), what="no job left", timeout=15.0)

    third = run_sweep(rt)
    assert found(third) == {} and third.errors == 0 and third.unnotified.found == 0


def test_a_dispatch_inside_the_grace_period_is_left_to_the_normal_path(make_runtime):
    rt = make_runtime(sweep_grace_s="60")
    dispatch_id = schedule(rt)
    report = run_sweep(rt)
    assert found(report) == {} and report.dispatches_checked == 0
    assert jobs(rt) == {} and record(rt, dispatch_id).state is SCHEDULED


def test_the_sweep_reports_how_long_the_oldest_dispatch_scheduled_without_a_job_waited(rt):
    older, newer = schedule(rt), schedule(rt)
    with transaction(rt.sessions) as session:
        written = {d: session.get(Dispatch, d).updated_at for d in (older, newer)}  # type: ignore[union-attr]
    later = max(written.values()) + timedelta(seconds=300)
    report = run_sweep(rt, now=later)
    assert counts(report, C1) == (2, 2, 0, 0)
    assert report.oldest_scheduled_s == (later - min(written.values())).total_seconds()
    assert report.oldest_scheduled_s >= 300
    # Both have their Jobs now: none is left scheduled.
    assert run_sweep(rt, now=later).oldest_scheduled_s == 0


def test_a_job_in_a_namespace_the_config_no_longer_names_is_still_found_and_completed(
    make_runtime, runtime_env, notified
):
    old_namespace = runtime_env["K8S_DISPATCH_NAMESPACE"] + "-old"
    moved = {"capabilities": {"sim.ok": {**capability(), "namespace": old_namespace}}}
    before = make_runtime(notifier=notified, resolver=CapabilityResolver.from_mapping(moved, source="<before>"))
    dispatch_id = schedule(before, "sim.ok", {"moved": True})
    create.create_job_for(before, dispatch_id)
    wait_finished(before, [job_name(dispatch_id)], namespace=old_namespace)

    after = make_runtime(notifier=notified)  # the capability's Jobs now go to the settings' namespace
    assert old_namespace not in after.namespaces()
    report = run_sweep(after)
    assert old_namespace in report.namespaces
    assert counts(report, C2) == (1, 1, 0, 0)
    assert terminal_events(after, dispatch_id) == [
        (EventType.WORKER_COMPLETED, {"output": expected_output({"moved": True})})
    ]
    wait_until(lambda: not jobs(after, old_namespace), what="the job cleaned up where it was", timeout=15.0)


# --- 3: running ---------------------------------------------------------------------------


def test_running_jobs_are_reported_and_a_job_never_marked_created_is_adopted(rt):
    marked = schedule(rt, "sim.hang")
    create.create_job_for(rt, marked)
    unmarked = schedule(rt, "sim.hang")
    # The crash after the Job's creation, before the row was marked: the Job exists, the row says SCHEDULED.
    rec = record(rt, unmarked)
    from k8s_dispatch.workers.manifest import build_job

    body = build_job(
        rec.ref,
        input=rec.input,
        spec=rt.resolver.spec(rec.capability),
        namespace=rt.settings.namespace,
        deployment=rt.settings.effective_deployment,
    )
    rt.kube.create_job(rt.settings.namespace, body)
    assert record(rt, unmarked).state is SCHEDULED

    report = run_sweep(rt)
    assert found(report) == {3: 2}
    assert counts(report, C3) == (2, 1, 0, 0)  # only the adoption is an act
    assert record(rt, unmarked).state is CREATED and record(rt, unmarked).job_name == job_name(unmarked)
    assert terminal_events(rt, marked) == terminal_events(rt, unmarked) == []
    assert len(jobs(rt)) == 2  # adopted, never doubled


# --- 4: recorded, Job still there ------------------------------------------------------------


def test_jobs_whose_end_is_recorded_are_cleaned_up_including_a_cancelled_running_one(cluster, rt, notified):
    done = schedule(rt, "sim.ok")
    create.create_job_for(rt, done)
    wait_finished(rt, [job_name(done)])
    running = schedule(rt, "sim.hang")
    create.create_job_for(rt, running)
    with transaction(rt.sessions) as session:  # the crash after the write, before the clean-up
        dispatches.record_terminal(session, done, EventType.WORKER_COMPLETED, {"output": {"by": "test"}})
        dispatches.record_terminal(session, running, EventType.WORKER_CANCELLED, {"reason": "Cancelled"})

    cluster.audit(clear=True)
    report = run_sweep(rt)
    assert counts(report, C4) == (2, 2, 0, 0) and found(report) == {4: 2, 7: 1}
    # The cancelled one's Job, deleted above, is then seen gone: its slot is free (the completed one never held it).
    assert counts(report, Category.STOPPING) == (1, 1, 0, 0)
    with transaction(rt.sessions) as session:
        stopped = {d: dispatches.get_dispatch(session, d).job_stopped_at for d in (done, running)}
    assert stopped[done] is None and stopped[running] is not None
    wait_until(lambda: not jobs(rt), what="both jobs deleted", timeout=15.0)
    # Released from the LIST's snapshots (a patch each, their Pods listed once and a patch each),
    # removed by one bulk delete, the running one too; and no Pod is kept by our finalizer.
    assert cluster.audit() == {
        ("batch", "jobs", "list"), ("batch", "jobs", "patch"), ("batch", "jobs", "deletecollection"),
        ("", "pods", "list"), ("", "pods", "patch"),
    }  # fmt: skip
    wait_until(lambda: not our_pods(rt), what="their pods deleted", timeout=15.0)
    assert terminal_events(rt, done) == [(EventType.WORKER_COMPLETED, {"output": {"by": "test"}})]
    assert terminal_events(rt, running) == [(EventType.WORKER_CANCELLED, {"reason": "Cancelled"})]
    # Their notifications were never sent (the crash): the sweep sent them.
    assert report.unnotified.acted == 2 and sorted(notified.ids) == sorted([done, running])


def test_a_delivered_job_the_bulk_delete_missed_is_in_no_category_and_the_sweep_deletes_it(cluster, rt, notified):
    ids = [schedule(rt, "sim.ok", {"i": i}) for i in range(3)]
    for dispatch_id in ids:
        create.create_job_for(rt, dispatch_id)
    wait_finished(rt, [job_name(d) for d in ids])
    for dispatch_id in ids:  # delivered and released; the bulk delete never came (a crash, an API error)
        assert complete.complete_job(rt, rt.settings.namespace, job_name(dispatch_id), delete=False) is (
            complete.CompleteOutcome.COMPLETED
        )
    left = jobs(rt)
    assert set(left) == {job_name(d) for d in ids}
    assert all(
        job_labels.is_delivered(j["metadata"]["labels"]) and not j["metadata"].get("finalizers") for j in left.values()
    )

    cluster.audit(clear=True)
    report = run_sweep(rt)
    assert found(report) == {} and report.errors == 0 and report.jobs_listed == 0  # not orphans, not unrecorded
    wait_until(lambda: not jobs(rt), what="the delivered jobs deleted", timeout=15.0)
    # And one LIST of our finished Pods: the delivery freed them, so nothing more.
    assert cluster.audit() == {("batch", "jobs", "list"), ("batch", "jobs", "deletecollection"), ("", "pods", "list")}
    assert all(len(terminal_events(rt, d)) == 1 for d in ids) and sorted(notified.ids) == sorted(ids)


def test_a_pod_an_ended_dispatch_left_held_is_freed_and_one_of_an_open_dispatch_is_kept(cluster, rt, notified):
    """A Job deleted without its release (our finalizer stripped) leaves its Pods held by ours:
    freed once the dispatch has ended, kept while it is open (its re-run may still need it)."""
    ended, open_ = schedule(rt, "sim.ok"), schedule(rt, "sim.ok")
    for dispatch_id in (ended, open_):
        create.create_job_for(rt, dispatch_id)
    wait_finished(rt, [job_name(ended), job_name(open_)])
    with transaction(rt.sessions) as session:  # recorded, then the crash before the release
        dispatches.record_terminal(session, ended, EventType.WORKER_COMPLETED, {"output": {"by": "test"}})
    for dispatch_id in (ended, open_):
        lose_job(rt, dispatch_id)
    held = {name for name, pod in our_pods(rt).items() if FINALIZER in pod["metadata"].get("finalizers", [])}
    assert len(held) == 2 and all(pod["metadata"].get("deletionTimestamp") for pod in our_pods(rt).values())

    report = run_sweep(rt)
    assert counts(report, C4) == (1, 1, 0, 0) and counts(report, C5) == (1, 1, 0, 0), report.to_dict()
    wait_until(
        lambda: len(our_pods(rt)) == 2, what="the ended dispatch's pod gone (the re-run's is there)", timeout=15.0
    )
    old = [name for name, pod in our_pods(rt).items() if pod["metadata"].get("deletionTimestamp")]
    assert len(old) == 1 and old[0] in held  # the open dispatch's old Pod, still held

    wait_finished(rt, [job_name(open_)])
    report = run_sweep(rt)  # the re-run delivered; its old Pod freed in the same sweep
    assert terminal_events(rt, open_)[0][0] == EventType.WORKER_COMPLETED
    wait_until(lambda: not our_pods(rt) and not jobs(rt), what="every pod and job gone", timeout=15.0)


# --- 5: lost Jobs ----------------------------------------------------------------------------


def test_a_lost_job_is_recreated_up_to_the_attempts_limit_then_fails_as_job_lost(rt, notified):
    assert rt.settings.max_job_attempts == 3
    dispatch_id = schedule(rt, "sim.hang")
    create.create_job_for(rt, dispatch_id)
    for attempt in (1, 2):
        lose_job(rt, dispatch_id)
        report = run_sweep(rt)
        assert counts(report, C5) == (1, 1, 0, 0), report.to_dict()
        job = jobs(rt)[job_name(dispatch_id)]
        assert job["metadata"]["annotations"][job_labels.ATTEMPT_KEY] == str(attempt)
        assert record(rt, dispatch_id).attempts == attempt and record(rt, dispatch_id).state is CREATED
        # Sweeping again with the Job back changes nothing: it runs.
        assert found(run_sweep(rt)) == {3: 1}

    lose_job(rt, dispatch_id)
    report = run_sweep(rt)
    assert counts(report, C5) == (1, 1, 0, 0)
    [(event_type, payload)] = terminal_events(rt, dispatch_id)
    assert (event_type, payload["reason"]) == (EventType.WORKER_FAILED, "JobLost")
    assert "3 attempt(s)" in payload["message"]
    assert jobs(rt) == {} and notified.ids == [dispatch_id]
    assert found(run_sweep(rt)) == {}


def test_a_lost_job_inside_the_grace_period_is_not_recreated_yet(make_runtime):
    rt = make_runtime(sweep_grace_s="60")
    dispatch_id = schedule(rt, "sim.hang")
    with transaction(rt.sessions) as session:  # an old row, so category 1 does not wait for it
        dispatches.mark_created(
            session, dispatch_id, job_name=job_name(dispatch_id), namespace=rt.settings.namespace, attempt=0
        )
    assert found(run_sweep(rt)) == {}
    assert record(rt, dispatch_id).attempts == 0 and jobs(rt) == {}


def test_a_job_a_list_finds_lost_inside_the_grace_is_checked_again_by_the_watched_sweeps(make_runtime):
    """A LIST stands for the namespace until the next one, up to `sweep_list_interval_s` on; a
    created dispatch it finds without its Job inside the grace (lost while the watch could not
    see it: a relist after the broker lost its position) is noted for the watched sweeps, which
    run it again once the grace is over."""
    rt = make_runtime(sweep_grace_s="2", sweep_list_interval_s="3600")
    dispatch_id = schedule(rt, "sim.hang")
    create.create_job_for(rt, dispatch_id)
    lose_job(rt, dispatch_id)
    assert found(run_sweep(rt)) == {}  # the LIST: inside the grace, nothing done yet
    settings = rt.settings
    watch = jobwatch.key(settings.key_prefix, settings.effective_deployment, settings.namespace)
    assert dispatch_id in jobwatch.gone(rt.redis, watch) and rt.redis.exists(jobwatch.listed_key(watch))
    rt.redis.set(jobwatch.healthy_key(watch), 1, ex=600)  # poll's watch healthy: no LIST for an hour

    def again() -> bool:
        run_sweep(rt, watched=True)
        return record(rt, dispatch_id).attempts == 1

    wait_until(again, what="the lost Job made again", timeout=20.0)
    assert job_name(dispatch_id) in jobs(rt) and dispatch_id not in jobwatch.gone(rt.redis, watch)


# --- 6: never delivered -------------------------------------------------------------------------


def mismatched(rt: Runtime) -> tuple[str, str, str]:
    """A forged Job (no dispatch) and a dispatch whose Job carries another tenancy; both finished."""
    forged_ref = DispatchRef(
        dispatch_id=str(uuid.uuid4()), case_id="c", tenancy_id="tenant-a", capability="sim.ok",  # type: ignore[arg-type]
        worker_name="sim", idempotency_key="k",  # type: ignore[arg-type]
    )  # fmt: skip
    forged = forge_job(rt.kube, rt.settings.namespace, forged_ref, deployment=rt.settings.effective_deployment)
    victim = schedule(rt, "sim.ok", tenancy="tenant-a")
    wrong = DispatchRef(**{**record(rt, victim).ref.__dict__, "tenancy_id": "Tenant-A"})
    forge_job(rt.kube, rt.settings.namespace, wrong, deployment=rt.settings.effective_deployment)
    wait_finished(rt, [forged, job_name(victim)])
    return forged_ref.dispatch_id, forged, victim


def test_forged_and_tenancy_mismatched_jobs_are_reported_and_never_delivered(rt, notified):
    forged_id, forged, victim = mismatched(rt)
    before = rt.stats.get(ORPHANS_REPORTED)
    for sweep in (1, 2):
        report = run_sweep(rt)
        # The forged Job is an orphan; the mismatched one, under the victim's name, is its Job
        # hand-edited (category 8): noted at the first sweep, within its grace at the second.
        assert found(report) == {6: 1, 8: 1}, report.to_dict()
        assert counts(report, C6) == (1, 0, 0, 0)
        assert counts(report, Category.TAMPERED) == ((1, 1, 0, 0) if sweep == 1 else (1, 0, 0, 0))
        assert rt.stats.get(ORPHANS_REPORTED) == before + sweep
    assert terminal_events(rt, victim) == [] and record(rt, victim).state is SCHEDULED
    with transaction(rt.sessions) as session:
        assert dispatches.events_for(session, forged_id) == []
    assert set(jobs(rt)) == {forged, job_name(victim)}  # left alone (policy: report)
    assert notified.ids == []


def test_with_the_delete_policy_orphans_are_deleted_and_the_victim_then_gets_its_own_job(make_runtime, notified):
    rt = make_runtime(notifier=notified, orphan_policy="delete")
    forged_id, forged, victim = mismatched(rt)
    report = run_sweep(rt)
    assert counts(report, C6) == (1, 1, 0, 0)  # the forged one
    assert counts(report, Category.TAMPERED) == (1, 1, 0, 0)  # the victim's, hand-edited
    # With the mismatched Job gone, the same sweep found the victim without one and created its own.
    assert counts(report, C1) == (1, 1, 0, 0)
    assert terminal_events(rt, victim) == []
    wait_until(lambda: forged not in jobs(rt), what="forged job deleted", timeout=15.0)
    job = jobs(rt)[job_name(victim)]
    assert job_labels.decode(job["metadata"]["labels"], job["metadata"]["annotations"]).tenancy_id == "tenant-a"
    wait_finished(rt, [job_name(victim)])
    assert counts(run_sweep(rt), C2) == (1, 1, 0, 0)
    assert terminal_events(rt, victim) == [(EventType.WORKER_COMPLETED, {"output": expected_output({"n": 1})})]
    with transaction(rt.sessions) as session:
        assert dispatches.events_for(session, forged_id) == []


# --- dry run, stale actions, races ------------------------------------------------------------


def test_a_dry_run_counts_everything_and_changes_nothing(make_runtime, notified):
    rt = make_runtime(notifier=notified, orphan_policy="delete")
    scheduled = schedule(rt, "sim.ok")
    finished = schedule(rt, "sim.ok")
    create.create_job_for(rt, finished)
    _, _forged, _victim = mismatched(rt)
    wait_finished(rt, [job_name(finished)])
    before = jobs(rt)

    report = run_sweep(rt, dry_run=True)
    assert report.dry_run
    # The victim has a (mismatched) Job under its name, so only `scheduled` lacks one.
    assert found(report) == {1: 1, 2: 1, 6: 1, 8: 1}
    assert all(c.acted == c.skipped == c.errors == 0 for c in report.categories.values())
    assert jobs(rt).keys() == before.keys()
    assert record(rt, scheduled).state is SCHEDULED and terminal_events(rt, finished) == []
    assert rt.stats.get(ORPHANS_REPORTED) == 0 and notified.ids == []


def test_stale_actions_find_nothing_left_to_do(rt):
    done = schedule(rt, "sim.ok")
    create.create_job_for(rt, done)
    wait_finished(rt, [job_name(done)])
    assert complete.complete_job(rt, rt.settings.namespace, job_name(done)) is complete.CompleteOutcome.COMPLETED
    wait_until(lambda: not jobs(rt), what="job cleaned up", timeout=15.0)
    lost = schedule(rt, "sim.hang")
    create.create_job_for(rt, lost)
    lose_job(rt, lost)
    where = dict(namespace=rt.settings.namespace)

    # Planned from a page read before normal work finished `done`, and before another sweep
    # re-created `lost` (its attempts moved on).
    with transaction(rt.sessions) as session:
        session.execute(sa.update(Dispatch).where(Dispatch.dispatch_id == lost).values(attempts=Dispatch.attempts + 1))
    report = SweepReport(dry_run=False, started_at=utcnow())
    with Executor(rt, report, dry_run=False) as executor:
        executor.all(
            [
                CreateJob(dispatch_id=done, job_name=job_name(done), **where),
                CompleteJob(dispatch_id=done, job_name=job_name(done), **where),
                RecreateJob(dispatch_id=lost, job_name=job_name(lost), attempts=0, **where),
            ]
        )
    assert counts(report, C1) == (1, 0, 1, 0)
    assert counts(report, C2) == (1, 0, 1, 0)
    assert counts(report, C5) == (1, 0, 1, 0)
    assert jobs(rt) == {}  # the finished dispatch's Job was not re-created, the lost one not twice
    assert len(terminal_events(rt, done)) == 1 and record(rt, lost).attempts == 1


def test_sweeps_racing_each_other_deliver_each_result_once(make_runtime):
    replicas = [make_runtime(notifier=Notified()) for _ in range(3)]
    rt = replicas[0]
    values = [{"i": i} for i in range(30)]
    ids = [schedule(rt, "sim.ok", v) for v in values]
    for dispatch_id in ids:
        create.create_job_for(rt, dispatch_id)
    lost = [schedule(rt, "sim.hang") for _ in range(3)]
    for dispatch_id in lost:
        create.create_job_for(rt, dispatch_id)
        lose_job(rt, dispatch_id)
    wait_finished(rt, [job_name(d) for d in ids])

    barrier = threading.Barrier(len(replicas))
    reports: list[SweepReport] = []

    def sweep(replica: Runtime) -> None:
        barrier.wait()
        reports.append(run_sweep(replica))

    threads = [threading.Thread(target=sweep, args=(r,)) for r in replicas]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert len(reports) == 3 and all(r.errors == 0 for r in reports), [r.to_dict() for r in reports]
    assert sum(r.categories[C2].acted for r in reports) == 30
    assert sum(r.categories[C5].acted for r in reports) == 3  # each lost Job re-created once
    for dispatch_id, value in zip(ids, values, strict=True):
        assert terminal_events(rt, dispatch_id) == [(EventType.WORKER_COMPLETED, {"output": expected_output(value)})]
    for dispatch_id in lost:
        assert record(rt, dispatch_id).attempts == 1
    notified_ids = [i for r in replicas for i in r.notifier.ids]
    assert sorted(notified_ids) == sorted(ids)


def test_a_notification_that_failed_is_sent_by_the_sweep(rt, notified):
    dispatch_id = schedule(rt, "sim.ok")
    create.create_job_for(rt, dispatch_id)
    wait_finished(rt, [job_name(dispatch_id)])
    notified.fail = True
    assert complete.complete_job(rt, rt.settings.namespace, job_name(dispatch_id)) is complete.CompleteOutcome.COMPLETED
    assert notified.ids == [] and not record(rt, dispatch_id).notified

    failing = run_sweep(rt)
    assert (failing.unnotified.found, failing.unnotified.errors) == (1, 1)
    notified.fail = False
    report = run_sweep(rt)
    assert (report.unnotified.found, report.unnotified.acted) == (1, 1)
    assert notified.ids == [dispatch_id] and record(rt, dispatch_id).notified
    assert run_sweep(rt).unnotified.found == 0


def test_an_unreachable_api_is_an_error_not_a_crash(rt, cluster):
    dispatch_id = schedule(rt, "sim.ok")
    cluster.set_faults(1.0, 0)
    try:
        report = run_sweep(rt)
    finally:
        cluster.set_faults(0.0, 0)
    assert report.errors >= 1 and report.problems
    assert "ApiUnavailable" in report.problems[0]
    assert record(rt, dispatch_id).state is SCHEDULED
    assert counts(run_sweep(rt), C1) == (1, 1, 0, 0)  # the next sweep does it


# --- the command -----------------------------------------------------------------------------


def recover(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "k8s_dispatch.cli", "sweep", *args],
        env={**env_without_ours(), **env},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def env_without_ours() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("K8S_DISPATCH_")}


def test_the_recover_command_prints_counts_and_exits_non_zero_on_errors(rt, runtime_env, cluster):
    dispatch_id = schedule(rt, "sim.ok")

    dry = recover(runtime_env, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.splitlines()
    assert lines[0].split() == ["category", "found", "acted", "skipped", "errors"]
    assert lines[1].split() == ["1", "scheduled_without_job", "1", "0", "0", "0"]
    assert "dry run: nothing was changed" in dry.stdout
    assert record(rt, dispatch_id).state is SCHEDULED

    real = recover(runtime_env, "--json")
    assert real.returncode == 0, real.stderr
    data = json.loads(real.stdout)
    assert data["categories"]["scheduled_without_job"] == {"found": 1, "acted": 1, "skipped": 0, "errors": 0}
    assert data["errors"] == 0 and data["dry_run"] is False
    assert record(rt, dispatch_id).state is CREATED

    cluster.set_faults(1.0, 0)
    try:
        broken = recover(runtime_env, "--json")
    finally:
        cluster.set_faults(0.0, 0)
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert json.loads(broken.stdout)["errors"] >= 1
