"""The chaos run's fault executor: each fault of the plan carried out on schedule against the real
processes, servers and cluster (kills, a broker flush and restart, API faults and restart,
database kills and restart, clock steps, lost cancels, hand edits, a namespace change, a rolling
upgrade), and what is found of the processes that lived through the Redis restart."""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

import psycopg
import redis
import yaml

from k8s_dispatch.core.errors import DispatchError
from k8s_dispatch.lab.chaos import edits
from k8s_dispatch.lab.chaos.fault_plan import BEAT, Fault, FaultKind, worker_names
from k8s_dispatch.lab.chaos.options import (
    CANCELS_PER_FAULT,
    LONG_FAULTS,
    MOVED_NAMESPACE,
    NAMESPACE,
    NAMESPACES,
    OUTAGE_S,
    POD_DELETE_TRIES,
    TARGET_WAIT_S,
    THREAD_JOIN_S,
    WORKER_DB_APP,
    FaultDone,
)
from k8s_dispatch.lab.chaos.services import OwnPostgres, OwnRedis
from k8s_dispatch.lab.chaos.state import RunState, Stopping
from k8s_dispatch.lab.chaos.stores import chunks, conninfo, delete_prefix
from k8s_dispatch.lab.chaos.upgrade import migrate_to_head
from k8s_dispatch.lab.chaos.workload import LIMITED_CAPABILITY, capabilities_config
from k8s_dispatch.lab.kubeclient import opened
from k8s_dispatch.ops.processes import ManagedProcess, WaitTimeout
from k8s_dispatch.workers.labels import DEPLOYMENT_LABEL
from k8s_dispatch.workers.manifest import FINALIZER

log = logging.getLogger(__name__)


class FaultExecutor(RunState):
    """Carries out the plan's faults on schedule, the long ones beside the others."""

    def _inject_faults(self) -> None:
        restarts: list[threading.Thread] = []
        try:
            for fault in self.result.plan.faults:
                if not self._sleep_until(self.t0 + fault.at_s):
                    return
                if fault.kind in LONG_FAULTS:  # beside the others
                    restarts.append(threading.Thread(target=self._do, args=(fault,), name="chaos-restart", daemon=True))
                    restarts[-1].start()
                elif not self._do(fault):
                    return
        finally:
            self.moved.set()  # the plan is over: whatever the feeder holds for a move is held no longer
            for thread in restarts:
                thread.join(timeout=THREAD_JOIN_S)

    def _do(self, fault: Fault) -> bool:
        """Carry out one fault and record it; False if the run is stopping."""
        at_s = time.monotonic() - self.t0
        try:
            detail, ok = self._inject(fault), True
        except Stopping:
            return False
        except (DispatchError, OSError, redis.RedisError, psycopg.Error, WaitTimeout, RuntimeError) as e:
            detail, ok = f"failed: {e.__class__.__name__}: {e}", False
            log.warning("fault %s failed: %s", fault.describe(), detail)
        self.result.done.append(FaultDone(fault=fault, at_s=at_s, detail=detail, ok=ok))
        log.info("fault %s: %s", fault.describe(), detail)
        return True

    def _inject(self, fault: Fault) -> str:
        kind = fault.kind
        if kind is FaultKind.KILL:
            with self.proc_lock:
                if self.stop.is_set():
                    raise Stopping
                proc = self.procs[fault.target or ""]
                pid = proc.pid
                proc.kill(signal.SIGKILL)
                proc.start()
            return f"SIGKILL {fault.target} (pid {pid}); started again (pid {proc.pid})"
        if kind is FaultKind.BROKER_FLUSH:
            return self._flush_broker()
        if kind is FaultKind.API_FAULTS_ON:
            plan = self.result.plan
            self._set_api_faults(plan.api_fault_rate, plan.api_latency_ms)
            return f"{plan.api_fault_rate:.0%} of requests fail ({self._cluster.fault_words}), +{plan.api_latency_ms} ms each"
        if kind is FaultKind.API_FAULTS_OFF:
            self._set_api_faults(0.0, 0)
            return "API faults off"
        if kind is FaultKind.API_RESTART:
            with self.cluster_lock:
                if self.stop.is_set():
                    raise Stopping
                began = time.monotonic()
                what = self._cluster.restart_api()
            return f"{what} in {time.monotonic() - began:.1f}s"
        if kind is FaultKind.DB_KILL:
            killed = self._kill_db_connections()
            self.result.db_connections_killed += killed
            return f"pg_terminate_backend on {killed} worker connections"
        if kind is FaultKind.POD_DELETE:
            return self._delete_finished_pods()
        if kind is FaultKind.NAMESPACE_CHANGE:
            return self._change_namespace()
        if kind is FaultKind.REDIS_RESTART:
            return self._restart_server(self.own_redis)
        if kind is FaultKind.PG_RESTART:
            return self._restart_server(self.own_pg)
        if kind is FaultKind.OBJECTSTORE_RESTART:
            return self._restart_store()
        if kind is FaultKind.CLOCK_STEP:
            clock = self.clocks[fault.target or ""]
            offset = clock.step(fault.step_s)
            return f"{fault.target}'s wall clock stepped {fault.step_s:+g}s (now {offset:+g}s off)"
        if kind is FaultKind.LOST_CANCEL:
            return self._cancel_losing_follow_up()
        if kind is FaultKind.LABEL_EDIT:
            return self._edit_jobs()
        if kind is FaultKind.ROLLING_UPGRADE:
            return self._rolling_upgrade()
        raise AssertionError(f"unknown fault {fault!r}")

    def _restart_server(self, server: OwnRedis | OwnPostgres | None) -> str:
        """SIGKILL one of the run's own servers, leave it down OUTAGE_S, start it again."""
        if server is None:
            raise RuntimeError("the run uses a server it was given, not its own: not restarted")
        with self.proc_lock:
            if self.stop.is_set():
                raise Stopping
            pid = server.proc.pid
            server.proc.kill(signal.SIGKILL)
            self.stop.wait(OUTAGE_S)  # down for a while even when stopping: start it again below
            server.start()
            if server is self.own_redis:  # who must reconnect and go on: judged at the end
                self.across_broker_restart = {
                    name: (proc, proc.starts, proc.log_path.stat().st_size if proc.log_path.exists() else 0)
                    for name, proc in self.procs.items()
                }
        return f"{server.proc.name} (pid {pid}) SIGKILLed, down {OUTAGE_S:g}s, started again (pid {server.proc.pid})"

    def _restart_store(self) -> str:
        """SIGKILL the run's object store, leave it down OUTAGE_S, start it on the same data; its
        readiness is waited for outside the process lock (kills go on meanwhile)."""
        store = self.own_store
        if store is None:
            raise RuntimeError("the run has no object store of its own: not restarted")
        with self.proc_lock:
            if self.stop.is_set():
                raise Stopping
            pid = store.proc.pid
            store.proc.kill(signal.SIGKILL)
            self.stop.wait(OUTAGE_S)  # down for a while even when stopping: start it again below
            store.proc.start()
        began = time.monotonic()
        store.wait_ready()
        return (f"{store.proc.name} (pid {pid}) SIGKILLed, down {OUTAGE_S:g}s, started again (pid {store.proc.pid}), "
                f"taking writes {time.monotonic() - began:.1f}s later")  # fmt: skip

    def _deaf_after_broker_restart(self) -> list[str]:
        """The processes that lived through the last Redis restart (neither killed nor replaced
        since) and never showed, in their logs after it, that they reconnected and went on: a
        worker receiving a task, beat sending one (Celery has had consumers that stay connected
        and consume nothing after a reconnect)."""
        deaf = []
        for name, (proc, starts, offset) in self.across_broker_restart.items():
            if self.procs.get(name) is not proc or proc.starts != starts or not proc.alive:
                continue  # started afresh since: its consuming is the verdict's to judge
            with proc.log_path.open("rb") as log:
                log.seek(offset)
                after = log.read().decode(errors="replace")
            went_on = "Sending due task" if name == BEAT else "] received"
            if went_on not in after:
                deaf.append(f"{name} (pid {proc.pid}): no {went_on.strip('] ')!r} in its log since the Redis restart")
        return deaf

    def _cancel_losing_follow_up(self) -> str:
        """The engine cancels a few running dispatches; the broker loses every `cancel` message."""
        deadline = time.monotonic() + TARGET_WAIT_S
        while True:
            with self.ids_lock:
                ids = [d for d in self.ids.values() if d not in self.edited_ids]
            chosen = edits.running_dispatches(self.sessions, ids, capability=LIMITED_CAPABILITY,
                                                    limit=CANCELS_PER_FAULT)  # fmt: skip
            if chosen or time.monotonic() >= deadline or self.stop.wait(1.0):
                break
        self.edited_ids.update(chosen)  # whatever the cancel found, these are judged as cancelled
        ended = edits.cancel_losing_follow_up(self.sessions, chosen)
        self.result.cancelled += chosen
        return f"cancelled {len(ended)} of {len(chosen)} running dispatches, their cancel messages lost"

    def _edit_jobs(self) -> str:
        """Hand edits of running Jobs (lab.chaos.edits.EDITS), each on another Job, waiting up to
        TARGET_WAIT_S for Jobs to edit; tried again through API errors and restarts."""
        import urllib3
        from kubernetes import client

        left = list(edits.EDITS)
        done: list[tuple[edits.Target, str]] = []
        deadline, failures = time.monotonic() + TARGET_WAIT_S, 0
        selector = f"{DEPLOYMENT_LABEL}={self.settings.effective_deployment}"
        while True:
            try:
                with opened(self._cluster.harness_kubeconfig) as api:
                    listed = client.BatchV1Api(api).list_job_for_all_namespaces(label_selector=selector,
                                                                                _request_timeout=10)  # fmt: skip
                    found = [api.sanitize_for_serialization(job) for job in listed.items]
                    targets = edits.running_targets(found, capability=LIMITED_CAPABILITY, skip=self.edited_ids)
                    targets = targets[: len(left)]
                    self.edited_ids.update(t.dispatch_id for t in targets)  # judged as edited, done or not
                    now_done = edits.edit_jobs(api, targets, edits=left)
            except (client.ApiException, urllib3.exceptions.HTTPError) as e:
                failures += 1
                if failures >= POD_DELETE_TRIES:
                    raise RuntimeError(f"editing jobs: {e.__class__.__name__}: {e}") from e
                now_done = []
            for target, what in now_done:
                self.result.edited[target.dispatch_id] = what
            done += now_done
            left = [edit for edit in left if edit[0] not in {what for _, what in now_done}]
            if not left or time.monotonic() >= deadline or self.stop.wait(1.0):
                break
        return "; ".join(f"{t.namespace}/{t.name}: {what}" for t, what in done) or "no running Job to edit"

    def _rolling_upgrade(self) -> str:
        """`k8s-dispatch migrate` to head while the previous release's workers and beat run, then
        each replaced by this release's in turn (SIGTERM: a warm shutdown; kills go on meanwhile)."""
        if self.release is None:
            raise RuntimeError("no previous release checked out")
        began = time.monotonic()
        migrate_to_head(self.db_url, env=self.env)
        self.old_schema = False
        migrated = time.monotonic() - began
        replaced: list[ManagedProcess] = []
        try:
            for name in [*worker_names(self.options.workers), BEAT]:
                with self.proc_lock:  # the new one takes the name (kills and revivals hit it), then starts
                    if self.stop.is_set():
                        raise Stopping
                    old = self.procs[name]
                    new = self._process(name, shim=self.shim, old=False)
                    new.starts = old.starts  # one log, numbered on
                    self.procs[name] = new
                    self.stack.callback(new.stop)
                    new.start()
                old.kill(signal.SIGTERM)  # a warm shutdown beside its successor, as a rolling update's surge
                replaced.append(old)
        finally:
            for old in replaced:
                old.stop()  # SIGKILL after its grace period, as the kubelet does
        return (f"migrated to head in {migrated:.1f}s under the previous release ({self.result.release[:12]}); "
                f"replaced {', '.join(p.name for p in replaced)} in turn")  # fmt: skip

    def _delete_finished_pods(self) -> str:
        """`kubectl delete pod` of every finished Pod of ours, delivered or not: our finalizer must
        keep each result until it is recorded (what PodGC or a node scale-down would do). Tried
        again while the API server is restarting or answering errors.

        Raises:
            RuntimeError: the API server refused every try.
        """
        import urllib3
        from kubernetes import client

        for attempt in range(POD_DELETE_TRIES):
            try:
                return self._delete_finished_pods_once()
            except (client.ApiException, urllib3.exceptions.HTTPError) as e:
                if attempt == POD_DELETE_TRIES - 1 or self.stop.wait(1.0):
                    raise RuntimeError(f"deleting finished pods: {e.__class__.__name__}: {e}") from e
        raise AssertionError("unreachable")

    def _delete_finished_pods_once(self) -> str:
        from concurrent.futures import ThreadPoolExecutor

        from kubernetes import client

        with opened(self._cluster.harness_kubeconfig) as api:
            core = client.CoreV1Api(api)
            finished = [
                pod
                for namespace in NAMESPACES
                for pod in core.list_namespaced_pod(namespace, label_selector="batch.kubernetes.io/job-name").items
                if pod.status is not None
                and pod.status.phase in ("Succeeded", "Failed")
                and not (pod.metadata is not None and pod.metadata.deletion_timestamp)
            ]

            def delete(pod: Any) -> int:
                try:
                    core.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace, _request_timeout=10)
                except client.ApiException as e:
                    if e.status != 404:
                        log.warning("could not delete pod %s: %s", pod.metadata.name, e.status)
                    return 0
                return 1

            with ThreadPoolExecutor(max_workers=8) as pool:
                deleted = sum(pool.map(delete, finished))
        held = sum(pod.metadata is not None and FINALIZER in (pod.metadata.finalizers or []) for pod in finished)
        return f"deleted {deleted} of {len(finished)} finished pods ({held} held by our finalizer until delivered)"

    def _change_namespace(self) -> str:
        """A rolling deploy onto a capability file that moves every capability to another
        namespace: each worker in turn, then beat, restarted on it; the engine's router too.

        Both sides of the move are made certain, whatever the machine's pace: the move waits
        (up to TARGET_WAIT_S) until a dispatch of the run is recorded in the first namespace, and
        the feeder holds the work planned after the move until every process runs the moved file
        (`moved`): a `schedule` task sent then can only be consumed by a worker that has it (a
        slow migration or restart once left every task to workers on the old file)."""
        from k8s_dispatch.core.settings import load_settings
        from k8s_dispatch.workers.resolver import CapabilityResolver

        try:
            before = self._wait_recorded_in(NAMESPACE)
            config = capabilities_config(self.options.mode, idle=self.idle, stored=self.stored)
            for spec in config["capabilities"].values():
                spec.setdefault("namespace", MOVED_NAMESPACE)  # the idle ones stay where they are
            moved = self.dir / "capabilities-moved.yaml"
            moved.write_text(yaml.safe_dump(config))
            settings = load_settings(self.values | {"K8S_DISPATCH_CAPABILITIES": str(moved)})
            self._resolver = CapabilityResolver.from_settings(settings)
            with self.proc_lock:  # a rolling upgrade's next process is made on it from now on
                self.caps_now = moved
            restarted = []
            for name in [*worker_names(self.options.workers), BEAT]:
                with self.proc_lock:
                    if self.stop.is_set():
                        raise Stopping
                    proc = self.procs[name]
                    proc.env["K8S_DISPATCH_CAPABILITIES"] = str(moved)
                    proc.stop()
                    proc.start()
                    restarted.append(name)
            with self.ids_lock:
                held = len(self.planned) - len(self.ids)
        finally:
            self.moved.set()
        return (f"capabilities moved to namespace {MOVED_NAMESPACE} ({before} dispatches recorded in {NAMESPACE} "
                f"before); restarted {', '.join(restarted)} in turn; {held} dispatches fed from now on")  # fmt: skip

    def _wait_recorded_in(self, namespace: str) -> int:
        """The run's dispatches recorded in `namespace`, once there is one (or after TARGET_WAIT_S:
        then 0, and the verdict's namespaces say so)."""
        deadline = time.monotonic() + TARGET_WAIT_S
        while True:
            with self.ids_lock:
                ids = list(self.ids.values())
            try:
                found = _recorded_in(self.sessions, ids, namespace=namespace)
            except DispatchError as e:  # a database restart: look again
                log.info("cannot count the dispatches recorded in %s now: %s", namespace, e)
                found = 0
            if found or time.monotonic() >= deadline:
                return found
            if self.stop.wait(1.0):
                raise Stopping

    def _flush_broker(self) -> str:
        """Every key under the run's prefix: queued and unacknowledged messages, bindings, claims."""
        from k8s_dispatch.delivery.stats import Stats

        for name, value in Stats(self.redis, prefix=self.prefix).all().items():
            self.result.stats[name] = self.result.stats.get(name, 0) + value  # counted before they go
        queued = 0
        for key in self.redis.scan_iter(match=f"{self.prefix}:k8s-dispatch.*", count=500):
            if self.redis.type(key) == b"list":
                queued += self.redis.llen(key)
        unacked = self.redis.hlen(f"{self.prefix}:unacked")
        deleted = delete_prefix(self.redis, self.prefix)
        return f"deleted {deleted} keys: {queued} queued and {unacked} unacknowledged messages lost"

    def _kill_db_connections(self) -> int:
        with psycopg.connect(conninfo(self.admin_url), autocommit=True, connect_timeout=10) as admin:
            rows = admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND application_name = %s",
                (self.result.database, WORKER_DB_APP),
            ).fetchall()
        return sum(1 for (killed,) in rows if killed)


def _recorded_in(sessions: Any, ids: list[str], *, namespace: str) -> int:
    """How many of `ids` are recorded with their Job's namespace `namespace`."""
    import sqlalchemy as sa

    from k8s_dispatch.store.db import transaction
    from k8s_dispatch.store.models import Dispatch

    found = 0
    with transaction(sessions) as session:
        for chunk in chunks(ids):
            query = sa.select(sa.func.count()).where(
                Dispatch.dispatch_id.in_(chunk), Dispatch.job_namespace == namespace
            )
            found += session.scalar(query) or 0
    return found
