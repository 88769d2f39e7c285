"""Fair share with map dispatches: a map holds a slot per Pod its Job may run at once, is
admitted with the room its limits have (at least one slot) and its granted parallelism written
where its Job is made from; `choose` gives a multi-slot candidate exactly what slot by slot
would. The pure decision in tables and by Hypothesis, the store on PostgreSQL and SQLite."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from fractions import Fraction
from pathlib import Path

import pytest
import sqlalchemy as sa
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy.orm import Session, sessionmaker

from k8s_dispatch.core.limits import Candidate, Limits, Pair, TenancyLimit, choose
from k8s_dispatch.store import admission, dispatches, maps, migrate
from k8s_dispatch.store.db import database_now, make_engine, make_sessionmaker, transaction
from k8s_dispatch.store.models import DispatchMap, DispatchState, EventType, ItemEventType
from tests.store.test_admission import LimitedRouter, admit, end, schedule, states

T0 = datetime(2026, 12, 1, tzinfo=UTC)


def one(tenancy: str, capability: str, i: int, *, slots: int = 1, priority: int = 0) -> Candidate:
    return Candidate(f"{tenancy}-{capability}-{i}", tenancy, capability, priority, T0 + timedelta(seconds=i), slots)


def got(chosen: Sequence[Candidate]) -> list[tuple[str, int]]:
    return [(c.dispatch_id, c.slots) for c in chosen]


# --- the decision (pure) -------------------------------------------------------------------


def test_a_map_is_admitted_with_the_room_it_finds_and_never_more() -> None:
    limits = Limits(tenancies={"a": TenancyLimit(3)})
    heads = {("a", "c"): [one("a", "c", 0, slots=5), one("a", "c", 1)]}
    assert got(choose(limits, {("a", "c"): 1}, heads)) == [("a-c-0", 2)]  # the single behind it waits (FIFO)
    assert got(choose(limits, {("a", "c"): 3}, heads)) == []
    assert got(choose(Limits(tenancies={"a": TenancyLimit(9)}), {}, heads)) == [("a-c-0", 5), ("a-c-1", 1)]
    assert got(choose(Limits(capabilities={"x": 1}), {}, heads)) == [("a-c-0", 5), ("a-c-1", 1)]  # no limit on c


def test_a_maps_slots_follow_the_weights_against_other_tenancies() -> None:
    shared = Limits(tenancies={"a": TenancyLimit(None, 1), "b": TenancyLimit(None, 2)}, capabilities={"c": 6})
    heads = {("a", "c"): [one("a", "c", 0, slots=10)], ("b", "c"): [one("b", "c", 100 + i) for i in range(6)]}
    chosen = choose(shared, {}, heads)
    assert chosen[0].dispatch_id == "a-c-0"  # the oldest head: the first slot is its
    assert got(chosen)[0] == ("a-c-0", 2) and sum(c.slots for c in chosen) == 6
    # Two maps of equal weight share a capability half and half, however much each asks.
    halves = {("a", "c"): [one("a", "c", 0, slots=50)], ("b", "c"): [one("b", "c", 1, slots=50)]}
    assert got(choose(Limits(capabilities={"c": 7}), {("b", "c"): 1}, halves)) == [("a-c-0", 4), ("b-c-1", 2)]


def test_a_full_capability_lets_a_tenancys_map_on_another_through() -> None:
    limits = Limits(tenancies={"a": TenancyLimit(10)}, capabilities={"x": 2})
    heads = {("a", "x"): [one("a", "x", 0, slots=8)], ("a", "y"): [one("a", "y", 1, slots=8)]}
    assert got(choose(limits, {}, heads)) == [("a-x-0", 2), ("a-y-1", 8)]


def reference(
    limits: Limits, running: Mapping[Pair, int], heads: Mapping[Pair, Sequence[Candidate]]
) -> list[Candidate]:
    """`choose` slot by slot, one slot a step, as the docstring says it behaves."""
    by_t: dict[str, int] = {}
    by_c: dict[str, int] = {}
    for (t, c), n in running.items():
        by_t[t] = by_t.get(t, 0) + n
        by_c[c] = by_c.get(c, 0) + n
    queues = {p: list(q) for p, q in heads.items() if q}
    slots: dict[str, int] = {}
    first: dict[str, Candidate] = {}

    def fits(t: str, c: str) -> bool:
        own, cap = limits.tenancy(t).max_running, limits.capability(c)
        return (own is None or by_t.get(t, 0) < own) and (cap is None or by_c.get(c, 0) < cap)

    while True:
        best: dict[str, Candidate] = {}
        for (t, c), q in queues.items():
            if q and fits(t, c) and (t not in best or q[0].order() < best[t].order()):
                best[t] = q[0]
        if not best:
            return [Candidate(**{**first[d].__dict__, "slots": n}) for d, n in slots.items()]
        t = min(best, key=lambda t: (Fraction(by_t.get(t, 0), limits.tenancy(t).weight), best[t].created_at, t))
        pick = best[t]
        slots[pick.dispatch_id] = slots.get(pick.dispatch_id, 0) + 1
        first.setdefault(pick.dispatch_id, pick)
        if slots[pick.dispatch_id] == pick.slots:
            queues[(t, pick.capability)].pop(0)
        by_t[t] = by_t.get(t, 0) + 1
        by_c[pick.capability] = by_c.get(pick.capability, 0) + 1


TENANCIES, CAPABILITIES = ["a", "b", "c"], ["x", "y"]


@st.composite
def situations(draw: st.DrawFn) -> tuple[Limits, dict[Pair, int], dict[Pair, list[Candidate]]]:
    maybe = st.one_of(st.none(), st.integers(0, 12))
    tenancies = {t: TenancyLimit(draw(maybe), draw(st.integers(1, 3))) for t in TENANCIES}
    capabilities = {c: n for c in CAPABILITIES if (n := draw(maybe)) is not None}
    pairs = [(t, c) for t in TENANCIES for c in CAPABILITIES]
    running = {p: draw(st.integers(0, 4)) for p in pairs if draw(st.booleans())}
    heads: dict[Pair, list[Candidate]] = {}
    for t, c in pairs:
        count = draw(st.integers(0, 3))
        made = [  # few distinct times: heads of different tenancies often tie, as do their shares
            Candidate(
                f"{t}-{c}-{i}",
                t,
                c,
                draw(st.integers(0, 1)),
                T0 + timedelta(seconds=draw(st.integers(0, 3))),
                draw(st.integers(1, 9)),
            )
            for i in range(count)
        ]
        heads[(t, c)] = sorted(made, key=Candidate.order)
    return Limits(tenancies=tenancies, capabilities=capabilities), running, heads


@settings(max_examples=300, deadline=None)
@given(situations())
def test_choose_gives_what_slot_by_slot_gives_and_no_limit_is_exceeded(
    situation: tuple[Limits, dict[Pair, int], dict[Pair, list[Candidate]]],
) -> None:
    limits, running, heads = situation
    chosen = choose(limits, running, heads)
    assert got(chosen) == got(reference(limits, running, heads))
    for t in TENANCIES:
        own = limits.tenancy(t).max_running
        before = sum(n for (tt, _), n in running.items() if tt == t)
        if own is not None:
            assert sum(c.slots for c in chosen if c.tenancy_id == t) <= max(0, own - before)
    for cap, limit in limits.capabilities.items():
        before = sum(n for (_, cc), n in running.items() if cc == cap)
        assert sum(c.slots for c in chosen if c.capability == cap) <= max(0, limit - before)


# --- the store -----------------------------------------------------------------------------


@pytest.fixture(params=["postgresql", "sqlite"])
def sm(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sessionmaker[Session]]:
    """Sessions on an empty database of this test alone (admission reads every queue)."""
    url = (
        request.getfixturevalue("new_pg_database")()
        if request.param == "postgresql"
        else f"sqlite:///{tmp_path / 'a.db'}"
    )
    migrate.upgrade(url)
    engine = make_engine(url)
    yield make_sessionmaker(engine)
    engine.dispose()


def schedule_map(sm: sessionmaker[Session], router: LimitedRouter, tenancy: str, items: int, parallelism: int) -> str:
    case_id = f"case-{uuid.uuid4().hex[:8]}"
    from k8s_dispatch.store import scheduling

    with transaction(sm) as session:
        scheduling.create_case(session, case_id=case_id, tenancy_id=tenancy)
        request = maps.MapRequest(
            case_id, tenancy, "echo", [{"i": i} for i in range(items)], f"m-{uuid.uuid4()}", parallelism
        )
        return maps.schedule_map(session, request, router=router, max_input_bytes=4096).dispatch_id


def parallelism(sm: sessionmaker[Session], dispatch_id: str) -> int:
    with transaction(sm) as session:
        return int(session.scalar(sa.select(DispatchMap.parallelism).where(DispatchMap.dispatch_id == dispatch_id)))


def held(sm: sessionmaker[Session], limits: Limits) -> tuple[dict[Pair, int], dict[str, tuple[int, int]]]:
    with transaction(sm) as session:
        return admission.holding(session, limits), dict(admission.by_tenancy(admission.summary(session)))


def end_items(sm: sessionmaker[Session], dispatch_id: str, indexes: range) -> None:
    with transaction(sm) as session:
        maps.record_item_ends(
            session, [maps.ItemEnd(dispatch_id, i, ItemEventType.ITEM_COMPLETED, {"output": i}) for i in indexes]
        )


def test_a_map_takes_the_room_left_runs_that_parallelism_and_frees_slots_as_its_last_items_end(sm) -> None:
    limits = Limits(tenancies={"acme": TenancyLimit(4)})
    router = LimitedRouter(limits)
    (single,) = schedule(sm, router, "acme", 1)
    assert admit(sm, limits) == [single]
    wide = schedule_map(sm, router, "acme", items=6, parallelism=5)
    (behind,) = schedule(sm, router, "acme", 1)
    with transaction(sm) as session:
        (admitted,) = admission.admit(session, limits, now=database_now(session))
    assert (admitted.dispatch_id, admitted.parallelism) == (wide, 3)  # the room left, not the 5 asked
    assert parallelism(sm, wide) == 3  # what its Job is made from
    assert held(sm, limits) == ({("acme", "echo"): 4}, {"acme": (4, 1)})
    assert admit(sm, limits) == []

    end_items(sm, wide, range(3))  # 3 items open: its Job still runs 3 Pods at once
    assert admit(sm, limits) == []
    end_items(sm, wide, range(3, 5))  # 1 open: 2 of its slots free
    assert held(sm, limits)[0] == {("acme", "echo"): 2}
    assert admit(sm, limits) == [behind]
    end_items(sm, wide, range(5, 6))  # every item ended: it holds one slot until its own end
    assert held(sm, limits) == ({("acme", "echo"): 3}, {"acme": (3, 0)})
    end(sm, [single, behind])
    assert held(sm, limits)[0] == {("acme", "echo"): 1}


def test_an_ended_map_holds_its_parallelism_until_its_job_is_seen_stopped(sm) -> None:
    limits = Limits(tenancies={"acme": TenancyLimit(4)})
    router = LimitedRouter(limits)
    wide = schedule_map(sm, router, "acme", items=10, parallelism=3)
    assert admit(sm, limits) == [wide]
    assert parallelism(sm, wide) == 3  # all it asked: left as it was
    end_items(sm, wide, range(9))
    end(sm, [wide], EventType.WORKER_CANCELLED)  # its open item ends with it; its Pods may run on
    assert held(sm, limits)[0] == {("acme", "echo"): 3}
    with transaction(sm) as session:
        assert dispatches.mark_jobs_stopped(session, [wide]) == {wide}
    assert held(sm, limits) == ({}, {})


def test_a_map_waits_while_no_slot_is_free_and_one_no_limit_covers_keeps_its_parallelism(sm) -> None:
    limits = Limits(tenancies={"acme": TenancyLimit(2)})
    router = LimitedRouter(limits)
    singles = schedule(sm, router, "acme", 2)
    assert sorted(admit(sm, limits)) == sorted(singles)
    wide = schedule_map(sm, router, "acme", items=4, parallelism=4)
    assert admit(sm, limits) == []
    end(sm, singles[:1])
    assert admit(sm, limits) == [wide]
    assert parallelism(sm, wide) == 1
    free = schedule_map(sm, router, "other", items=4, parallelism=8)  # no limit: scheduled, never narrowed
    assert states(sm, [free]) == [DispatchState.SCHEDULED]
    assert parallelism(sm, free) == 8
    # Rows an engine wrote QUEUED, limits removed since: admitted whole.
    late = schedule_map(sm, router, "acme", items=5, parallelism=9)
    with transaction(sm) as session:
        (admitted,) = admission.admit(session, Limits(), now=database_now(session))
    assert (admitted.dispatch_id, admitted.parallelism, parallelism(sm, late)) == (late, 5, 9)
