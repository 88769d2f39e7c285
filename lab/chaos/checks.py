"""The chaos run's verdict (pure): what the database, the cluster and Redis hold after
convergence, compared with what was dispatched.

Every dispatch must have exactly one terminal event, the one its input calls for (the right
output, or the expected failure reason), with its row agreeing and the engine notified; no
Job and no finalizer of ours may be left in the cluster, and no guard claim may outlive its
lease. Every Job seen while the run went on must be its dispatch's one Job, in the namespace the
dispatch recorded when it was scheduled (`jobs_seen`): a config change moves new work only.
Under fair-share limits, no sample of the cluster may show more Jobs of a tenancy or a capability
running than its limit (`limit_peaks`), and after convergence no dispatch may hold a slot or wait
for one (`open_slots`: a leaked slot would be a dispatch left SCHEDULED or CREATED).

A map dispatch is judged as any dispatch (its one terminal event, with its counts), and item by
item (`items`, `item_events`): each item exactly one item event, the one its index calls for;
and no Pod may be left holding our finalizer (`pods`).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from k8s_dispatch.artifacts.errors import InvalidResultReference
from k8s_dispatch.artifacts.reference import parse_reference
from k8s_dispatch.core.limits import Limits
from k8s_dispatch.lab.chaos.workload import Expected, ItemExpected
from k8s_dispatch.store.models import STATE_FOR_TERMINAL_EVENT, EventType, ItemEventType
from k8s_dispatch.workers.labels import DISPATCH_ID_KEY, MANAGED_BY, MANAGED_BY_LABEL
from k8s_dispatch.workers.manifest import FINALIZER

EXAMPLES = 5  # ids shown per kind of problem


@dataclass(frozen=True)
class RowSnapshot:
    """What the `dispatches` row says about a dispatch's end."""

    state: str
    output: Any = None
    reason: str | None = None
    notified: bool = True  # the engine was sent its notification (notified_at is set)


@dataclass(frozen=True)
class TerminalEvent:
    type: str
    payload: Mapping[str, Any]


@dataclass(frozen=True)
class ItemEvent:
    """One item event of a map, as the engine's log holds it ({"item": index, ...})."""

    type: str
    payload: Mapping[str, Any]


@dataclass(frozen=True)
class LimitPeak:
    """The most Jobs of one tenancy or capability seen running at once (a map's Job counted as its
    running Pods), against its limit."""

    scope: str  # "tenancy" or "capability"
    name: str
    limit: int
    peak: int

    @property
    def excess(self) -> int:
        return self.peak - self.limit


def limit_peaks(limits: Limits, peaks: Mapping[tuple[str, str], int], *, tenancies: Iterable[str]) -> list[LimitPeak]:
    """Each limit of `limits` that applies to `tenancies` (and every capability limit), with the
    most running at once that `peaks` ((scope, name) -> count) holds for it (0 if never seen)."""
    found = []
    for tenancy in sorted(set(tenancies)):
        limit = limits.tenancy(tenancy).max_running
        if limit is not None:
            found.append(LimitPeak("tenancy", tenancy, limit, peaks.get(("tenancy", tenancy), 0)))
    for name, limit in sorted(limits.capabilities.items()):
        found.append(LimitPeak("capability", name, limit, peaks.get(("capability", name), 0)))
    return found


@dataclass
class Verdict:
    dispatched: int = 0
    terminal: int = 0  # dispatches with at least one terminal event
    lost: int = 0  # no terminal event (or no row at all)
    duplicates: int = 0  # more than one terminal event
    wrong_output: int = 0  # a terminal event other than the expected one, or a row disagreeing
    leftover_jobs: int = 0  # Jobs with our label or our finalizer still in the cluster
    held_claims: int = 0  # guard claims still there after convergence plus the lease
    claims_without_expiry: int = 0  # claims that would be held for ever
    unnotified: int = 0  # ended, but the engine was never told
    second_jobs: int = 0  # dispatches with more than one Job (uid) seen
    wrong_namespace: int = 0  # dispatches with a Job outside the namespace they recorded
    # The worst of (most running at once - limit) over the limits (> 0: a limit exceeded); None: no limit.
    limit_exceeded: int | None = None
    limits: list[LimitPeak] = field(default_factory=list)
    running: int = 0  # after convergence: dispatches holding a slot (SCHEDULED, CREATED)
    queued: int = 0  # after convergence: dispatches waiting for one (QUEUED)
    outcomes: Counter[str] = field(default_factory=Counter)  # "WORKER_COMPLETED", "WORKER_FAILED:Reason"
    maps: int = 0  # map dispatches among `dispatched`
    items: int = 0  # their items
    items_lost: int = 0  # items without an item event
    items_duplicates: int = 0  # items with more than one
    items_wrong_output: int = 0  # items whose event is not the expected one (or names no item of its map)
    held_pods: int = 0  # Pods still holding our finalizer after convergence
    item_outcomes: Counter[str] = field(default_factory=Counter)  # "WORKER_ITEM_FAILED:Reason"
    problems: list[str] = field(default_factory=list)
    suspects: list[str] = field(default_factory=list)  # dispatch ids a problem names, first EXAMPLES of each kind

    @property
    def ok(self) -> bool:
        return not (
            self.lost
            or self.duplicates
            or self.wrong_output
            or self.leftover_jobs
            or self.held_claims
            or self.unnotified
            or self.second_jobs
            or self.wrong_namespace
            or (self.limit_exceeded is not None and self.limit_exceeded > 0)
            or self.running
            or self.queued
            or self.items_lost
            or self.items_duplicates
            or self.items_wrong_output
            or self.held_pods
        )

    def merged(self, other: Verdict) -> Verdict:
        """Both runs' counts (two deployments judged apart, reported as one)."""
        both = Verdict(outcomes=self.outcomes + other.outcomes, problems=self.problems + other.problems,
                       limits=self.limits + other.limits, suspects=self.suspects + other.suspects,
                       item_outcomes=self.item_outcomes + other.item_outcomes)  # fmt: skip
        for name in ("dispatched", "terminal", "lost", "duplicates", "wrong_output", "leftover_jobs", "held_claims",
                     "claims_without_expiry", "unnotified", "second_jobs", "wrong_namespace", "running", "queued",
                     "maps", "items", "items_lost", "items_duplicates", "items_wrong_output", "held_pods"):  # fmt: skip
            setattr(both, name, getattr(self, name) + getattr(other, name))
        worst = [v for v in (self.limit_exceeded, other.limit_exceeded) if v is not None]
        both.limit_exceeded = max(worst) if worst else None
        return both


def judge(
    expected: Mapping[str, Expected],
    *,
    rows: Mapping[str, RowSnapshot],
    events: Mapping[str, Sequence[TerminalEvent]],
    jobs: Iterable[Mapping[str, Any]],
    claims: Iterable[tuple[str, int]],
    namespaces: Mapping[str, str | None] | None = None,
    jobs_seen: Mapping[str, set[tuple[str, str]]] | None = None,
    limits: Sequence[LimitPeak] = (),
    open_slots: tuple[int, int] = (0, 0),
    items: Mapping[str, Sequence[ItemExpected]] | None = None,
    item_events: Mapping[str, Sequence[ItemEvent]] | None = None,
    pods: Iterable[Mapping[str, Any]] = (),
) -> Verdict:
    """The verdict on one run.

    `expected`: dispatch id -> the terminal event it must end with (every dispatch the engine
    asked for). `rows`: the dispatches' rows (missing: never written). `events`: each
    dispatch's terminal events. `jobs`: every Job left in the run's namespaces (API dicts).
    `claims`: (key, remaining lease in ms; -1 for no expiry) of the guard claims left.
    `namespaces`: each dispatch's recorded namespace; `jobs_seen`: dispatch id -> the
    (namespace, uid) of every Job of it seen during the run (a dispatch never seen is not judged).
    `limits`: each limit with the most Jobs seen running under it at once; `open_slots`: the
    database's (holding a slot, queued) after convergence. `items`: map dispatch id -> the
    item event each of its items must end with, by index (`expected` holds the map's own end);
    `item_events`: each map's item events in order. `pods`: every Pod left in the run's
    namespaces (API dicts).
    """
    verdict = Verdict(dispatched=len(expected), limits=list(limits), running=open_slots[0], queued=open_slots[1])
    if limits:
        verdict.limit_exceeded = max(peak.excess for peak in limits)
    examples: dict[str, list[str]] = {}

    def problem(kind: str, text: str, dispatch_id: str | None = None) -> None:
        shown = examples.setdefault(kind, [])
        if len(shown) < EXAMPLES:
            shown.append(text)
            if dispatch_id is not None and dispatch_id not in verdict.suspects:
                verdict.suspects.append(dispatch_id)

    for dispatch_id, want in expected.items():
        found = list(events.get(dispatch_id, ()))
        if not found:
            verdict.lost += 1
            row = rows.get(dispatch_id)
            problem(
                "lost", f"{dispatch_id}: " + (f"state {row.state}, no terminal event" if row else "no row"), dispatch_id
            )
            continue
        verdict.terminal += 1
        if len(found) > 1:
            verdict.duplicates += 1
            problem("duplicate", f"{dispatch_id}: {len(found)} terminal events: {[e.type for e in found]}", dispatch_id)
        event = found[0]
        verdict.outcomes[_outcome(event)] += 1
        row = rows.get(dispatch_id)
        why = mismatch(want, event, row)
        if why is not None:
            verdict.wrong_output += 1
            problem("wrong", f"{dispatch_id}: {why}", dispatch_id)
        if row is not None and not row.notified:
            verdict.unnotified += 1
            problem("unnotified", f"{dispatch_id}: {event.type}, the engine was not told")

    verdict.maps = len(items or {})
    for dispatch_id, wanted_items in (items or {}).items():
        _judge_items(verdict, problem, dispatch_id, wanted_items, (item_events or {}).get(dispatch_id, ()))

    for dispatch_id, seen in (jobs_seen or {}).items():
        if dispatch_id not in expected:
            continue  # another deployment's
        if len({uid for _, uid in seen}) > 1 and not expected[dispatch_id].rerun_allowed:
            verdict.second_jobs += 1
            problem("second job", f"{dispatch_id}: {len(seen)} Jobs: {sorted(seen)}", dispatch_id)
        recorded = (namespaces or {}).get(dispatch_id)
        elsewhere = sorted(ns for ns, _ in seen if ns != recorded)
        if recorded is not None and elsewhere:
            verdict.wrong_namespace += 1
            problem("wrong namespace", f"{dispatch_id}: recorded {recorded}, a Job in {elsewhere}", dispatch_id)

    for job in jobs:
        metadata = job.get("metadata") or {}
        ours = (metadata.get("labels") or {}).get(MANAGED_BY_LABEL) == MANAGED_BY
        if ours or FINALIZER in (metadata.get("finalizers") or []):
            verdict.leftover_jobs += 1
            problem(
                "leftover job",
                f"{metadata.get('namespace')}/{metadata.get('name')}: finalizers {metadata.get('finalizers')}",
                (metadata.get("labels") or {}).get(DISPATCH_ID_KEY),
            )

    for pod in pods:
        metadata = pod.get("metadata") or {}
        if FINALIZER in (metadata.get("finalizers") or []):
            verdict.held_pods += 1
            problem(
                "held pod",
                f"{metadata.get('namespace')}/{metadata.get('name')}: phase {(pod.get('status') or {}).get('phase')}, "
                f"finalizers {metadata.get('finalizers')}",
                (metadata.get("labels") or {}).get(DISPATCH_ID_KEY),
            )

    for peak in limits:
        if peak.excess > 0:
            problem("limit exceeded", f"{peak.scope} {peak.name}: {peak.peak} Jobs running at once, limit {peak.limit}")
    if verdict.running or verdict.queued:
        problem("slot left", f"{verdict.running} dispatches hold a slot, {verdict.queued} queued after convergence")

    for key, pttl_ms in claims:
        verdict.held_claims += 1
        if pttl_ms < 0:
            verdict.claims_without_expiry += 1
        problem("held claim", f"{key}: " + ("no expiry" if pttl_ms < 0 else f"{pttl_ms} ms left"))

    verdict.problems = [f"{kind}: {text}" for kind, texts in examples.items() for text in texts]
    return verdict


def _judge_items(
    verdict: Verdict,
    problem: Callable[[str, str, str | None], None],
    dispatch_id: str,
    wanted: Sequence[ItemExpected],
    events: Sequence[ItemEvent],
) -> None:
    """Count one map's items: lost, doubled, wrong (an event naming no item of the map is wrong)."""
    verdict.items += len(wanted)
    by_item: dict[int, list[ItemEvent]] = {}
    for event in events:
        index = (event.payload or {}).get("item")
        if isinstance(index, int) and not isinstance(index, bool) and 0 <= index < len(wanted):
            by_item.setdefault(index, []).append(event)
        else:
            verdict.items_wrong_output += 1
            problem("wrong item", f"{dispatch_id}: {event.type} names item {index!r} of {len(wanted)}", dispatch_id)
    for index, want in enumerate(wanted):
        found = by_item.get(index, [])
        if not found:
            verdict.items_lost += 1
            problem("lost item", f"{dispatch_id} item {index}: no item event", dispatch_id)
            continue
        if len(found) > 1:
            verdict.items_duplicates += 1
            problem("duplicate item", f"{dispatch_id} item {index}: {len(found)} events: {[e.type for e in found]}",
                    dispatch_id)  # fmt: skip
        verdict.item_outcomes[_outcome(TerminalEvent(found[0].type, found[0].payload))] += 1
        why = item_mismatch(want, found[0])
        if why is not None:
            verdict.items_wrong_output += 1
            problem("wrong item", f"{dispatch_id} item {index}: {why}", dispatch_id)


def item_mismatch(want: ItemExpected, event: ItemEvent) -> str | None:
    """Why an item's event is not the expected one, or None when it is."""
    payload = event.payload or {}
    if want.any_end:
        return None
    if event.type != want.event.value:
        return f"{event.type} {payload.get('reason') or ''} where {want.event.value} {want.reason or ''} was expected".strip()
    if want.event is ItemEventType.ITEM_COMPLETED and ("output" not in payload or payload["output"] != want.output):
        return f"output {payload.get('output')!r}, expected {want.output!r}"
    if want.event is ItemEventType.ITEM_FAILED:
        if payload.get("reason") != want.reason:
            return f"reason {payload.get('reason')!r}, expected {want.reason!r}"
        if want.exit_code is not None and payload.get("exit_code") != want.exit_code:
            return f"exit code {payload.get('exit_code')!r}, expected {want.exit_code}"
    return None


def mismatch(want: Expected, event: TerminalEvent, row: RowSnapshot | None) -> str | None:
    """Why `event` (and the row) is not the expected end, or None when it is."""
    payload = event.payload or {}
    if want.any_end:
        return _row_disagrees(event, row)
    if event.type != want.event.value:
        return f"{event.type} {payload.get('reason') or ''} where {want.event.value} {want.reason or ''} was expected".strip()
    if want.event is EventType.WORKER_COMPLETED and want.stored is not None:
        why = _stored_mismatch(want.stored, payload.get("output"))
        if why is not None:
            return why
    elif want.event is EventType.WORKER_COMPLETED and payload.get("output") != want.output:
        return f"output {payload.get('output')!r}, expected {want.output!r}"
    if want.event is EventType.WORKER_FAILED and payload.get("reason") not in {want.reason, *want.also}:
        return f"reason {payload.get('reason')!r}, expected {want.reason!r}"
    if want.event is EventType.WORKER_FAILED and want.detail is not None and payload.get("detail") != want.detail:
        return f"detail {payload.get('detail')!r}, expected {want.detail!r}"
    return _row_disagrees(event, row)


def _stored_mismatch(stored: tuple[int, str], output: Any) -> str | None:
    """Why a recorded output is not a reference to an object of `stored`'s (size, SHA-256)."""
    try:
        reference = parse_reference(output)
    except InvalidResultReference as e:
        return f"output {output!r} is no stored result: {e}"
    if (reference.size, reference.sha256) != stored:
        return f"stored result of {reference.size} bytes, SHA-256 {reference.sha256}; expected {stored[0]}, {stored[1]}"
    return None


def _row_disagrees(event: TerminalEvent, row: RowSnapshot | None) -> str | None:
    """Why the row does not say what its terminal event says, or None when it does."""
    payload = event.payload or {}
    if row is None:
        return "a terminal event but no dispatch row"
    if row.state != STATE_FOR_TERMINAL_EVENT[EventType(event.type)].value:
        return f"row state {row.state} disagrees with its event {event.type}"
    if row.output != payload.get("output") or row.reason != payload.get("reason"):
        return f"row (output {row.output!r}, reason {row.reason!r}) disagrees with its event"
    return None


def _outcome(event: TerminalEvent) -> str:
    reason = (event.payload or {}).get("reason")
    return f"{event.type}:{reason}" if reason else event.type


STORY_LINES, STORY_WIDTH = 15, 240
_STAMP = re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d[.,]\d+")
UNEXPECTED = "raised unexpected: "  # what a Celery worker logs for an exception its task did not expect


def unexpected_task_errors(logs: Mapping[str, str]) -> list[str]:
    """Each task failure a worker logged as unexpected (pure): `logs` maps a process's name to its
    log's text; one "name: the exception" per such line. None may escape a task: a fault of the
    cluster, the database or the broker is a typed, retried error, never a surprise."""
    found = []
    for name, text in sorted(logs.items()):
        for line in text.splitlines():
            at = line.find(UNEXPECTED)
            if at >= 0:
                task = line[line.find("Task ") + 5 : line.find("[", line.find("Task "))] if "Task " in line else "?"
                found.append(f"{name}: {task}: {line[at + len(UNEXPECTED) :]}")
    return found


def story(logs: Mapping[str, str], dispatch_id: str, *, lines: int = STORY_LINES) -> list[str]:
    """The last `lines` log lines that name `dispatch_id`, each "process: line" cut to STORY_WIDTH,
    in the order of their timestamps where a line starts with one (pure): what a failed run's
    report shows of each dispatch a check names, so that a CI log alone tells what happened."""
    found = []
    for name, text in logs.items():
        for line in text.splitlines():
            if dispatch_id in line:
                stamp = _STAMP.search(line[:40])
                found.append((stamp.group(0) if stamp else "", name, line))
    found.sort(key=lambda f: f[0])
    return [f"{name}: {line}"[:STORY_WIDTH] for _, name, line in found[-lines:]]
