"""The chaos run's convergence and verdict: dispatches not yet ended and notified, Jobs, held
Pods and guard claims left, and the judgement of the end state from the database, the cluster, the observer
and Redis (lab.chaos.checks decides); then the object store's and the secret inputs' (lab.chaos.objects)."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from k8s_dispatch.core.errors import DispatchError
from k8s_dispatch.lab.chaos.checks import ItemEvent, RowSnapshot, TerminalEvent, judge, limit_peaks
from k8s_dispatch.lab.chaos.objects import ObjectVerdict, log_problem, orphans, recorded_key
from k8s_dispatch.lab.chaos.options import NAMESPACES
from k8s_dispatch.lab.chaos.state import RunState
from k8s_dispatch.lab.chaos.stores import chunks
from k8s_dispatch.lab.chaos.workload import (
    FAILURE_REASON,
    TENANCIES,
    Expected,
    ItemExpected,
    Kind,
    expected,
    expected_end,
    expected_items,
)
from k8s_dispatch.store.models import TERMINAL_EVENT_TYPES, CaseEvent, Dispatch, ItemEventType
from k8s_dispatch.workers.manifest import FINALIZER


class Convergence(RunState):
    """What is left to converge, and the verdict once it has."""

    def _dispatch_ids(self) -> list[str]:
        with self.ids_lock:
            return list(self.ids.values())

    def _pending(self) -> int:
        """Dispatches the engine asked for that have not ended and been notified yet."""
        return pending(self.sessions, self._dispatch_ids(), planned=len(self.planned))

    def _all_jobs(self) -> list[dict[str, Any]]:
        return [job for ns in NAMESPACES for page in self.kube.iter_jobs(ns, label_selector="") for job in page]

    def _jobs_left(self) -> int:
        try:
            return len(self._all_jobs())
        except DispatchError:
            return -1

    def _all_pods(self) -> list[dict[str, Any]]:
        return [pod for ns in NAMESPACES for page in self.kube.iter_pods(ns, label_selector="") for pod in page]

    def _pods_held(self) -> int:
        """Pods still holding our finalizer (-1: the API server cannot say)."""
        try:
            return sum(FINALIZER in ((p.get("metadata") or {}).get("finalizers") or []) for p in self._all_pods())
        except DispatchError:
            return -1

    def _slots_held(self) -> int:
        """Slots still held in either deployment's database (-1: a database cannot say). An ended
        dispatch (FAILED, CANCELLED) holds its slot until its Job is seen stopped: recorded right
        after the end when the Job is seen finished or gone then, else by the next sweep's
        stopping category (a Job the sweep deletes itself is marked once a later look finds it
        gone; an end with no Job recorded, after the sweep's grace). The last Job gone and every
        end notified, these may still be held for a sweep or two: convergence waits for them."""
        try:
            held = open_slots(self.sessions)[0]
            return held + (self.neighbour.slots_held() if self.neighbour is not None else 0)
        except DispatchError:
            return -1

    def _claims(self) -> list[tuple[str, int]]:
        keys = list(self.redis.scan_iter(match=f"{self.prefix}:claim:*", count=500))
        return [(k.decode(), int(self.redis.pttl(k))) for k in keys]

    def _judge(self) -> None:
        from k8s_dispatch.delivery.stats import Stats

        result = self.result
        mode = self.options.mode
        wanted: dict[str, Expected] = {}
        items: dict[str, list[ItemExpected]] = {}
        with self.ids_lock:
            for planned in self.planned:
                dispatch_id = self.ids.get(planned.index, f"never-scheduled-{planned.index}")
                wanted[dispatch_id] = expected_end(planned, mode=mode)
                if planned.map is not None:
                    items[dispatch_id] = expected_items(planned.map, mode=mode)
            for dispatch_id in self.edited_ids & set(wanted):
                # Cancelled, or its Job edited by hand: any end will do, one, and no Job left;
                # an edited Job's dispatch may be re-run (a second Job), a cancelled one never.
                wanted[dispatch_id] = replace(wanted[dispatch_id], any_end=True,
                                              rerun_allowed=dispatch_id not in self.result.cancelled)  # fmt: skip
                if dispatch_id in items:  # each item still ends once, in any item event
                    items[dispatch_id] = [replace(item, any_end=True) for item in items[dispatch_id]]
        seen = self.observer.seen() if self.observer is not None else {}
        peaks = self.observer.peaks() if self.observer is not None else {}
        result.samples = self.observer.samples if self.observer is not None else 0
        result.jobs_seen = sum(len(jobs) for jobs in seen.values())
        rows, events, namespaces = read_ends(self.sessions, list(wanted))
        result.by_namespace = dict(sorted(Counter(str(ns) for ns in namespaces.values()).items()))
        limits = limit_peaks(self.limits, of_deployment(peaks, self.settings.effective_deployment), tenancies=TENANCIES)
        result.verdict = judge(wanted, rows=rows, events=events, jobs=self._all_jobs(), claims=self._claims(),
                               namespaces=namespaces, jobs_seen=seen, limits=limits,
                               open_slots=open_slots(self.sessions), items=items,
                               item_events=read_item_events(self.sessions, list(items)),
                               pods=self._all_pods())  # fmt: skip
        if result.verdict.running or result.verdict.queued:  # which: a CI log alone then says where to look
            result.verdict.problems.append("slots held or queued by (tenancy, capability): " + ", ".join(
                f"{t}/{c} running {r} queued {q}" for t, c, r, q in slot_holders(self.sessions)))  # fmt: skip
            held = slot_dispatches(self.sessions)
            result.verdict.problems += [f"slot held by {h.describe()}" for h in held]
            result.verdict.suspects += [h.dispatch_id for h in held if h.dispatch_id not in result.verdict.suspects]
        if self.neighbour is not None:
            result.neighbour = self.neighbour.judge(jobs_seen=seen, peaks=peaks)
            result.verdict = result.verdict.merged(result.neighbour)
        counted = Counter(result.stats)
        counted.update(Stats(self.redis, prefix=self.prefix).all())
        result.stats = dict(sorted(counted.items()))
        with self.cluster_lock:
            injected = self._cluster.injected()
        result.api_faults = sum(injected.values())
        result.api_faults_by_kind = dict(sorted(injected.items()))

    def _judge_objects(self, logs: Mapping[str, str]) -> None:
        """The object store and the secret inputs after convergence: every stored result read back
        through `k8s_dispatch.api` against its SHA-256, every object under the run's prefix one of
        its dispatches' (`orphans`), every planned failure's archived log there, and no secret
        input's marker in the cluster's events, the processes' `logs`, the engine's event log or
        the dispatches' rows (the Jobs, Pods and messages were scanned while the run went on)."""
        from k8s_dispatch.lab.chaos.services import STORE_BUCKET

        assert self.own_store is not None
        verdict = ObjectVerdict()
        with self.ids_lock:
            ids = dict(self.ids)
        run_ids = set(ids.values())
        _rows, events, _namespaces = read_ends(self.sessions, sorted(run_ids))
        client = self.own_store.client()
        try:
            listed = [item["Key"] for page in client.get_paginator("list_objects_v2").paginate(
                Bucket=STORE_BUCKET, Prefix=self.object_prefix + "/") for item in page.get("Contents", [])]  # fmt: skip
        finally:
            client.close()
        verdict.objects = len(listed)
        recorded: dict[str, str] = {}
        for ended_id, found in events.items():
            key = recorded_key(found[0].payload) if found and found[0].type == "WORKER_COMPLETED" else None
            if key is not None:
                recorded[ended_id] = key
        for key in orphans(self.object_prefix, listed, known=run_ids, recorded=recorded):
            verdict.orphan_objects += 1
            verdict.problem("orphan object", key)
        present = set(listed)
        for planned in self.planned:
            dispatch_id = ids.get(planned.index)
            if planned.stored is not None:
                verdict.large += 1
                why = self._stored_problem(dispatch_id, expected(Kind.LARGE, planned.input, mode=self.options.mode))
                if why is not None:
                    verdict.large_bad += 1
                    verdict.problem("large result", f"{dispatch_id}: {why}")
            if planned.secret:
                verdict.secrets += 1
            if planned.kind is Kind.FAIL and dispatch_id is not None and dispatch_id not in self.edited_ids:
                found = events.get(dispatch_id) or []
                if not found or found[0].payload.get("reason") != FAILURE_REASON[Kind.FAIL]:
                    continue  # not the planned failure: the verdict says so
                why = log_problem(found[0].payload, present)
                if why is None:
                    verdict.logs_archived += 1
                else:
                    verdict.logs_missing += 1
                    verdict.problem("archived log", f"{dispatch_id}: {why}")
        planned_failures = {ids.get(p.index) for p in self.planned if p.kind is Kind.FAIL}
        for ended_id, found in events.items():
            if ended_id not in planned_failures and found and found[0].type == "WORKER_FAILED":
                detail = (found[0].payload or {}).get("detail")
                named = detail.get("log_key") if isinstance(detail, dict) else None
                if named and named not in present:
                    verdict.other_logs_missing += 1
        self._scan_at_rest(sorted(run_ids), logs)
        self.scan.judge(verdict)
        self.result.objects = verdict

    def _stored_problem(self, dispatch_id: str | None, want: Expected) -> str | None:
        """Why a stored-result dispatch's bytes, read back through the engine's API, are not the
        planned ones; None when they are."""
        from k8s_dispatch import api
        from k8s_dispatch.store.db import transaction

        if dispatch_id is None or want.stored is None:
            return "never scheduled"
        size, sha256 = want.stored
        digest, read = hashlib.sha256(), 0
        try:
            with transaction(self.sessions) as session:
                for chunk in api.read_result(session, dispatch_id, settings=self.settings):
                    digest.update(chunk)
                    read += len(chunk)
        except DispatchError as e:
            return f"not readable: {e.__class__.__name__}: {e}"
        if (read, digest.hexdigest()) != (size, sha256):
            return f"read {read} bytes of SHA-256 {digest.hexdigest()}, expected {size} of {sha256}"
        return None

    def _scan_at_rest(self, ids: list[str], logs: Mapping[str, str]) -> None:
        """Feed the marker scan what is read once the run is over: the run's namespaces' events,
        every process's log, and the engine's event log and dispatch rows."""
        from kubernetes import client

        from k8s_dispatch.lab.kubeclient import opened
        from k8s_dispatch.store.db import transaction

        with opened(self._cluster.harness_kubeconfig) as api_client:
            core = client.CoreV1Api(api_client)
            for namespace in NAMESPACES:
                for event in core.list_namespaced_event(namespace, _request_timeout=30).items:
                    self.scan.scan("Kubernetes event", json.dumps(api_client.sanitize_for_serialization(event)),
                                   where=f"{namespace}/{event.metadata.name if event.metadata else '?'}")  # fmt: skip
        for name, text in logs.items():
            self.scan.scan("process log", text, where=name)
        with transaction(self.sessions) as session:
            for chunk in chunks(ids):
                for dispatch_id, kind, payload in session.execute(
                    sa.select(CaseEvent.dispatch_id, CaseEvent.type, CaseEvent.payload).where(
                        CaseEvent.dispatch_id.in_(chunk))
                ):  # fmt: skip
                    self.scan.scan("engine event", json.dumps(payload, default=str), where=f"{dispatch_id} {kind}")
                for row in session.execute(sa.select(Dispatch).where(Dispatch.dispatch_id.in_(chunk))).scalars():
                    columns = {c.key: getattr(row, c.key) for c in sa.inspect(Dispatch).column_attrs}
                    self.scan.scan("dispatch row", json.dumps(columns, default=str), where=row.dispatch_id)


def read_ends(
    sessions: Any, ids: list[str]
) -> tuple[dict[str, RowSnapshot], dict[str, list[TerminalEvent]], dict[str, str | None]]:
    """What the database says of `ids`: each row's end, each dispatch's terminal events in order,
    and the namespace each recorded for its Job."""
    from k8s_dispatch.store.db import transaction

    rows: dict[str, RowSnapshot] = {}
    events: dict[str, list[TerminalEvent]] = {}
    namespaces: dict[str, str | None] = {}
    terminal_types = sorted(t.value for t in TERMINAL_EVENT_TYPES)
    with transaction(sessions) as session:
        for chunk in chunks(ids):
            for row in session.execute(
                sa.select(
                    Dispatch.dispatch_id, Dispatch.state, Dispatch.output, Dispatch.reason, Dispatch.notified_at,
                    Dispatch.job_namespace,
                ).where(Dispatch.dispatch_id.in_(chunk))
            ):  # fmt: skip
                rows[row.dispatch_id] = RowSnapshot(
                    state=str(row.state.value),
                    output=row.output,
                    reason=row.reason,
                    notified=row.notified_at is not None,
                )
                namespaces[row.dispatch_id] = row.job_namespace
            for event in session.execute(
                sa.select(CaseEvent.dispatch_id, CaseEvent.type, CaseEvent.payload)
                .where(CaseEvent.dispatch_id.in_(chunk), CaseEvent.type.in_(terminal_types))
                .order_by(CaseEvent.id)
            ):
                events.setdefault(event.dispatch_id, []).append(TerminalEvent(event.type, event.payload))
    return rows, events, namespaces


def read_item_events(sessions: Any, ids: list[str]) -> dict[str, list[ItemEvent]]:
    """Each of the maps `ids`' item events in the engine's log, in the order written."""
    from k8s_dispatch.store.db import transaction

    found: dict[str, list[ItemEvent]] = {}
    types = sorted(t.value for t in ItemEventType)
    with transaction(sessions) as session:
        for chunk in chunks(ids):
            for event in session.execute(
                sa.select(CaseEvent.dispatch_id, CaseEvent.type, CaseEvent.payload)
                .where(CaseEvent.dispatch_id.in_(chunk), CaseEvent.type.in_(types))
                .order_by(CaseEvent.id)
            ):
                found.setdefault(event.dispatch_id, []).append(ItemEvent(event.type, event.payload))
    return found


def open_slots(sessions: Any) -> tuple[int, int]:
    """(dispatches holding a slot, dispatches queued) in the whole database."""
    from k8s_dispatch.store import admission
    from k8s_dispatch.store.db import transaction

    with transaction(sessions) as session:
        rows = admission.summary(session)
    return sum(r.running for r in rows), sum(r.queued for r in rows)


def slot_holders(sessions: Any) -> list[tuple[str, str, int, int]]:
    """(tenancy, capability, holding a slot, queued) of each pair that holds or waits for one."""
    from k8s_dispatch.store import admission
    from k8s_dispatch.store.db import transaction

    with transaction(sessions) as session:
        return [(r.tenancy_id, r.capability, r.running, r.queued) for r in admission.summary(session)
                if r.running or r.queued]  # fmt: skip


@dataclass(frozen=True)
class SlotHolder:
    """A dispatch that holds a fair-share slot, and what decides when it frees it."""

    dispatch_id: str
    tenancy_id: str
    capability: str
    state: str
    reason: str | None
    job_created_at: datetime | None
    finished_at: datetime | None

    def describe(self) -> str:
        return (f"{self.dispatch_id} ({self.tenancy_id}/{self.capability}, {self.state}"
                + (f" {self.reason}" if self.reason else "")
                + f", job created {_when(self.job_created_at)}, ended {_when(self.finished_at)})")  # fmt: skip


def _when(at: datetime | None) -> str:
    return at.isoformat(timespec="seconds") if at is not None else "never"


def slot_dispatches(sessions: Any, *, limit: int = 20) -> list[SlotHolder]:
    """The first `limit` dispatches holding a slot: not ended and admitted (SCHEDULED, CREATED),
    or ended FAILED or CANCELLED with their Job not yet seen stopped (`store.admission`'s terms)."""
    from k8s_dispatch.store.admission import stopping
    from k8s_dispatch.store.db import transaction
    from k8s_dispatch.store.models import HOLDING_STATES

    table = Dispatch.__table__
    query = (
        sa.select(table.c.dispatch_id, table.c.tenancy_id, table.c.capability, table.c.state, table.c.reason,
                  table.c.job_created_at, table.c.finished_at)
        .where(sa.or_(table.c.state.in_(sorted(HOLDING_STATES)), stopping(table)))
        .order_by(table.c.dispatch_id)
        .limit(limit)
    )  # fmt: skip
    with transaction(sessions) as session:
        return [
            SlotHolder(d, t, c, str(getattr(s, "value", s)), r, j, f) for d, t, c, s, r, j, f in session.execute(query)
        ]


def of_deployment(peaks: dict[tuple[str, str, str], int], deployment: str) -> dict[tuple[str, str], int]:
    """The observer's peaks of one deployment's Jobs, by (scope, name)."""
    return {(scope, name): n for (dep, scope, name), n in peaks.items() if dep == deployment}


def pending(sessions: Any, ids: list[str], *, planned: int) -> int:
    """Of `planned` dispatches (`ids` those scheduled so far), how many have not ended and been
    notified yet (all of them when the database cannot say)."""
    from k8s_dispatch.store.db import transaction
    from k8s_dispatch.store.models import TERMINAL_STATES

    try:
        with transaction(sessions) as session:
            done = 0
            for chunk in chunks(ids):
                done += (
                    session.scalar(
                        sa.select(sa.func.count()).where(
                            Dispatch.dispatch_id.in_(chunk),
                            Dispatch.state.in_(sorted(TERMINAL_STATES)),
                            Dispatch.notified_at.is_not(None),
                        )
                    )
                    or 0
                )
    except DispatchError:
        return planned
    return planned - done
