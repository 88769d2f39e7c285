"""Fair-share limits: how many dispatches of a tenancy or a capability may hold a slot at once,
and which queued dispatches a free slot goes to (pure: the config's parse and the decision).

A dispatch holds a slot from its admission (QUEUED -> SCHEDULED) until its terminal event is
recorded (SCHEDULED and CREATED hold); a map dispatch holds one per Pod its Indexed Job may run at
once (`store/admission.py` says how many). The database is the only count.
Schema (in the capabilities file, beside `capabilities:`)::

    limits:
      tenancies:
        default: {maxRunning: 100}        # every tenancy not named (absent: unnamed ones unlimited)
        acme: {maxRunning: 3, weight: 2}  # weight: its share of what runs, against the others' (default 1)
      capabilities:
        demo.sha256: {maxRunning: 5}      # across every tenancy

`maxRunning: 0` pauses (nothing new is admitted; what runs finishes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from fractions import Fraction
from types import MappingProxyType
from typing import Any

DEFAULT_TENANCY = "default"  # the `tenancies` key that names every tenancy not named
DEFAULT_WEIGHT = 1
MAX_LIMIT = 1_000_000
_TENANCY_FIELDS = frozenset({"maxRunning", "weight"})
_CAPABILITY_FIELDS = frozenset({"maxRunning"})
_EMPTY: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True)
class TenancyLimit:
    max_running: int | None = None  # None: no limit of its own (still weighted against the others)
    weight: int = DEFAULT_WEIGHT


@dataclass(frozen=True)
class Limits:
    """The validated `limits:` section. Empty (the default): nothing is ever queued."""

    tenancies: Mapping[str, TenancyLimit] = field(default_factory=lambda: _EMPTY)
    capabilities: Mapping[str, int] = field(default_factory=lambda: _EMPTY)

    def __bool__(self) -> bool:
        return bool(self.tenancies or self.capabilities)

    def tenancy(self, tenancy_id: str) -> TenancyLimit:
        """Its own entry, else `default`'s, else unlimited with weight 1."""
        return self.tenancies.get(tenancy_id) or self.tenancies.get(DEFAULT_TENANCY) or TenancyLimit()

    def capability(self, capability: str) -> int | None:
        return self.capabilities.get(capability)

    def limits(self, tenancy_id: str, capability: str) -> bool:
        """Whether a dispatch of this tenancy and capability waits for admission (is queued)."""
        return self.tenancy(tenancy_id).max_running is not None or self.capability(capability) is not None


def parse(value: object, *, source: str) -> tuple[Limits, list[str]]:
    """The `limits:` section and its problems, each naming `source`, the key and the field."""
    problems: list[str] = []
    if value is None:
        return Limits(), problems
    if not isinstance(value, Mapping):
        return Limits(), [f"{source}: limits: must be a mapping with 'tenancies' and/or 'capabilities'"]
    for key in sorted(str(k) for k in value if k not in ("tenancies", "capabilities")):
        problems.append(f"{source}: limits: unknown key {key!r} (only 'tenancies' and 'capabilities')")
    tenancies: dict[str, TenancyLimit] = {}
    for name, fields in _section(value, "tenancies", source, problems).items():
        where = f"{source}: limits.tenancies.{name}"
        checked = _fields(fields, _TENANCY_FIELDS, where, problems)
        if checked is not None:
            max_running = _count(checked, "maxRunning", where, problems, minimum=0)
            weight = _count(checked, "weight", where, problems, minimum=1)
            tenancies[name] = TenancyLimit(max_running, DEFAULT_WEIGHT if weight is None else weight)
    capabilities: dict[str, int] = {}
    for name, fields in _section(value, "capabilities", source, problems).items():
        where = f"{source}: limits.capabilities.{name}"
        checked = _fields(fields, _CAPABILITY_FIELDS, where, problems)
        if checked is not None:
            if "maxRunning" not in checked:
                problems.append(f"{where}: field 'maxRunning': required")
            max_running = _count(checked, "maxRunning", where, problems, minimum=0)
            if max_running is not None:
                capabilities[name] = max_running
    return Limits(MappingProxyType(tenancies), MappingProxyType(capabilities)), problems


def _section(value: Mapping[Any, Any], key: str, source: str, problems: list[str]) -> Mapping[str, Any]:
    section = value.get(key)
    if section is None:
        return _EMPTY
    if not isinstance(section, Mapping):
        problems.append(f"{source}: limits.{key}: must be a mapping of name -> fields")
        return _EMPTY
    named: dict[str, Any] = {}
    for name, fields in section.items():
        if not isinstance(name, str) or not name:
            problems.append(f"{source}: limits.{key}: {name!r} is not a name")
        else:
            named[name] = fields
    return named


def _fields(fields: object, allowed: frozenset[str], where: str, problems: list[str]) -> Mapping[str, Any] | None:
    if not isinstance(fields, Mapping):
        problems.append(f"{where}: must be a mapping of fields ({', '.join(sorted(allowed))})")
        return None
    for key in sorted(str(k) for k in fields if k not in allowed):
        problems.append(f"{where}: unknown field {key!r} (allowed: {', '.join(sorted(allowed))})")
    return fields


def _count(fields: Mapping[str, Any], key: str, where: str, problems: list[str], *, minimum: int) -> int | None:
    value = fields.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_LIMIT:
        problems.append(f"{where}: field {key!r}: must be an integer from {minimum} to {MAX_LIMIT}, got {value!r}")
        return None
    return value


# --- the decision ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """A queued dispatch at the head of its (tenancy, capability) queue."""

    dispatch_id: str
    tenancy_id: str
    capability: str
    priority: int
    created_at: datetime
    # The slots it asks for: 1, a map's the Pods it would run at once. In `choose`'s answer: the
    # slots it got (from 1 to those asked).
    slots: int = 1

    def order(self) -> tuple[int, datetime, str]:
        """Within a tenancy: higher priority first, then first in, first out."""
        return (-self.priority, self.created_at, self.dispatch_id)


Pair = tuple[str, str]  # (tenancy, capability)


def free_slots(limits: Limits, running: Mapping[Pair, int], pair: Pair) -> int | None:
    """How many of `pair`'s queue could be admitted now at most (None: no limit applies)."""
    tenancy, capability = pair
    frees = []
    own = limits.tenancy(tenancy).max_running
    if own is not None:
        frees.append(own - sum(n for (t, _), n in running.items() if t == tenancy))
    cap = limits.capability(capability)
    if cap is not None:
        frees.append(cap - sum(n for (_, c), n in running.items() if c == capability))
    return max(0, min(frees)) if frees else None


def choose(limits: Limits, running: Mapping[Pair, int], heads: Mapping[Pair, Sequence[Candidate]]) -> list[Candidate]:
    """The candidates to admit, in admission order, each with the `slots` it got: slot by slot,
    the tenancy furthest below its weighted share of what runs (fewest running per weight; ties
    to the one waiting longest) gets a slot for its best candidate (priority, then FIFO) whose
    tenancy and capability both have a free slot. `heads` holds each queue's first candidates,
    best first; `running` the slots held.

    A candidate asking several slots (a map) is admitted with its first one and stays at the head
    of its queue, taking the next slots its tenancy's turns give it, until it has what it asked
    or its tenancy or capability is full: so it is admitted as soon as one slot is free (a map
    wider than the room never waits for room it may never see), never takes more than the room,
    and shares free slots with the other tenancies by their weights as single dispatches do.
    Behind it, its own queue waits (first in, first out). The slots one candidate gets in a row
    are given at once (`_turns`): the answer of slot by slot, in steps bounded by the turns
    rather than by the slots."""
    by_tenancy: dict[str, int] = {}
    by_capability: dict[str, int] = {}
    for (tenancy, capability), n in running.items():
        by_tenancy[tenancy] = by_tenancy.get(tenancy, 0) + n
        by_capability[capability] = by_capability.get(capability, 0) + n
    queues = {pair: list(candidates) for pair, candidates in heads.items() if candidates}
    got: dict[str, int] = {}  # dispatch id -> slots given, in admission order
    picked: dict[str, Candidate] = {}

    def room(pair: Pair) -> int | None:
        tenancy, capability = pair
        own, cap = limits.tenancy(tenancy).max_running, limits.capability(capability)
        rooms = [] if own is None else [own - by_tenancy.get(tenancy, 0)]
        rooms += [] if cap is None else [cap - by_capability.get(capability, 0)]
        return min(rooms) if rooms else None

    while True:
        best: dict[str, Candidate] = {}  # per tenancy, its best admissible candidate
        for pair, queue in queues.items():
            free = room(pair)
            if queue and (free is None or free > 0):
                head, current = queue[0], best.get(pair[0])
                if current is None or head.order() < current.order():
                    best[pair[0]] = head
        if not best:
            return [replace(picked[d], slots=n) for d, n in got.items()]
        tenancy = min(best, key=lambda t: _share(limits, by_tenancy, t, best[t]))
        pick = best[tenancy]
        pair = (pick.tenancy_id, pick.capability)
        n = pick.slots - got.get(pick.dispatch_id, 0)
        free = room(pair)
        n = min(n, _turns(limits, by_tenancy, best, tenancy), *([] if free is None else [free]))
        got[pick.dispatch_id] = got.get(pick.dispatch_id, 0) + n
        picked[pick.dispatch_id] = pick
        if got[pick.dispatch_id] >= pick.slots:
            queues[pair].pop(0)
        by_tenancy[tenancy] = by_tenancy.get(tenancy, 0) + n
        by_capability[pick.capability] = by_capability.get(pick.capability, 0) + n


def _share(
    limits: Limits, by_tenancy: Mapping[str, int], tenancy: str, head: Candidate
) -> tuple[Fraction, datetime, str]:
    """A tenancy's place for the next slot (lowest first); exact, so `_turns` agrees with it."""
    return (Fraction(by_tenancy.get(tenancy, 0), limits.tenancy(tenancy).weight), head.created_at, tenancy)


def _turns(limits: Limits, by_tenancy: Mapping[str, int], best: Mapping[str, Candidate], tenancy: str) -> int:
    """How many slots in a row `tenancy` (the one `_share` puts first) gets before another of
    `best` comes first (at least 1; unbounded, MAX_LIMIT, when no other waits)."""
    weight, held = limits.tenancy(tenancy).weight, by_tenancy.get(tenancy, 0)
    turns = MAX_LIMIT
    for other, head in best.items():
        if other == tenancy:
            continue
        # `tenancy` stays first while (held + j) / weight < theirs / their weight, or equal with
        # its tie-break first: the largest held + j it is still first at, in integers.
        theirs, their_weight = by_tenancy.get(other, 0), limits.tenancy(other).weight
        bound = theirs * weight
        if (best[tenancy].created_at, tenancy) < (head.created_at, other):
            last = bound // their_weight
        else:
            last = -(-bound // their_weight) - 1
        turns = min(turns, last - held + 1)
    return max(1, turns)
