"""The chaos run's work (pure): capabilities whose outcome is known from their input, and each
dispatch's capability, input and the terminal event it must end with.

Quick and slow work that succeeds, work that fails (BackoffLimitExceeded), work that hangs past
its activeDeadlineSeconds (DeadlineExceeded), and poison: work that succeeds but writes a
termination message the store cannot keep (`1e400`, a lone surrogate, NaN, invalid UTF-8, nesting
deeper than the store keeps), each of which must end WORKER_FAILED ResultNotJson. In simulate mode the
outcome comes from localcluster's pod annotations and a success's output is
`{"simulated": true, "input": <input>}`; in exec mode real processes run
`k8s_dispatch.demo.functions` through `k8s_dispatch.container.runner`.

Among them a few map dispatches (issue 29, `MapPlan`): 10 to 20 items of `chaos.map`, some items
failing by design (`MAP_FAILING`), each item's end known from its index: in simulate mode from the
capability's `by-index` annotation (localcluster and our node agent read it by completion index,
which is the item's as long as the map's Job is its first), in exec mode from its input (`sleep`,
a negative number of seconds failing). Each must end in one item event per item and one terminal
event with its counts (`expected_map`, `expected_items`).

The object store's part (issue 28): a few dispatches whose results go to the object store
(`StoredPlan`: 1-3 MiB of random bytes from a seed, the expected output a reference with their
size and SHA-256), each under a capability of its own, `chaos.large-N`; a few with secret inputs
(`chaos.secret`, each input holding a random marker the run looks for everywhere it must not be);
and `chaos.fail` archiving its failed Pods' logs (`archiveLogs: onFailure`). In exec mode the
runner calls `lab.chaos.functions` (the bytes uploaded through the attempt's presigned URL); in
simulate mode nothing runs in the Pod, so the harness writes the first attempt's object before the
dispatch is scheduled, as its container would have, and the capability's simulated termination
message is the reference to it (hence one capability per such dispatch).
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import random
import uuid
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from k8s_dispatch.container.contract import result_reference
from k8s_dispatch.store.models import EventType, ItemEventType
from k8s_dispatch.store.scheduling import ScheduleRequest

SIM = "localcluster.k8s-dispatch.io/"  # localcluster's simulate-mode annotations
IMAGE = "k8s-dispatch-chaos:local"  # never pulled: localcluster runs or simulates it
TENANCIES = ("tenant-a", "tenant-b")
CASES_PER_TENANCY = 5
# The run's fair-share limits (issue 17), in both capability files (the namespace change keeps
# them): sized to be reached at the feed's peaks, and to leave the run near its unlimited time.
LIMITED_TENANCY = "tenant-a"
LIMITED_CAPABILITY = "chaos.slow"
LIMITS: dict[str, Any] = {
    "tenancies": {"default": {"maxRunning": 24}, LIMITED_TENANCY: {"maxRunning": 16, "weight": 2}},
    "capabilities": {LIMITED_CAPABILITY: {"maxRunning": 16}},
}

SLOW_MS = 3000
# Maps: one in MAP_EVERY dispatches, at seeded places in the first MAP_SPAN of the feed (so the
# last ends about when the singles do), of MAP_ITEMS items run MAP_PARALLELISM at a time.
MAP_EVERY = 75
MAP_SPAN = 0.8
MAP_ITEMS = (10, 20)
MAP_PARALLELISM = (2, 4)
MAP_FAILING = frozenset({4, 9, 13, 18})  # item indexes that fail by design (exit 2 simulated, 1 in exec)
MAP_ITEM_MS = (200, 500, 900, 1300)  # item i runs MAP_ITEM_MS[i % 4]: a map spans several faults
# How a map's items decide its end, in turn: every item needed (it fails, ItemsFailed), the ones
# that do not fail by design needed, the same with maxFailedIndexes at the failures planned.
MAP_RULES = ("all", "at_least", "at_least_max_failed")
ITEM_FAILURE_REASON = "ContainerFailed"
TIMEOUT_DEADLINE_S = 2
EXEC_SLOW_S = 1.5
EXEC_HANG_S = 600
# The object store's part: stored results of STORED_BYTES (drawn), at seeded places in the first
# STORED_SPAN of the feed; secret inputs in SECRET_SPAN of it (after the rolling upgrade).
STORED_BYTES = (1 << 20, 3 << 20)
STORED_SPAN = (0.05, 0.8)
SECRET_SPAN = (0.3, 0.9)
STORED_MAX_BYTES = 8 << 20  # the stored capabilities' maxResultBytes
STORED_SIM_MS = 300
FIRST_ATTEMPT = 0  # a dispatch's first Job's attempt (the key its first upload goes to)
FAIL_LOG = "chaos: a planned failure\n"  # what a simulated chaos.fail container writes to its log
FUNCTIONS = "k8s_dispatch.lab.chaos.functions"


class Kind(StrEnum):
    QUICK = "quick"
    SLOW = "slow"
    FAIL = "fail"
    TIMEOUT = "timeout"
    POISON_INF = "poison-inf"
    POISON_SURROGATE = "poison-surrogate"
    POISON_NAN = "poison-nan"
    POISON_UTF8 = "poison-utf8"
    POISON_DEEP = "poison-deep"
    MAP = "map"  # a map dispatch (`MapPlan`), never drawn from MIX
    LARGE = "large"  # a result in the object store (`StoredPlan`), never drawn from MIX
    SECRET = "secret"  # a secret input holding a marker, never drawn from MIX


# What each poison kind's container writes as its termination message (issue 13's holes).
POISON: dict[Kind, bytes] = {
    Kind.POISON_INF: b"1e400",  # JSON for infinity
    Kind.POISON_SURROGATE: b'"\\ud800"',  # a lone surrogate: JavaScript cutting a string mid-emoji
    Kind.POISON_NAN: b'{"score": NaN}',
    Kind.POISON_UTF8: b"\xff\xfe\x80 not utf-8",
    Kind.POISON_DEEP: b"[" * 500 + b"]" * 500,  # deeper than the store keeps
}
# The share of each kind in a run (percent).
MIX: tuple[tuple[Kind, int], ...] = (
    (Kind.QUICK, 45), (Kind.SLOW, 20), (Kind.FAIL, 12), (Kind.TIMEOUT, 13), *((kind, 2) for kind in POISON),
)  # fmt: skip
FAILURE_REASON = {Kind.FAIL: "BackoffLimitExceeded", Kind.TIMEOUT: "DeadlineExceeded"} | {
    kind: "ResultNotJson" for kind in POISON
}
# exec mode: a poison container writes its bytes (base64 in its argument) where the kubelet reads them.
WRITE_BYTES = (
    "import base64, os, sys; open(os.environ.get('TERMINATION_MESSAGE_PATH', '/dev/termination-log'), 'wb')"
    ".write(base64.b64decode(sys.argv[1]))"
)


def capability(kind: Kind) -> str:
    return f"chaos.{kind.value}"


@dataclass(frozen=True)
class Expected:
    """The one terminal event a dispatch must end with."""

    event: EventType
    output: Any = None  # WORKER_COMPLETED: the exact output (unless `stored`)
    stored: tuple[int, str] | None = None  # WORKER_COMPLETED: a reference to an object of this size and SHA-256
    reason: str | None = None  # WORKER_FAILED: the reason
    also: frozenset[str] = frozenset()  # WORKER_FAILED: other reasons the Job controller may give
    detail: Any = None  # WORKER_FAILED: the exact detail, when given (a map's counts)
    any_end: bool = False  # cancelled or edited by hand: any one terminal event will do
    rerun_allowed: bool = False  # a second Job is no fault (a Job edited by hand may be re-run)


@dataclass(frozen=True)
class ItemExpected:
    """The one item event an item of a map must end with."""

    event: ItemEventType
    output: Any = None  # ITEM_COMPLETED: the exact output
    reason: str | None = None  # ITEM_FAILED: the reason
    exit_code: int | None = None  # ITEM_FAILED: the container's exit code, when known
    any_end: bool = False  # its map cancelled or edited by hand: any one item event will do


@dataclass(frozen=True)
class MapPlan:
    """A map dispatch's items and how they run (`schedule_map`'s arguments)."""

    items: tuple[dict[str, Any], ...]
    parallelism: int
    min_succeeded: int | None = None
    max_failed_items: int | None = None

    @property
    def failing(self) -> int:
        return sum(1 for i in range(len(self.items)) if i in MAP_FAILING)


@dataclass(frozen=True)
class StoredPlan:
    """A dispatch whose result goes to the object store: `size` bytes drawn from `stream`."""

    number: int
    stream: str
    size: int

    @property
    def capability(self) -> str:
        return f"chaos.{Kind.LARGE.value}-{self.number}"

    def data(self) -> bytes:
        return stored_bytes(self.stream, self.size)


def stored_bytes(stream: str, size: int) -> bytes:
    """The `size` random bytes of `stream` (the same on every call: the expected output's)."""
    return random.Random(stream).randbytes(size)


@dataclass(frozen=True)
class Planned:
    """One dispatch the feeder schedules (a map dispatch when `map` is set)."""

    index: int
    kind: Kind
    case_id: str
    tenancy_id: str
    input: dict[str, Any]
    via_task: bool  # sent as the Celery `schedule` (`schedule_map`) task, else the in-transaction Python call
    idempotency_key: str
    map: MapPlan | None = None
    stored: StoredPlan | None = None
    secret: bool = False  # scheduled with secret=True (its input holds a marker)
    dispatch_id: str | None = None  # fixed in advance (a stored result's key names it), else drawn at schedule

    @property
    def capability(self) -> str:
        return self.stored.capability if self.stored is not None else capability(self.kind)

    def request(self) -> ScheduleRequest:
        return ScheduleRequest(self.case_id, self.tenancy_id, self.capability, self.input, self.idempotency_key,
                               dispatch_id=self.dispatch_id, secret=self.secret)  # fmt: skip


@dataclass(frozen=True)
class StoredResult:
    """A stored-result dispatch as its capability and the harness see it: the first attempt's key
    and the bytes' size and SHA-256."""

    capability: str
    key: str
    size: int
    sha256: str


def stored_results(planned: list[Planned], *, prefix: str) -> list[StoredResult]:
    """The stored-result dispatches of `planned`, their objects under the object store `prefix`."""
    from k8s_dispatch.artifacts.keys import result_key

    found = []
    for p in planned:
        if p.stored is not None and p.dispatch_id is not None:
            data = p.stored.data()
            found.append(StoredResult(p.stored.capability, result_key(prefix, p.dispatch_id, FIRST_ATTEMPT), len(data),
                                      hashlib.sha256(data).hexdigest()))  # fmt: skip
    return found


def secret_marker(tag: str, seed: int, index: int) -> str:
    """A string that appears nowhere but in one secret input of the run tagged `tag`."""
    return "sekret-" + hashlib.sha256(f"chaos-secret-{tag}-{seed}-{index}".encode()).hexdigest()[:32]


def cases(tag: str) -> list[tuple[str, str]]:
    """(case id, tenancy id) of the cases a run's dispatches belong to; `tag` names the run."""
    return [(f"chaos-{tag}-{t}-{c}", t) for t in TENANCIES for c in range(CASES_PER_TENANCY)]


IDLE_PREFIX = "chaos-idle-"


def idle_namespaces(count: int) -> tuple[str, ...]:
    """The namespaces of capabilities no dispatch of the run uses (what most of a large
    deployment's namespaces are at any moment): each still watched by every poll."""
    return tuple(f"{IDLE_PREFIX}{i:02d}" for i in range(1, count + 1))


def capabilities_config(
    mode: str,
    *,
    python: str = "python",
    limits: bool = True,
    idle: tuple[str, ...] = (),
    stored: list[StoredResult] | None = None,
) -> dict[str, Any]:
    """The capability file's content for `mode` ("simulate" or "exec"), with `LIMITS` unless
    `limits` is False, and one capability in each of the `idle` namespaces (never dispatched).
    With `stored` (an object store configured), one `results: objectStore` capability for each
    stored-result dispatch and `chaos.secret`; without, neither."""
    if mode not in ("simulate", "exec"):
        raise ValueError(f"mode must be simulate or exec, got {mode!r}")
    functions = {Kind.QUICK: "echo", Kind.SLOW: "sleep", Kind.FAIL: "fail", Kind.TIMEOUT: "sleep", Kind.MAP: "sleep"}
    runner = [python, "-m", "k8s_dispatch.container.runner"]
    table: dict[Kind, dict[str, Any]] = {
        kind: {
            "worker": f"chaos-{kind.value}",
            "image": IMAGE,
            "command": runner,
            "args": [f"k8s_dispatch.demo.functions:{functions[kind]}"],
            "backoffLimit": 0,
        }
        for kind in functions
    }
    table[Kind.FAIL]["archiveLogs"] = "onFailure"  # the default, said: each failure's log is checked
    for kind, written in POISON.items():
        encoded = base64.b64encode(written).decode()
        table[kind] = {"worker": f"chaos-{kind.value}", "image": IMAGE, "backoffLimit": 0}
        if mode == "simulate":
            table[kind]["annotations"] = {SIM + "duration-ms": "50", SIM + "result-base64": encoded}
        else:
            table[kind] |= {"command": [python, "-c", WRITE_BYTES], "args": [encoded]}
    if mode == "simulate":  # the same Jobs, their outcome played by localcluster
        table[Kind.QUICK]["annotations"] = {SIM + "duration-ms": "50"}
        table[Kind.SLOW]["annotations"] = {SIM + "duration-ms": str(SLOW_MS)}
        table[Kind.FAIL]["annotations"] = {SIM + "duration-ms": "100", SIM + "outcome": "fail", SIM + "exit-code": "3"}
        table[Kind.FAIL]["annotations"][SIM + "log"] = FAIL_LOG
        table[Kind.TIMEOUT]["annotations"] = {SIM + "outcome": "hang"}
        table[Kind.MAP]["annotations"] = {SIM + "by-index": json.dumps(_by_index(), sort_keys=True)}
    table[Kind.TIMEOUT]["activeDeadlineSeconds"] = TIMEOUT_DEADLINE_S
    config: dict[str, Any] = {"capabilities": {capability(kind): fields for kind, fields in table.items()}}
    if stored is not None:
        config["capabilities"][capability(Kind.SECRET)] = {
            "worker": f"chaos-{Kind.SECRET.value}", "image": IMAGE, "command": runner,
            "args": [f"{FUNCTIONS}:secret_digest"], "backoffLimit": 0,
        }  # fmt: skip
        if mode == "simulate":
            config["capabilities"][capability(Kind.SECRET)]["annotations"] = {SIM + "duration-ms": "50"}
        for result in stored:
            spec: dict[str, Any] = {
                "worker": f"chaos-{Kind.LARGE.value}", "image": IMAGE, "command": runner,
                "args": [f"{FUNCTIONS}:stored_bytes"], "backoffLimit": 0, "results": "objectStore",
                "maxResultBytes": STORED_MAX_BYTES,
            }  # fmt: skip
            if mode == "simulate":  # the message the container would write once its upload is done
                message = result_reference(key=result.key, size=result.size, sha256=result.sha256)
                spec["annotations"] = {SIM + "duration-ms": str(STORED_SIM_MS), SIM + "result": message}
            config["capabilities"][result.capability] = spec
    for namespace in idle:
        config["capabilities"][f"chaos.{namespace}"] = {
            "worker": namespace, "image": IMAGE, "namespace": namespace, "backoffLimit": 0,
        }  # fmt: skip
    if limits:
        config["limits"] = copy.deepcopy(LIMITS)
    return config


def workload(
    seed: int, count: int, *, tag: str, task_every: int = 4, maps: int = 0, stored: int = 0, secrets: int = 0
) -> list[Planned]:
    """`count` dispatches with kinds drawn from MIX by `seed`; every `task_every`-th is sent as
    the Celery `schedule` task (0: none), the rest through the Python call. `maps` of them, at
    places drawn from `seed` in the first MAP_SPAN of the feed, are map dispatches (`map_plan`),
    every second one sent as the `schedule_map` task. `stored` of them (at places drawn in
    STORED_SPAN, not a map's) store their results (`StoredPlan`), and `secrets` (in SECRET_SPAN)
    have secret inputs; every second of each sent as the task. `tag` (unique per run) goes into
    case ids, idempotency keys, the stored results' dispatch ids and the secret markers, so runs
    sharing a database (or a store) never meet."""
    rng = random.Random(f"workload-{seed}")
    kinds, weights = zip(*MIX, strict=True)
    all_cases = cases(tag)
    span = max(1, min(count, int(count * MAP_SPAN)))
    at = sorted(random.Random(f"maps-{seed}").sample(range(span), min(maps, span)))
    placer = random.Random(f"objects-{seed}")
    stored_at = _places(placer, count, STORED_SPAN, stored, taken=set(at))
    secret_at = _places(placer, count, SECRET_SPAN, secrets, taken=set(at) | set(stored_at))
    planned = []
    for i in range(count):
        kind = rng.choices(kinds, weights)[0]  # drawn for a map's place too: the singles stay as they were
        case_id, tenancy_id = all_cases[i % len(all_cases)]
        if i in at:
            number = at.index(i)
            planned.append(Planned(i, Kind.MAP, case_id, tenancy_id, {}, number % 2 == 1, f"chaos-{tag}-{i}",
                                   map_plan(seed, number)))  # fmt: skip
            continue
        if i in stored_at:
            number = stored_at.index(i)
            plan = StoredPlan(
                number, f"stored-{seed}-{number}", random.Random(f"stored-{seed}-{number}").randint(*STORED_BYTES)
            )
            dispatch_id = str(uuid.UUID(bytes=hashlib.sha256(f"chaos-{tag}-{i}".encode()).digest()[:16], version=4))
            stored_input = {"n": i, "stream": plan.stream, "size": plan.size}
            planned.append(Planned(i, Kind.LARGE, case_id, tenancy_id, stored_input, number % 2 == 1,
                                   f"chaos-{tag}-{i}", stored=plan, dispatch_id=dispatch_id))  # fmt: skip
            continue
        if i in secret_at:
            number = secret_at.index(i)
            secret_input = {"n": i, "token": secret_marker(tag, seed, i)}
            planned.append(Planned(i, Kind.SECRET, case_id, tenancy_id, secret_input, number % 2 == 1,
                                   f"chaos-{tag}-{i}", secret=True))  # fmt: skip
            continue
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


def _places(rng: random.Random, count: int, span: tuple[float, float], n: int, *, taken: set[int]) -> list[int]:
    """`n` indexes drawn by `rng` in `span` (fractions) of `count`, none of `taken`, in order."""
    low, high = int(count * span[0]), max(int(count * span[0]) + 1, int(count * span[1]))
    free = [i for i in range(low, min(high, count)) if i not in taken]
    return sorted(rng.sample(free, min(n, len(free))))


def map_plan(seed: int, number: int) -> MapPlan:
    """The `number`-th map of a run seeded `seed`: its size and parallelism drawn, its rule
    MAP_RULES in turn. Item i's input says which it is and how long it runs (exec mode: a
    negative time fails it, as MAP_FAILING says)."""
    rng = random.Random(f"map-{seed}-{number}")
    size = rng.randint(*MAP_ITEMS)
    items = tuple(
        {"map": number, "item": i, "seconds": -1.0 if i in MAP_FAILING else MAP_ITEM_MS[i % 4] / 1000}
        for i in range(size)
    )
    plan = MapPlan(items, rng.randint(*MAP_PARALLELISM))
    rule = MAP_RULES[number % len(MAP_RULES)]
    if rule == "all":
        return plan
    passing = size - plan.failing
    return replace(plan, min_succeeded=passing, max_failed_items=plan.failing if rule.endswith("max_failed") else None)


def _by_index() -> dict[str, dict[str, Any]]:
    """localcluster's simulated end of each completion index of a map Job (our node agent reads
    the same): MAP_FAILING fail with exit 2 and a log line naming the item, the others write
    {"item": i}; each runs MAP_ITEM_MS[i % 4]."""
    table: dict[str, dict[str, Any]] = {}
    for i in range(MAP_ITEMS[1]):
        ms = str(MAP_ITEM_MS[i % 4])
        if i in MAP_FAILING:
            table[str(i)] = {"outcome": "fail", "exit-code": "2", "log": f"bad item {i}\n", "duration-ms": ms}
        else:
            table[str(i)] = {"result": {"item": i}, "duration-ms": ms}
    return table


def expected(kind: Kind, data: Any, *, mode: str) -> Expected:
    """The terminal event a dispatch of `kind` with input `data` must end with in `mode`."""
    if kind is Kind.LARGE:
        stored = stored_bytes(data["stream"], data["size"])
        return Expected(EventType.WORKER_COMPLETED, stored=(len(stored), hashlib.sha256(stored).hexdigest()))
    if kind is Kind.SECRET:  # a simulated container echoes only an input given as a literal value
        if mode == "simulate":
            return Expected(EventType.WORKER_COMPLETED, output={"simulated": True, "input": None})
        from k8s_dispatch.lab.chaos.functions import secret_digest

        return Expected(EventType.WORKER_COMPLETED, output=secret_digest(data))
    if kind is Kind.TIMEOUT:
        # The real Job controller checks the backoff limit before the deadline: when it has
        # deleted the Pod at the deadline but could not yet write DeadlineExceeded (the API
        # server restarting), the killed Pod counts as a failure, and backoffLimit 0 is passed.
        return Expected(EventType.WORKER_FAILED, reason=FAILURE_REASON[kind], also=frozenset({"BackoffLimitExceeded"}))
    if kind in FAILURE_REASON:
        return Expected(EventType.WORKER_FAILED, reason=FAILURE_REASON[kind])
    if mode == "simulate":
        return Expected(EventType.WORKER_COMPLETED, output={"simulated": True, "input": data})
    if kind is Kind.SLOW:
        return Expected(EventType.WORKER_COMPLETED, output={"slept": float(data["seconds"])})
    return Expected(EventType.WORKER_COMPLETED, output=data)


def expected_map(plan: MapPlan) -> Expected:
    """The terminal event a map must end with: its counts, passed or ItemsFailed."""
    size = len(plan.items)
    needed = size if plan.min_succeeded is None else plan.min_succeeded
    summary = {"items": size, "succeeded": size - plan.failing, "failed": plan.failing, "needed": needed}
    if size - plan.failing >= needed:
        return Expected(EventType.WORKER_COMPLETED, output=summary)
    return Expected(EventType.WORKER_FAILED, reason="ItemsFailed", detail=summary)


def expected_items(plan: MapPlan, *, mode: str) -> list[ItemExpected]:
    """The item event each item of a map must end with in `mode`, by index."""
    found = []
    for i, item in enumerate(plan.items):
        if i in MAP_FAILING:
            found.append(ItemExpected(ItemEventType.ITEM_FAILED, reason=ITEM_FAILURE_REASON,
                                      exit_code=2 if mode == "simulate" else 1))  # fmt: skip
        elif mode == "simulate":
            found.append(ItemExpected(ItemEventType.ITEM_COMPLETED, output={"item": i}))
        else:
            found.append(ItemExpected(ItemEventType.ITEM_COMPLETED, output={"slept": float(item["seconds"])}))
    return found


def expected_end(planned: Planned, *, mode: str) -> Expected:
    """The terminal event `planned` (a single or a map) must end with in `mode`."""
    if planned.map is not None:
        return expected_map(planned.map)
    return expected(planned.kind, planned.input, mode=mode)


def kind_of(capability_name: str) -> Kind | None:
    """The kind a capability name stands for, or None if it is not one of ours."""
    prefix = "chaos."
    if not capability_name.startswith(prefix):
        return None
    if capability_name.startswith(f"{prefix}{Kind.LARGE.value}-"):
        return Kind.LARGE
    try:
        return Kind(capability_name[len(prefix) :])
    except ValueError:
        return None
