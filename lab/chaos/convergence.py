"""The chaos run's convergence and verdict: dispatches not yet ended and notified, Jobs, held
Pods and guard claims left, and the judgement of the end state from the database, the cluster, the observer
and Redis (lab.chaos.checks decides)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import sqlalchemy as sa

from k8s_dispatch.core.errors import DispatchError
from k8s_dispatch.lab.chaos.checks import ItemEvent, RowSnapshot, TerminalEvent, judge, limit_peaks
from k8s_dispatch.lab.chaos.options import NAMESPACES
from k8s_dispatch.lab.chaos.state import RunState
from k8s_dispatch.lab.chaos.stores import chunks
from k8s_dispatch.lab.chaos.workload import TENANCIES, Expected, ItemExpected, expected_end, expected_items
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
