"""The chaos run's fault schedule: which fault happens at which offset, drawn from a seed (pure).

The same seed and options give the same plan, event for event, so a failed run can be
replayed with the same faults (the timing of the system under test is not reproducible, the
schedule is). `lab/chaos/faults.py` carries the plan out against real processes.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

BEAT = "beat"
# Kills land in [KILL_FROM, 1] of the window; the one-off faults in the middle of it, while
# work is in flight; the API faults switch on early and stay on to the end of the window.
KILL_FROM = 0.02
ONE_OFF_FROM, ONE_OFF_TO = 0.2, 0.8
API_FAULTS_ON_BY = 0.1
# The namespace change in the first half: dispatches are still being scheduled after it.
MOVE_FROM, MOVE_TO = 0.3, 0.5
# The rolling upgrade early, so that most of the run's work is done by the new release and the
# one-off faults (edits, lost cancels) meet the new workers; the clock steps after it.
UPGRADE_FROM, UPGRADE_TO = 0.08, 0.2
STEP_FROM, STEP_TO = 0.25, 0.6


class FaultKind(StrEnum):
    KILL = "kill"  # SIGKILL a worker or beat, then start it again
    BROKER_FLUSH = "broker_flush"  # delete every key under the run's Redis prefix
    API_FAULTS_ON = "api_faults_on"  # the API server answers a fraction of requests 500/503/429, slowly
    API_FAULTS_OFF = "api_faults_off"
    API_RESTART = "api_restart"  # stop the API server and start it again on the same --state
    DB_KILL = "db_kill"  # pg_terminate_backend on the workers' connections
    POD_DELETE = "pod_delete"  # delete the Pods of every finished Job not yet delivered
    NAMESPACE_CHANGE = (
        "namespace_change"  # every worker and beat restarted on a capability file naming another namespace
    )
    REDIS_RESTART = "redis_restart"  # SIGKILL the run's own redis-server, start it again on the same port
    PG_RESTART = "pg_restart"  # SIGKILL the run's own PostgreSQL server (every backend), start it again
    OBJECTSTORE_RESTART = "objectstore_restart"  # SIGKILL the run's own object store, start it again on its data
    CLOCK_STEP = "clock_step"  # step one process's wall clock by `step_s` (faketime), monotonic left alone
    LOST_CANCEL = "lost_cancel"  # cancel running dispatches in the database, the follow-up message never sent
    LABEL_EDIT = "label_edit"  # hand edits on Jobs: tenancy overwritten, delivered=true added, attempt garbled
    ROLLING_UPGRADE = "rolling_upgrade"  # migrate to head under the previous release's workers, then replace them


@dataclass(frozen=True)
class Fault:
    at_s: float  # offset from the start of the run's window
    kind: FaultKind
    target: str | None = None  # the process a KILL or a CLOCK_STEP hits
    step_s: float = 0.0  # CLOCK_STEP: by how much its wall clock jumps (negative: back)

    def describe(self) -> str:
        step = f" {self.step_s:+g}s" if self.kind is FaultKind.CLOCK_STEP else ""
        return f"{self.at_s:8.3f}s {self.kind.value}" + (f" {self.target}" if self.target else "") + step


@dataclass(frozen=True)
class FaultPlan:
    seed: int
    window_s: float
    faults: tuple[Fault, ...]
    api_fault_rate: float
    api_latency_ms: int

    def count(self, kind: FaultKind) -> int:
        return sum(1 for f in self.faults if f.kind is kind)

    def kills_by_target(self) -> Counter[str]:
        return Counter(f.target for f in self.faults if f.kind is FaultKind.KILL and f.target)

    def describe(self) -> str:
        return "\n".join(f.describe() for f in self.faults)


def worker_names(workers: int) -> list[str]:
    """The worker processes' names, as the plan's kill targets and the harness call them."""
    return [f"worker-{i}" for i in range(1, workers + 1)]


def make_plan(
    seed: int,
    *,
    window_s: float,
    kills: int,
    targets: Sequence[str],
    broker_flushes: int = 1,
    api_restarts: int = 1,
    db_kills: int = 1,
    pod_deletes: int = 3,
    namespace_changes: int = 1,
    api_fault_rate: float = 0.05,
    api_latency_ms: int = 20,
    redis_restarts: int = 0,
    pg_restarts: int = 0,
    objectstore_restarts: int = 0,
    lost_cancels: int = 0,
    label_edits: int = 0,
    rolling_upgrades: int = 0,
    clock_steps: Sequence[tuple[str, float]] = (),
) -> FaultPlan:
    """The faults of one run, sorted by offset.

    Kills are spread over the whole window; when there are at least as many kills as targets,
    every target (each worker, beat) is killed at least once and the rest are drawn at random.
    Broker flushes, API restarts, DB kills, Pod deletions, Redis, PostgreSQL and object store
    restarts, lost cancels and label edits fall in the middle of the window; namespace changes in its first half;
    a rolling upgrade early (before the other one-offs but the kills); each of `clock_steps`
    ((target, seconds)) after it. API faults (at
    `api_fault_rate`, with `api_latency_ms` added to every request) switch on within the first
    tenth of the window, and off at its end. A rate of 0 plans no API fault window.

    Raises:
        ValueError: a negative count or window, no targets for the kills, a rate outside [0, 1].
    """
    if window_s <= 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    counts = (broker_flushes, api_restarts, db_kills, pod_deletes, namespace_changes, redis_restarts, pg_restarts,
              objectstore_restarts, lost_cancels, label_edits, rolling_upgrades)  # fmt: skip
    if min(kills, *counts, api_latency_ms) < 0:
        raise ValueError("fault counts and latency must be >= 0")
    if kills and not targets:
        raise ValueError("kills need at least one target")
    if not 0.0 <= api_fault_rate <= 1.0:
        raise ValueError(f"api_fault_rate must be within [0, 1], got {api_fault_rate}")
    rng = random.Random(seed)

    def at(low: float, high: float) -> float:
        return round(rng.uniform(low * window_s, high * window_s), 3)

    victims = list(targets) if kills >= len(targets) else []
    victims += [rng.choice(list(targets)) for _ in range(kills - len(victims))]
    rng.shuffle(victims)
    faults = [Fault(at(KILL_FROM, 1.0), FaultKind.KILL, victim) for victim in victims]
    for kind, count in (
        (FaultKind.BROKER_FLUSH, broker_flushes),
        (FaultKind.API_RESTART, api_restarts),
        (FaultKind.DB_KILL, db_kills),
        (FaultKind.POD_DELETE, pod_deletes),
        (FaultKind.REDIS_RESTART, redis_restarts),
        (FaultKind.PG_RESTART, pg_restarts),
        (FaultKind.LOST_CANCEL, lost_cancels),
        (FaultKind.LABEL_EDIT, label_edits),
    ):
        faults += [Fault(at(ONE_OFF_FROM, ONE_OFF_TO), kind) for _ in range(count)]
    faults += [Fault(at(MOVE_FROM, MOVE_TO), FaultKind.NAMESPACE_CHANGE) for _ in range(namespace_changes)]
    faults += [Fault(at(UPGRADE_FROM, UPGRADE_TO), FaultKind.ROLLING_UPGRADE) for _ in range(rolling_upgrades)]
    faults += [Fault(at(STEP_FROM, STEP_TO), FaultKind.CLOCK_STEP, target, step) for target, step in clock_steps]
    if api_fault_rate > 0:
        faults.append(Fault(at(0.0, API_FAULTS_ON_BY), FaultKind.API_FAULTS_ON))
        faults.append(Fault(round(window_s, 3), FaultKind.API_FAULTS_OFF))
    # Drawn last: a seed's plan without them is what it was before they existed.
    faults += [Fault(at(ONE_OFF_FROM, ONE_OFF_TO), FaultKind.OBJECTSTORE_RESTART) for _ in range(objectstore_restarts)]
    faults.sort(key=lambda f: (f.at_s, f.kind.value, f.target or ""))
    return FaultPlan(
        seed=seed,
        window_s=window_s,
        faults=tuple(faults),
        api_fault_rate=api_fault_rate,
        api_latency_ms=api_latency_ms,
    )
