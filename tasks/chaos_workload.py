"""The chaos run's work (pure): capabilities whose outcome is known from their input, and each
dispatch's capability, input and the terminal event it must end with.

Four kinds: quick and slow work that succeeds, work that fails (BackoffLimitExceeded) and
work that hangs past its activeDeadlineSeconds (DeadlineExceeded). In simulate mode the
outcome comes from localcluster's pod annotations and a success's output is
`{"simulated": true, "input": <input>}`; in exec mode real processes run
`workers.demo_functions` through `workers.runner`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from engine.models import EventType

SIM = "localcluster.k8s-dispatch.io/"  # localcluster's simulate-mode annotations
IMAGE = "k8s-dispatch-chaos:local"  # never pulled: localcluster runs or simulates it
TENANCIES = ("tenant-a", "tenant-b")
CASES_PER_TENANCY = 5

SLOW_MS = 3000
TIMEOUT_DEADLINE_S = 2
EXEC_SLOW_S = 1.5
EXEC_HANG_S = 600


class Kind(StrEnum):
    QUICK = "quick"
    SLOW = "slow"
    FAIL = "fail"
    TIMEOUT = "timeout"


# The share of each kind in a run (percent).
MIX: tuple[tuple[Kind, int], ...] = ((Kind.QUICK, 50), (Kind.SLOW, 20), (Kind.FAIL, 15), (Kind.TIMEOUT, 15))
FAILURE_REASON = {Kind.FAIL: "BackoffLimitExceeded", Kind.TIMEOUT: "DeadlineExceeded"}


def capability(kind: Kind) -> str:
    return f"chaos.{kind.value}"


@dataclass(frozen=True)
class Expected:
    """The one terminal event a dispatch must end with."""

    event: EventType
    output: Any = None  # WORKER_COMPLETED: the exact output
    reason: str | None = None  # WORKER_FAILED: the reason


@dataclass(frozen=True)
class Planned:
    """One dispatch the feeder schedules."""

    index: int
    kind: Kind
    case_id: str
    tenancy_id: str
    input: dict[str, Any]
    via_task: bool  # sent as the Celery `schedule` task, else the in-transaction Python call
    idempotency_key: str

    @property
    def capability(self) -> str:
        return capability(self.kind)


def cases(tag: str) -> list[tuple[str, str]]:
    """(case id, tenancy id) of the cases a run's dispatches belong to; `tag` names the run."""
    return [(f"chaos-{tag}-{t}-{c}", t) for t in TENANCIES for c in range(CASES_PER_TENANCY)]


def capabilities_config(mode: str, *, python: str = "python") -> dict[str, Any]:
    """The capability file's content for `mode` ("simulate" or "exec")."""
    if mode not in ("simulate", "exec"):
        raise ValueError(f"mode must be simulate or exec, got {mode!r}")
    functions = {Kind.QUICK: "echo", Kind.SLOW: "sleep", Kind.FAIL: "fail", Kind.TIMEOUT: "sleep"}
    table: dict[Kind, dict[str, Any]] = {
        kind: {
            "worker": f"chaos-{kind.value}",
            "image": IMAGE,
            "command": [python, "-m", "workers.runner"],
            "args": [f"workers.demo_functions:{functions[kind]}"],
            "backoffLimit": 0,
        }
        for kind in Kind
    }
    if mode == "simulate":  # the same Jobs, their outcome played by localcluster
        table[Kind.QUICK]["annotations"] = {SIM + "duration-ms": "50"}
        table[Kind.SLOW]["annotations"] = {SIM + "duration-ms": str(SLOW_MS)}
        table[Kind.FAIL]["annotations"] = {SIM + "duration-ms": "100", SIM + "outcome": "fail", SIM + "exit-code": "3"}
        table[Kind.TIMEOUT]["annotations"] = {SIM + "outcome": "hang"}
    table[Kind.TIMEOUT]["activeDeadlineSeconds"] = TIMEOUT_DEADLINE_S
    return {"capabilities": {capability(kind): fields for kind, fields in table.items()}}


def workload(seed: int, count: int, *, tag: str, task_every: int = 4) -> list[Planned]:
    """`count` dispatches with kinds drawn from MIX by `seed`; every `task_every`-th is sent as
    the Celery `schedule` task (0: none), the rest through the Python call. `tag` (unique per
    run) goes into case ids and idempotency keys, so runs sharing a database never meet."""
    rng = random.Random(f"workload-{seed}")
    kinds, weights = zip(*MIX)
    all_cases = cases(tag)
    planned = []
    for i in range(count):
        kind = rng.choices(kinds, weights)[0]
        case_id, tenancy_id = all_cases[i % len(all_cases)]
        data: dict[str, Any] = {"n": i, "seed": seed, "text": f"dispatch {i} of run {seed}"}
        if kind is Kind.SLOW:
            data["seconds"] = EXEC_SLOW_S
        elif kind is Kind.TIMEOUT:
            data["seconds"] = EXEC_HANG_S
        elif kind is Kind.FAIL:
            data["message"] = f"planned failure {i}"
        via_task = task_every > 0 and i % task_every == task_every - 1
        planned.append(Planned(i, kind, case_id, tenancy_id, data, via_task, f"chaos-{tag}-{i}"))
    return planned


def expected(kind: Kind, data: Any, *, mode: str) -> Expected:
    """The terminal event a dispatch of `kind` with input `data` must end with in `mode`."""
    if kind in FAILURE_REASON:
        return Expected(EventType.WORKER_FAILED, reason=FAILURE_REASON[kind])
    if mode == "simulate":
        return Expected(EventType.WORKER_COMPLETED, output={"simulated": True, "input": data})
    if kind is Kind.SLOW:
        return Expected(EventType.WORKER_COMPLETED, output={"slept": float(data["seconds"])})
    return Expected(EventType.WORKER_COMPLETED, output=data)


def kind_of(capability_name: str) -> Kind | None:
    """The kind a capability name stands for, or None if it is not one of ours."""
    prefix = "chaos."
    if not capability_name.startswith(prefix):
        return None
    try:
        return Kind(capability_name[len(prefix) :])
    except ValueError:
        return None
