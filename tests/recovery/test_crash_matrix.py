"""Restarts lose nothing, replicas deliver nothing twice: `celery -A tasks worker|beat` processes,
PostgreSQL, Redis and localcluster. A worker SIGKILLs itself at each crash point, a fresh one
converges; then a flushed broker, three replicas on one backlog, a flaky restarting API server,
forged Jobs, and the start-up sweep's ordering.
"""

from __future__ import annotations

import base64
import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import yaml
from celery import Celery
from clusters import ClusterHandle
from forged_jobs import SIM, forge_job

from k8s_dispatch import celeryconfig as names
from k8s_dispatch.core.errors import ApiUnavailable
from k8s_dispatch.core.settings import Settings, load_settings
from k8s_dispatch.delivery import create, records, stats
from k8s_dispatch.delivery.crashpoints import ENV_VAR as CRASH_AT
from k8s_dispatch.delivery.crashpoints import Point
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.demo.localcluster.cluster import token_from_kubeconfig
from k8s_dispatch.ops.processes import ManagedProcess, celery_beat, celery_worker, wait_until
from k8s_dispatch.recovery.executor import ORPHANS_REPORTED
from k8s_dispatch.store import dispatches, migrate, scheduling
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import DispatchState, EventType
from k8s_dispatch.tasks.recovery_tasks import STARTUP_SWEEP_DONE
from k8s_dispatch.tasks.scheduling import schedule_in_session
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.job_status import job_state
from k8s_dispatch.workers.manifest import FINALIZER, job_name
from k8s_dispatch.workers.types import DispatchRef

CAPABILITIES = {
    "capabilities": {
        "sim.ok": {"worker": "sim", "image": "sim:1", "annotations": {SIM + "duration-ms": "30"}},
    }
}
WORKER_START_S = 60.0  # a cold `celery worker` on a busy 2-core machine
CONVERGE_S = 90.0


def expected_output(value: Any) -> dict[str, Any]:
    return {"simulated": True, "input": value}


# --- one deployment of k8s-dispatch per test ---------------------------------------------------


@dataclass
class Site:
    """One test's k8s-dispatch: its settings, database, Redis prefix, namespace and processes.

    Beside tests/tasks/conftest.py's Deployment, not one with it: this one starts workers with a
    crash point armed and reads through a Runtime (guard claims, raw rows) where that one
    schedules as an engine does through a producer; the few lines they share (settings,
    namespace, prefix) are the shape of any deployment."""

    values: dict[str, str]
    settings: Settings
    tmp: Path
    rt: Runtime  # the test's own view: DB sessions, kube client, Redis (no notifier)
    producer: Celery
    procs: list[ManagedProcess] = field(default_factory=list)

    @property
    def namespace(self) -> str:
        return self.settings.namespace

    @property
    def prefix(self) -> str:
        return self.settings.key_prefix

    # processes

    def worker(
        self, name: str, *, crash_at: str | None = None, concurrency: int = 4, start: bool = True, **overrides: str
    ) -> ManagedProcess:
        env = {**self.values, **{f"K8S_DISPATCH_{k.upper()}": v for k, v in overrides.items()}}
        if crash_at is not None:
            env[CRASH_AT] = crash_at
        proc = celery_worker(name, env=env, log_dir=self.tmp, concurrency=concurrency)
        self.procs.append(proc)
        return proc.start() if start else proc

    def beat(self) -> ManagedProcess:
        proc = celery_beat(env=self.values, log_dir=self.tmp)
        self.procs.append(proc)
        return proc.start()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} ---\n{p.log_tail(60)}" for p in self.procs)

    def wait(self, predicate: Callable[[], Any], *, timeout_s: float = CONVERGE_S, what: str) -> Any:
        return wait_until(predicate, timeout=timeout_s, what=what, details=self.logs)

    def wait_killed(self, proc: ManagedProcess, *, timeout_s: float = 60.0) -> None:
        """Wait for the worker to kill itself at its crash point, and check it died by SIGKILL."""
        self.wait(lambda: not proc.alive, timeout_s=timeout_s, what=f"{proc.name} to die at its crash point")
        assert proc.returncode == -signal.SIGKILL, f"{proc.name} exited with {proc.returncode}\n{proc.log_tail()}"

    # the engine's side

    def new_case(self, tenancy: str = "tenant-a") -> str:
        case_id = f"case-{uuid.uuid4().hex[:10]}"
        with transaction(self.rt.sessions) as session:
            scheduling.create_case(session, case_id=case_id, tenancy_id=tenancy)
        return case_id

    def schedule(self, values: list[Any], *, send: bool = True) -> list[str]:
        """Dispatches written in the test's transaction; `create_jobs` sent after commit if `send`
        (else as an engine in another language would: the row only)."""
        case_id = self.new_case()
        ids = []
        with transaction(self.rt.sessions) as session:
            for value in values:
                request = dict(
                    case_id=case_id, tenancy_id="tenant-a", capability="sim.ok", input=value,
                    idempotency_key=f"key-{uuid.uuid4()}", router=self.rt.resolver,
                    max_input_bytes=self.settings.max_input_bytes,
                )  # fmt: skip
                result = (
                    schedule_in_session(session, via=self.producer, **request)
                    if send
                    else scheduling.schedule(session, **request)
                )
                ids.append(result.dispatch_id)
        return ids

    def schedule_by_task(self, values: list[Any]) -> list[str]:
        """Dispatches requested with the Celery `schedule` task; ids chosen here."""
        case_id = self.new_case()
        ids = [str(uuid.uuid4()) for _ in values]
        for dispatch_id, value in zip(ids, values, strict=True):
            self.producer.send_task(
                names.SCHEDULE_TASK,
                args=[case_id, "tenant-a", "sim.ok", value, f"key-{dispatch_id}"],
                kwargs={"dispatch_id": dispatch_id},
            )
        return ids

    def rows(self, ids: list[str]) -> dict[str, Any]:
        with transaction(self.rt.sessions) as session:
            return dispatches.get_dispatches(session, ids)

    def terminal_events(self, ids: list[str]) -> dict[str, list[tuple[str, Any]]]:
        with transaction(self.rt.sessions) as session:
            return {
                d: [
                    (e.type, e.payload)
                    for e in dispatches.events_for(session, d)
                    if e.type != EventType.WORKER_SCHEDULED
                ]
                for d in ids
            }

    def all_terminal(self, ids: list[str]) -> bool:
        rows = self.rows(ids)
        return len(rows) == len(ids) and all(r.terminal for r in rows.values())

    def jobs(self) -> list[dict[str, Any]]:
        """Our Jobs in the namespace; the test's own reads retry the faults a flaky API injects."""
        for _ in range(20):
            try:
                return [
                    j
                    for page in self.rt.kube.iter_jobs(self.namespace, label_selector=job_labels.selector())
                    for j in page
                ]
            except ApiUnavailable:
                time.sleep(0.05)
        raise AssertionError("the API server kept failing the test's own reads")

    def notifications(self) -> list[str]:
        """Dispatch ids of the engine notifications queued so far (the messages are kept)."""
        ids = []
        for message in self.rt.redis.lrange(f"{self.prefix}:{self.settings.notify_queue}", 0, -1):
            envelope = json.loads(message)
            args, _kwargs, _embed = json.loads(base64.b64decode(envelope["body"]))
            ids.append(args[0])
        return ids

    def claims(self) -> list[bytes]:
        return list(self.rt.redis.scan_iter(match=f"{self.prefix}:claim:*", count=1000))

    def assert_delivered_once(self, ids: list[str], values: list[Any]) -> None:
        """Every dispatch: exactly one terminal event, the right output; no Job, finalizer or claim left."""
        self.wait(lambda: self.all_terminal(ids), what=f"{len(ids)} dispatches terminal")
        events = self.terminal_events(ids)
        for dispatch_id, value in zip(ids, values, strict=True):
            assert events[dispatch_id] == [(EventType.WORKER_COMPLETED, {"output": expected_output(value)})], (
                dispatch_id
            )
        self.wait(lambda: not self.jobs(), timeout_s=30, what="no Job (and so no finalizer) left")
        self.wait(lambda: set(self.notifications()) >= set(ids), timeout_s=30, what="every dispatch notified")
        # A claim whose holder died expires (lease 5 s): none is held for ever.
        self.wait(lambda: not self.claims(), timeout_s=15, what="no guard claim left")

    def stop(self) -> list[str]:
        """SIGTERM (warm shutdown) to every live process at once, then wait for each."""
        alive = [p for p in self.procs if p.alive]
        for proc in alive:
            proc.kill(signal.SIGTERM)
        problems = []
        for proc in alive:
            code = proc.stop(timeout=30)
            if code not in (0, -signal.SIGTERM):
                problems.append(f"{proc.name} exited with {code}\n{proc.log_tail()}")
        return problems


def site_env(database_url: str, redis_url: str, prefix: str, kubeconfig: Path, tmp: Path) -> dict[str, str]:
    caps = tmp / "capabilities.yaml"
    caps.write_text(yaml.safe_dump(CAPABILITIES))
    return {
        "K8S_DISPATCH_DATABASE_URL": database_url,
        "K8S_DISPATCH_REDIS_URL": redis_url,
        "K8S_DISPATCH_KEY_PREFIX": f"{prefix}-{uuid.uuid4().hex[:8]}",
        "K8S_DISPATCH_NAMESPACE": f"cm-{uuid.uuid4().hex[:8]}",
        "K8S_DISPATCH_KUBECONFIG": str(kubeconfig),
        "K8S_DISPATCH_CAPABILITIES": str(caps),
        # Fast recovery for tests: sweeps every second on rows a second old, claims of dead
        # holders expiring after 5 s, polls 4 times a second.
        "K8S_DISPATCH_SWEEP_GRACE_S": "1",
        "K8S_DISPATCH_SWEEP_INTERVAL_S": "1",
        "K8S_DISPATCH_POLL_INTERVAL_S": "0.25",
        "K8S_DISPATCH_GUARD_LEASE_MS": "5000",
        "K8S_DISPATCH_WORKER_CONCURRENCY": "4",
    }


@pytest.fixture
def make_site(new_pg_database, redis_url, key_prefix, tmp_path) -> Iterator[Callable[..., Site]]:
    made: list[Site] = []

    def make(cluster: ClusterHandle | Path, **overrides: str) -> Site:
        kubeconfig = cluster.kubeconfig if isinstance(cluster, ClusterHandle) else cluster
        database_url = new_pg_database()
        migrate.upgrade(database_url)
        tmp = tmp_path / f"site-{len(made)}"
        tmp.mkdir()
        values = site_env(database_url, redis_url, key_prefix, kubeconfig, tmp)
        values.update({f"K8S_DISPATCH_{k.upper()}": v for k, v in overrides.items()})
        settings = load_settings(values)
        if isinstance(cluster, ClusterHandle):
            cluster.ensure_namespace(settings.namespace)
        producer = Celery("test-producer", set_as_current=False)
        producer.conf.update(names.config(settings))
        site = Site(values=values, settings=settings, tmp=tmp, rt=Runtime.from_settings(settings), producer=producer)
        made.append(site)
        return site

    yield make
    problems = []
    for site in made:
        problems += site.stop()
        site.producer.close()
        site.rt.close()
    assert not problems, "\n".join(problems)


# --- the crash-point matrix -----------------------------------------------------------------------

N = 6


def crashed_after_schedule_commit(site: Site, ids: list[str]) -> None:
    # The worker took one `schedule` message (concurrency 1), committed it and died before
    # sending `create_job`: one row, no Job; the other requests still wait in the queue.
    rows = site.rows(ids)
    assert [r.state for r in rows.values()] == [DispatchState.SCHEDULED]
    assert site.jobs() == []


def crashed_before_job_create(site: Site, ids: list[str]) -> None:
    rows = site.rows(ids)
    assert len(rows) == N and all(r.state is DispatchState.SCHEDULED for r in rows.values())
    assert site.jobs() == []


def crashed_after_job_create(site: Site, ids: list[str]) -> None:
    jobs = {j["metadata"]["name"] for j in site.jobs()}
    rows = site.rows(ids)
    assert any(r.state is DispatchState.SCHEDULED and job_name(r.dispatch_id) in jobs for r in rows.values())


def crashed_before_complete_write(site: Site, ids: list[str]) -> None:
    finished = {j["metadata"]["name"] for j in site.jobs() if job_state(j).terminal}
    rows = site.rows(ids)
    assert any(not r.terminal and job_name(r.dispatch_id) in finished for r in rows.values())
    assert site.claims()  # the dead worker's claim, until its lease runs out


def crashed_after_complete_write(site: Site, ids: list[str]) -> None:
    with_finalizer = {j["metadata"]["name"] for j in site.jobs() if FINALIZER in j["metadata"].get("finalizers", [])}
    rows = site.rows(ids)
    assert any(
        r.terminal and r.notified_at is None and job_name(r.dispatch_id) in with_finalizer for r in rows.values()
    )


def crashed_mid_sweep(site: Site, ids: list[str]) -> None:
    # The start-up sweep (one action at a time) created three of the backlog's Jobs: the third
    # killed it. The Job exists; whether its row was marked is the crash's business.
    assert len(site.jobs()) == 3
    assert sum(r.state is DispatchState.SCHEDULED for r in site.rows(ids).values()) >= N - 3


MATRIX = {
    # point: (how the work arrives, the worker's concurrency, proof that it died there)
    Point.AFTER_SCHEDULE_COMMIT: ("task", 1, crashed_after_schedule_commit),
    Point.BEFORE_JOB_CREATE: ("session", 1, crashed_before_job_create),
    Point.AFTER_JOB_CREATE: ("session", 1, crashed_after_job_create),
    Point.BEFORE_COMPLETE_WRITE: ("session", 1, crashed_before_complete_write),
    Point.AFTER_COMPLETE_WRITE: ("session", 1, crashed_after_complete_write),
    Point.MID_SWEEP: ("rows", 4, crashed_mid_sweep),
}


@pytest.mark.parametrize("point", list(MATRIX), ids=[p.value for p in MATRIX])
def test_a_worker_killed_at_each_crash_point_loses_nothing_and_doubles_nothing(point, any_cluster, make_site):
    arrives, concurrency, proof = MATRIX[point]
    values = [{"point": point.value, "i": i} for i in range(N)]
    crash_at = f"{point.value}@3" if point is Point.MID_SWEEP else point.value

    if arrives == "rows":
        # A backlog the start-up sweep must work through (rows only, grace 0), one action at a time.
        site = make_site(any_cluster, sweep_grace_s="0")
        ids = site.schedule(values, send=False)
        doomed = site.worker("doomed", crash_at=crash_at, concurrency=concurrency, sweep_concurrency="1")
    else:
        site = make_site(any_cluster)
        doomed = site.worker("doomed", crash_at=crash_at, concurrency=concurrency)
        site.beat()
        ids = site.schedule_by_task(values) if arrives == "task" else site.schedule(values)
    site.wait_killed(doomed)
    proof(site, ids)

    site.worker("fresh")
    if not any(p.name == "beat" for p in site.procs):
        site.beat()
    site.assert_delivered_once(ids, values)


# --- the broker loses every message -----------------------------------------------------------------


def broker_keys(site: Site) -> list[bytes]:
    """The broker's queued and unacknowledged messages under the test's prefix."""
    queues = [names.JOBS_QUEUE, names.COMPLETE_QUEUE, names.SWEEP_QUEUE]
    keys = [f"{site.prefix}:{q}" for q in queues] + [f"{site.prefix}:unacked", f"{site.prefix}:unacked_index"]
    return [k.encode() for k in keys if site.rt.redis.exists(k)]


def test_a_flushed_broker_loses_nothing(any_cluster, make_site):
    site = make_site(any_cluster)
    values = [{"flush": i} for i in range(12)]
    ids = site.schedule(values[:8])  # one create_jobs message queued (one transaction), nobody consuming
    finished = site.schedule(values[8:], send=False)
    for dispatch_id in finished:  # Jobs that ran while every worker was down
        create.create_job_for(site.rt, dispatch_id)
    site.wait(lambda: all(job_state(j).terminal for j in site.jobs()) and len(site.jobs()) == 4, what="4 jobs finished")

    assert site.rt.redis.llen(f"{site.prefix}:{names.JOBS_QUEUE}") == 1
    site.rt.redis.delete(*broker_keys(site))
    assert broker_keys(site) == []

    site.worker("w1")
    site.beat()
    site.assert_delivered_once(ids + finished, values)


# --- three replicas start at once on the same backlog -------------------------------------------


def test_three_replicas_starting_at_once_on_300_finished_jobs_deliver_each_once(any_cluster, make_site):
    # Pages of 10: a sweep delivers a page's Jobs as one batch, 300 at once in well under a
    # second, so with one page the first replica up could finish before the others list.
    site = make_site(any_cluster, sweep_grace_s="0", poll_page_size="10")
    values = [{"replica": i} for i in range(300)]
    ids = site.schedule(values, send=False)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda d: create.create_job_for(site.rt, d), ids))
    site.wait(lambda: sum(job_state(j).terminal for j in site.jobs()) == 300, what="300 jobs finished")

    # At once, for real: the table the start-up sweep reads first is locked until all three wait on
    # it (a process started a few seconds after another, on a loaded machine, found the work done).
    started = time.monotonic()
    workers = [site.worker(f"r{i}", start=False) for i in range(3)]
    with site.rt.sessions() as holder, holder.begin():
        holder.execute(sa.text("LOCK TABLE dispatches IN ACCESS EXCLUSIVE MODE"))
        for w in workers:
            w.start()
        site.wait(lambda: sweeps_waiting_on_the_lock(site) == 3, what="3 start-up sweeps waiting on the lock")
    site.wait(lambda: site.all_terminal(ids), what="300 dispatches terminal")
    converged_s = time.monotonic() - started

    events = site.terminal_events(ids)
    assert sum(len(e) for e in events.values()) == 300
    for dispatch_id, value in zip(ids, values, strict=True):
        assert events[dispatch_id] == [(EventType.WORKER_COMPLETED, {"output": expected_output(value)})]
    assert site.rt.stats.get(stats.COMPLETIONS_WRITTEN) == 300
    # The replicas met on the same dispatches: the guard turned duplicates away, or a replica
    # found the work done by another when it got there (skipped), and between them the
    # start-up sweeps completed each Job once.
    acted = skipped = 0
    for w in workers:
        site.wait(lambda w=w: STARTUP_SWEEP_DONE in w.log_path.read_text(), what=f"{w.name}'s start-up sweep")
        [line] = [x for x in w.log_path.read_text().splitlines() if STARTUP_SWEEP_DONE in x]
        _found, done, passed = re.search(r"finished_unrecorded=(\d+)/(\d+)/(\d+)", line).groups()  # type: ignore[union-attr]
        acted, skipped = acted + int(done), skipped + int(passed)
    prevented = site.rt.guard.duplicates_prevented()
    print(f"3 replicas, 300 finished jobs: converged in {converged_s:.1f} s; start-up sweeps completed {acted}, "
          f"skipped {skipped}; duplicates prevented by the guard {prevented}")  # fmt: skip
    assert acted == 300  # no beat, no messages: the start-up sweeps did it all, each Job once
    assert prevented > 0 or skipped > 0
    site.wait(lambda: not site.jobs(), timeout_s=30, what="no Job left")
    assert Counter(site.notifications()) == Counter(ids)


def sweeps_waiting_on_the_lock(site: Site) -> int:
    """The start-up sweeps' first read of `dispatches` (their namespaces) waiting on a lock."""
    with transaction(site.rt.sessions) as session:
        return int(
            session.scalar(
                sa.text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock' AND query LIKE '%DISTINCT dispatches.job_namespace%'"
                )
            )
        )


# --- a flaky API server that restarts during recovery -------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServedCluster:
    """`python -m k8s_dispatch.demo.localcluster serve` as a subprocess, restartable with its state kept."""

    def __init__(self, tmp: Path) -> None:
        self.kubeconfig = tmp / "kubeconfig"
        self.port = free_port()
        self.argv = [
            sys.executable, "-m", "k8s_dispatch.demo.localcluster", "serve", "--mode", "simulate", "--no-tls",
            "--port", str(self.port), "--kubeconfig", str(self.kubeconfig), "--state", str(tmp / "state.jsonl"),
        ]  # fmt: skip
        self.log_path = tmp / "localcluster.log"
        self.proc: subprocess.Popen[str] | None = None

    def start(self, *, fault_rate: float) -> None:
        with self.log_path.open("a") as log:
            self.proc = subprocess.Popen(
                [*self.argv, "--fault-rate", str(fault_rate)], stdout=subprocess.PIPE, stderr=log, text=True
            )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("listening on http://"), line + self.log_path.read_text()

    def faults(self, **change: float) -> dict[str, Any]:
        """GET (or, given `rate`/`latency_ms`, POST) the server's fault settings and count."""
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/localcluster/faults",
            data=json.dumps(change).encode() if change else None,
            headers={"Authorization": f"Bearer {token_from_kubeconfig(self.kubeconfig)}"},
            method="POST" if change else "GET",
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()


def test_an_api_server_with_5_percent_errors_that_restarts_during_recovery_still_converges(make_site, tmp_path):
    served = ServedCluster(tmp_path)
    served.start(fault_rate=0.0)  # a clean cluster to lay out the backlog on
    try:
        site = make_site(served.kubeconfig, sweep_grace_s="0")
        values = [{"flaky": i} for i in range(30)]
        ids = site.schedule(values, send=False)  # rows only: no message will ever create their Jobs
        for dispatch_id in ids[:15]:  # Jobs that ran while every worker was down
            create.create_job_for(site.rt, dispatch_id)
        site.wait(lambda: sum(job_state(j).terminal for j in site.jobs()) == 15, what="15 jobs finished")

        served.faults(rate=0.05)
        site.worker("w1")
        site.beat()
        site.wait(lambda: sum(r.terminal for r in site.rows(ids).values()) >= 5, what="recovery under way")
        injected = served.faults()["injected"]
        ended = sum(r.terminal for r in site.rows(ids).values())
        served.stop()  # the API server goes away mid-recovery, and comes back with its state
        time.sleep(1.0)  # the outage
        served.start(fault_rate=0.05)
        site.assert_delivered_once(ids, values)
        injected += served.faults()["injected"]  # the count starts again with the process
        print(f"flaky API: {injected} faults injected; the restart came at {ended}/30 dispatches ended")
        assert injected > 0 and ended < 30  # the faults bit, and the restart came mid-way
    finally:
        served.stop()


# --- Jobs that are never delivered ----------------------------------------------------------------


def test_a_forged_job_and_a_tenancy_mismatched_job_are_never_delivered(any_cluster, make_site):
    site = make_site(any_cluster)
    forged_ref = DispatchRef(
        dispatch_id=str(uuid.uuid4()), case_id="case-x", tenancy_id="tenant-a", capability="sim.ok",  # type: ignore[arg-type]
        worker_name="sim", idempotency_key="forged",  # type: ignore[arg-type]
    )  # fmt: skip
    forged = forge_job(site.rt.kube, site.namespace, forged_ref, deployment=site.settings.effective_deployment)
    [victim] = site.schedule([{"victim": 1}], send=False)
    victim_ref = records.load_record(site.rt, victim).ref
    forge_job(
        site.rt.kube,
        site.namespace,
        DispatchRef(**{**victim_ref.__dict__, "tenancy_id": "tenant-b"}),
        deployment=site.settings.effective_deployment,
    )
    values = [{"honest": i} for i in range(4)]
    honest = site.schedule(values)

    site.worker("w1")
    site.beat()
    site.wait(lambda: site.all_terminal(honest), what="the honest dispatches terminal")
    # The forged Job is an orphan (no such dispatch), reported by every sweep that LISTs; the one
    # squatting the victim's name is the victim's Job hand-edited as far as the database can tell
    # (its name says whose it is): noted, and failed `JobTampered` only after TAMPERED_GRACE_S.
    site.wait(lambda: site.rt.stats.get(ORPHANS_REPORTED) >= 1, what="the forged Job reported")
    honest_names = {job_name(d) for d in honest}
    site.wait(
        lambda: not honest_names & {j["metadata"]["name"] for j in site.jobs()}, what="the honest Jobs cleaned up"
    )

    ended = site.terminal_events([victim, forged_ref.dispatch_id])
    assert ended[forged_ref.dispatch_id] == [] and forged_ref.dispatch_id not in site.notifications()
    # The victim is never delivered from the Job squatting its name. Whoever meets that Job first
    # decides how it is told: a full sweep's LIST reports it and leaves the dispatch scheduled; a
    # create (a watch-mode sweep's, or a message's) meets 409 and refuses to adopt it, so the
    # dispatch, which can never have a Job of its own under that name, ends LabelMismatch.
    names = {j["metadata"]["name"] for j in site.jobs()}
    assert forged in names  # left alone: report policy
    if ended[victim]:
        [(event, payload)] = ended[victim]
        assert event == EventType.WORKER_FAILED.value and payload["reason"] == "LabelMismatch", payload
        assert "carries tenancy 'tenant-b'" in payload["message"], payload
        assert site.rows([victim])[victim].state is DispatchState.FAILED
        # The Job under its name is, for the database, the ended victim's: it may be cleaned up.
        assert names <= {forged, job_name(victim)}
    else:
        assert site.rows([victim])[victim].state is DispatchState.SCHEDULED
        assert victim not in site.notifications()
        assert names == {forged, job_name(victim)}  # within the grace: left alone
    assert "never delivering job" in site.procs[0].log_path.read_text()
    events = site.terminal_events(honest)
    assert all(
        events[d] == [(EventType.WORKER_COMPLETED, {"output": expected_output(v)})]
        for d, v in zip(honest, values, strict=True)
    )


# --- start-up ordering ------------------------------------------------------------------------------


def test_a_fresh_worker_recovers_its_backlog_at_start_before_running_any_task(any_cluster, make_site):
    """No beat: a worker process that never ran, with a resolver it never used, recovers the
    backlog in its start-up sweep, before it handles a single message (a queued poll included)."""
    site = make_site(any_cluster, sweep_grace_s="0")
    unscheduled = site.schedule([{"row": i} for i in range(5)], send=False)  # category 1
    finished = site.schedule([{"done": i} for i in range(5)], send=False)  # category 2
    recorded = site.schedule([{"recorded": i} for i in range(3)], send=False)  # category 4
    for dispatch_id in finished + recorded:
        create.create_job_for(site.rt, dispatch_id)
    site.wait(lambda: len(site.jobs()) == 8 and all(job_state(j).terminal for j in site.jobs()), what="8 jobs finished")
    with transaction(site.rt.sessions) as session:
        for dispatch_id in recorded:
            dispatches.record_terminal(session, dispatch_id, EventType.WORKER_COMPLETED, {"output": {"recorded": True}})
    site.producer.send_task(names.POLL_TASK)  # as if beat had ticked already

    worker = site.worker("fresh")
    site.wait(lambda: STARTUP_SWEEP_DONE in worker.log_path.read_text(), what="the start-up sweep")

    # The unscheduled rows' Jobs were created and marked by the sweep, before its done line. Their
    # Jobs run 30 ms, so the queued poll may have completed some since: CREATED or later.
    rows = site.rows(unscheduled)
    assert all(r.job_created_at is not None and r.state is not DispatchState.SCHEDULED for r in rows.values()), rows
    events = site.terminal_events(finished)
    assert all(events[d] == [(EventType.WORKER_COMPLETED, {"output": {"simulated": True, "input": {"done": i}}})]
               for i, d in enumerate(finished))  # fmt: skip
    remaining = {j["metadata"]["name"] for j in site.jobs()}
    assert not remaining & {job_name(d) for d in finished + recorded}  # completed and cleaned up

    log = worker.log_path.read_text()
    done_at = log.index(STARTUP_SWEEP_DONE)
    received = [i for i in (log.find(f"Task {task}[") for task in (names.POLL_TASK, names.SWEEP_TASK)) if i >= 0]
    assert all(done_at < i for i in received), log
    site.wait(lambda: f"Task {names.POLL_TASK}[" in worker.log_path.read_text(), what="the queued poll handled after")
