"""WORKER_DISRUPTED events: one per disrupted Pod, whoever records it how often (repeats, a batch
naming a Pod twice, 12 connections at once on PostgreSQL), none after the dispatch ended, and
counted per dispatch."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from k8s_dispatch.core.errors import InputNotSerialisable, InvalidInput
from k8s_dispatch.store import dispatches
from k8s_dispatch.store.db import make_sessionmaker, transaction
from k8s_dispatch.store.disruptions import DisruptionEvent, disruptions_of, record_disruptions
from k8s_dispatch.store.models import CaseEvent, DispatchState, EventType


def _event(dispatch_id: str, uid: str, **more: object) -> DisruptionEvent:
    return DisruptionEvent(
        dispatch_id, {"pod_uid": uid, "pod": f"pod-{uid}", "reason": "EvictionByEvictionAPI", **more}
    )


def test_each_pod_is_recorded_once_and_counted(db_url, engine_factory, new_case, schedule_for) -> None:
    sm = make_sessionmaker(engine_factory(db_url))
    case = new_case(sm)
    a, b = (schedule_for(sm, case).dispatch_id for _ in range(2))
    with transaction(sm) as session:
        first = record_disruptions(session, [_event(a, "u1"), _event(a, "u1"), _event(b, "u9")])
    assert (first[a].total, first[a].new, first[b].total, first[b].new) == (1, ("u1",), 1, ("u9",))
    with transaction(sm) as session:
        again = record_disruptions(session, [_event(a, "u1"), _event(a, "u2")])
    assert (again[a].total, again[a].new) == (2, ("u2",)) and b not in again
    with transaction(sm) as session:
        events = disruptions_of(session, a)
        assert [e.payload["pod_uid"] for e in events] == ["u1", "u2"]
        assert {e.type for e in events} == {EventType.WORKER_DISRUPTED}
        assert dispatches.get_dispatch(session, a).state is DispatchState.SCHEDULED  # not an end


def test_nothing_is_recorded_for_an_ended_or_unknown_dispatch(db_url, engine_factory, new_case, schedule_for) -> None:
    sm = make_sessionmaker(engine_factory(db_url))
    case = new_case(sm)
    ended = schedule_for(sm, case).dispatch_id
    with transaction(sm) as session:
        dispatches.record_terminal(session, ended, EventType.WORKER_FAILED, {"reason": "Disrupted"})
    with transaction(sm) as session:
        out = record_disruptions(session, [_event(ended, "late"), _event("00000000-0000-4000-8000-000000000000", "x")])
    assert list(out) == [ended] and (out[ended].new, out[ended].state) == ((), DispatchState.FAILED)
    with transaction(sm) as session:
        assert disruptions_of(session, ended) == []


@pytest.mark.parametrize(
    ("payload", "error"),
    [({"pod": "no uid"}, InvalidInput), ({"pod_uid": "u", "at": float("nan")}, InputNotSerialisable)],
)
def test_a_bad_disruption_is_refused_and_nothing_written(
    db_url, engine_factory, new_case, schedule_for, payload, error
) -> None:
    sm = make_sessionmaker(engine_factory(db_url))
    dispatch_id = schedule_for(sm, new_case(sm)).dispatch_id
    with pytest.raises(error), transaction(sm) as session:
        record_disruptions(session, [_event(dispatch_id, "good"), DisruptionEvent(dispatch_id, payload)])
    with transaction(sm) as session:
        assert disruptions_of(session, dispatch_id) == []


def test_twelve_connections_recording_the_same_pods_write_each_once_postgresql(
    pg_url, engine_factory, new_case, schedule_for, race
) -> None:
    threads, rounds = 12, 10
    sm = make_sessionmaker(engine_factory(pg_url, pool_size=threads + 1, max_overflow=0))
    case = new_case(sm)
    ids = sorted(schedule_for(sm, case).dispatch_id for _ in range(3))

    def record(round_: int, thread: int) -> int:
        # every thread names every dispatch's Pods of this round, in its own order
        events = [_event(d, f"r{round_}-{d[:4]}-{k}") for d in ids for k in range(2)]
        with transaction(sm) as session:
            out = record_disruptions(session, events[thread % 6 :] + events[: thread % 6])
        return sum(len(d.new) for d in out.values())

    results = race(threads, rounds, record)
    assert [sum(row) for row in results] == [len(ids) * 2] * rounds  # each Pod written by one thread
    with transaction(sm) as session:
        counts = dict(
            session.execute(
                sa.select(CaseEvent.dispatch_id, sa.func.count())
                .where(CaseEvent.dispatch_id.in_(ids), CaseEvent.type == EventType.WORKER_DISRUPTED.value)
                .group_by(CaseEvent.dispatch_id)
            ).all()
        )
    assert counts == {d: 2 * rounds for d in ids}
