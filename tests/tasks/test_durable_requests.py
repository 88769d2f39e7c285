"""Requests that must not live only in the broker: a cancel is recorded in the engine's own
transaction (`cancel_in_session`) and honoured by the sweep after a broker flush; a schedule
by task call is re-sent with its idempotency key until it is recorded
(`send_schedule_until_recorded`). Real `celery -A k8s_dispatch.tasks worker` processes, PostgreSQL, Redis
and localcluster.
"""

from __future__ import annotations

import base64
import json
import threading
import uuid
from typing import Any

import pytest

from k8s_dispatch import celeryconfig as names
from k8s_dispatch.core.errors import ScheduleNotRecorded, Transient, UnknownDispatch
from k8s_dispatch.delivery import complete, create
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.recovery.sweep import run_sweep
from k8s_dispatch.store import dispatches
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import DispatchState, EventType
from k8s_dispatch.tasks.recovery_tasks import STARTUP_SWEEP_DONE
from k8s_dispatch.tasks.scheduling import cancel_in_session, send_schedule_until_recorded
from k8s_dispatch.workers.job_status import job_state
from k8s_dispatch.workers.manifest import job_name

SIM = "localcluster.k8s-dispatch.io/"
CAPABILITIES = {
    "sim.ok": {"worker": "sim", "image": "sim:1", "annotations": {SIM + "duration-ms": "30"}},
    "sim.hang": {"worker": "sim", "image": "sim:1", "annotations": {SIM + "outcome": "hang"}},
}
WORKER_START_S = 90.0


def queued(d, queue: str = names.JOBS_QUEUE) -> list[tuple[str, list[Any], dict[str, Any]]]:
    """(task, args, kwargs) of the messages waiting in `queue`, oldest first."""
    out = []
    for raw in reversed(d.redis.lrange(f"{d.prefix}:{queue}", 0, -1)):  # kombu LPUSHes
        envelope = json.loads(raw)
        args, kwargs, _embed = json.loads(base64.b64decode(envelope["body"]))
        out.append((envelope["headers"]["task"], args, kwargs))
    return out


def flush_broker(d) -> int:
    """Every Redis key of the run (queues, unacked messages, markers): a broker that lost it all."""
    keys = list(d.redis.scan_iter(match=f"{d.prefix}:*", count=1000))
    return d.redis.delete(*keys) if keys else 0


def state(d, dispatch_id: str) -> DispatchState | None:
    with transaction(d.sessions) as session:
        row = dispatches.get_dispatch(session, dispatch_id)
        return None if row is None else DispatchState(row.state)


def terminal_types(d, ids: list[str]) -> dict[str, list[str]]:
    return {i: [t for t, _ in events] for i, events in d.terminal_events(ids).items()}


# --- cancel -----------------------------------------------------------------------------------


def test_a_cancel_in_session_survives_a_broker_flush_and_the_sweep_deletes_the_running_job(deploy, sim_cluster):
    d = deploy(sim_cluster, capabilities=CAPABILITIES, sweep_grace_s="0")
    worker = d.start_worker("w1")
    (dispatch_id,) = d.schedule_batch("sim.hang", 1)
    d.wait(lambda: state(d, dispatch_id) is DispatchState.CREATED and d.jobs(), what="the Job running")
    assert worker.stop() == 0  # no worker: the cancel's message waits in the broker

    with transaction(d.sessions) as session:
        assert cancel_in_session(session, dispatch_id, reason="NotNeeded", via=d.producer) is True
        assert queued(d) == []  # nothing before the commit
    assert queued(d) == [(names.CANCEL_TASK, [dispatch_id], {"recorded": True})]
    assert flush_broker(d) > 0  # ... and it is lost
    assert [j["metadata"]["name"] for j in d.jobs()] == [job_name(dispatch_id)]  # still running

    # Nothing queued, no beat: only the new worker's start-up sweep acts.
    d.start_worker("w2", wait=False).wait_for_log(STARTUP_SWEEP_DONE, timeout_s=WORKER_START_S)
    d.wait_no_jobs()
    assert d.terminal_events([dispatch_id]) == {dispatch_id: [(EventType.WORKER_CANCELLED, {"reason": "NotNeeded"})]}
    assert state(d, dispatch_id) is DispatchState.CANCELLED
    d.wait(lambda: d.notifications() == [dispatch_id], what="the engine notified by the sweep")


def test_a_cancel_in_session_is_followed_by_a_worker_deleting_the_job_and_notifying(deploy, sim_cluster):
    d = deploy(sim_cluster, capabilities=CAPABILITIES)  # grace 30 s: the sweep does none of this
    d.start_worker("w1")
    (dispatch_id,) = d.schedule_batch("sim.hang", 1)
    d.wait(lambda: state(d, dispatch_id) is DispatchState.CREATED and d.jobs(), what="the Job running")
    with transaction(d.sessions) as session:
        assert cancel_in_session(session, dispatch_id, via=d.producer) is True
    with transaction(d.sessions) as session:
        assert cancel_in_session(session, dispatch_id, via=d.producer) is False  # ended already: nothing sent
    d.wait_no_jobs()
    d.wait(lambda: d.notifications() == [dispatch_id], what="the engine notified once")
    assert d.terminal_events([dispatch_id]) == {dispatch_id: [(EventType.WORKER_CANCELLED, {"reason": "Cancelled"})]}


def test_queued_creates_racing_cancels_leave_no_job_and_one_cancel_each(deploy, sim_cluster):
    d = deploy(sim_cluster, capabilities=CAPABILITIES)
    d.start_worker("w1")
    ids = d.schedule_batch("sim.hang", 40)  # create_jobs sent on commit; the worker is creating them
    d.wait(lambda: d.jobs(), what="the first Jobs created")
    with transaction(d.sessions) as session:
        won = [cancel_in_session(session, dispatch_id, via=d.producer) for dispatch_id in ids]
    assert all(won)

    def settled() -> bool:
        return not d.redis.llen(f"{d.prefix}:{names.JOBS_QUEUE}") and not d.redis.hlen(f"{d.prefix}:unacked")

    d.wait(settled, what="every create_jobs and cancel message handled")
    d.wait_no_jobs()
    assert terminal_types(d, ids) == {i: [EventType.WORKER_CANCELLED] for i in ids}
    assert {state(d, i) for i in ids} == {DispatchState.CANCELLED}


def test_a_cancel_in_session_racing_completions_leaves_exactly_one_terminal_event(deploy, sim_cluster):
    d = deploy(sim_cluster, capabilities=CAPABILITIES)
    rt = Runtime.from_settings(d.settings)
    try:
        ids = d.schedule_batch("sim.ok", 30)
        create.create_jobs_for(rt, ids)
        d.wait(lambda: len([j for j in d.jobs() if job_state(j).terminal]) == len(ids), what="every Job finished")
        snapshots = {j["metadata"]["name"]: complete.job_snapshot(j) for j in d.jobs()}
        barrier = threading.Barrier(2)
        cancelled: dict[str, bool] = {}
        errors: list[BaseException] = []

        def complete_in_order() -> None:
            barrier.wait()
            try:  # in id order, one by one, while the cancels come the other way: they meet
                for dispatch_id in ids:
                    complete.complete_job(
                        rt, d.namespace, job_name(dispatch_id), snapshot=snapshots[job_name(dispatch_id)]
                    )
            except BaseException as e:
                errors.append(e)

        def cancel() -> None:
            barrier.wait()
            try:
                for dispatch_id in reversed(ids):
                    with transaction(d.sessions) as session:
                        cancelled[dispatch_id] = cancel_in_session(session, dispatch_id, via=d.producer)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=complete_in_order), threading.Thread(target=cancel)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        types = terminal_types(d, ids)
        for dispatch_id in ids:
            expected = EventType.WORKER_CANCELLED if cancelled[dispatch_id] else EventType.WORKER_COMPLETED
            assert types[dispatch_id] == [expected], dispatch_id
        print(f"cancelled {sum(cancelled.values())}, completed {len(ids) - sum(cancelled.values())}")
        run_sweep(rt)  # the cancels' messages have no worker: the sweep removes what is left
        d.wait_no_jobs()
    finally:
        rt.close()


def test_cancel_in_session_of_an_unknown_dispatch_writes_and_sends_nothing(deploy, sim_cluster):
    d = deploy(sim_cluster, capabilities=CAPABILITIES)
    with pytest.raises(UnknownDispatch), transaction(d.sessions) as session:
        cancel_in_session(session, str(uuid.uuid4()), via=d.producer)
    (dispatch_id,) = d.schedule_batch("sim.ok", 1)
    d.redis.delete(f"{d.prefix}:{names.JOBS_QUEUE}")
    with pytest.raises(RuntimeError), transaction(d.sessions) as session:
        cancel_in_session(session, dispatch_id, via=d.producer)
        raise RuntimeError("the engine's own step failed")
    assert queued(d) == [] and state(d, dispatch_id) is DispatchState.SCHEDULED


# --- schedule by task call ------------------------------------------------------------------


def test_send_schedule_until_recorded_re_sends_after_a_broker_flush(deploy, sim_cluster):
    d = deploy(sim_cluster, capabilities=CAPABILITIES)
    case_id, key = d.new_case(), f"key-{uuid.uuid4()}"
    found: dict[str, Any] = {}

    def send() -> None:
        try:
            found["id"] = send_schedule_until_recorded(
                d.sessions, case_id=case_id, tenancy_id="tenant-a", capability="sim.ok", input={"x": 1},
                idempotency_key=key, timeout_s=240, resend_s=2.0, via=d.producer,
            )  # fmt: skip
        except BaseException as e:
            found["error"] = e

    sender = threading.Thread(target=send)
    sender.start()
    d.wait(lambda: [t for t, _, _ in queued(d)] == [names.SCHEDULE_TASK], what="the first schedule message")
    assert flush_broker(d) > 0  # no worker yet: the first message is lost
    d.start_worker("w1", wait=False)
    d.start_beat()
    sender.join(timeout=WORKER_START_S + 60)
    assert not sender.is_alive() and "error" not in found, found
    row = d.dispatch_by_key("tenant-a", key)
    assert row is not None and found["id"] == row.dispatch_id  # one dispatch, however many sends
    events = d.wait_terminal([row.dispatch_id])
    assert events[row.dispatch_id] == [(EventType.WORKER_COMPLETED, {"output": {"simulated": True, "input": {"x": 1}}})]
    d.wait_no_jobs()


def test_send_schedule_until_recorded_raises_a_typed_error_at_its_deadline(deploy, sim_cluster):
    d = deploy(sim_cluster, capabilities=CAPABILITIES)  # no worker
    case_id, key = d.new_case(), f"key-{uuid.uuid4()}"
    with pytest.raises(ScheduleNotRecorded) as raised:
        send_schedule_until_recorded(
            d.sessions, case_id=case_id, tenancy_id="tenant-a", capability="sim.ok", input={},
            idempotency_key=key, timeout_s=2.0, resend_s=0.5, via=d.producer,
        )  # fmt: skip
    assert isinstance(raised.value, Transient) and raised.value.reason == "ScheduleNotRecorded"
    messages = queued(d)
    assert len(messages) >= 3  # sent again every 0.5 s
    assert {(t, json.dumps(kw, sort_keys=True)) for t, _, kw in messages} == {
        (names.SCHEDULE_TASK, json.dumps(dict(case_id=case_id, tenancy_id="tenant-a", capability="sim.ok", input={},
                                              idempotency_key=key, dispatch_id=None), sort_keys=True))
    }  # fmt: skip
    assert d.dispatch_by_key("tenant-a", key) is None
