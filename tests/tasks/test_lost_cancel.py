"""A cancel whose follow-up message is lost, under a fair-share limit of 1 and the watch poll (a
real worker and beat on localcluster): the sweep's database side deletes the cancelled dispatch's
still-running Job within a few sweep intervals (not at the next LIST of the namespace, an hour
away here), and the tenancy's next dispatch is admitted only once that Job is gone. Sampled every
50 ms: never two Jobs of the tenancy in the cluster."""

from __future__ import annotations

import threading
import time
import uuid

from k8s_dispatch import celeryconfig as names
from k8s_dispatch.delivery import jobwatch
from k8s_dispatch.store import dispatches, scheduling
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import DispatchState, EventType
from k8s_dispatch.tasks.scheduling import schedule_many_in_session
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.resolver import CapabilityResolver

SIM = "localcluster.k8s-dispatch.io/"
CAPABILITIES = {"sim.long": {"worker": "sim", "image": "sim:1", "annotations": {SIM + "duration-ms": "600000"}}}
LIMITS = {"tenancies": {"solo": {"maxRunning": 1}}}
SWEEP_INTERVAL_S = 2.0


def test_a_lost_cancel_has_its_job_deleted_by_the_sweep_and_its_slot_held_until_then(deploy, sim_cluster) -> None:
    d = deploy(
        sim_cluster, capabilities=CAPABILITIES, limits=LIMITS, poll_interval_s="0.5",
        sweep_interval_s=str(SWEEP_INTERVAL_S), sweep_grace_s="1", sweep_list_interval_s="3600",
    )  # fmt: skip
    namespace = d.settings.namespace
    d.start_worker("w1")
    d.start_beat()
    case_id = d.new_case("solo")
    requests = [
        scheduling.ScheduleRequest(case_id, "solo", "sim.long", {"i": i}, f"k-{uuid.uuid4()}") for i in range(2)
    ]
    with transaction(d.sessions) as session:
        results = schedule_many_in_session(
            session, requests, router=CapabilityResolver.from_settings(d.settings),
            max_input_bytes=d.settings.max_input_bytes, via=d.producer,
        )  # fmt: skip
    ids = {r.dispatch_id for r in results}
    (running,) = d.wait(lambda: d.jobs(), what="the job of the dispatch admitted first")
    first = running["metadata"]["labels"][job_labels.DISPATCH_ID_KEY]
    (second,) = ids - {first}
    deployment = d.settings.effective_deployment
    key = jobwatch.key(d.prefix, deployment, namespace)
    # Poll follows the namespace by watch, and its Jobs were LISTed (the worker's start-up sweep):
    # the next LIST is an hour away, so only the sweep's database side can find the cancel.
    d.wait(lambda: jobwatch.is_healthy(d.redis, d.prefix, deployment, namespace), what="the watch healthy")
    d.wait(lambda: d.redis.exists(jobwatch.listed_key(key)), what="a LIST noted")

    samples: list[set[str]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.05):
            samples.append({j["metadata"]["labels"][job_labels.DISPATCH_ID_KEY] for j in d.jobs()})

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        # Seen running before the cancel: once the sweep deletes it, a prompt poll releases it at
        # once, and it may be gone before a sample taken after the cancel.
        d.wait(lambda: any(first in s for s in samples), timeout_s=30, what="the first job sampled running")
        # The engine cancels in its own transaction; the `cancel` message that would delete the
        # Job at once is lost (never sent).
        with transaction(d.sessions) as session:
            assert dispatches.record_terminal(session, first, EventType.WORKER_CANCELLED, {"reason": "Cancelled"})
        cancelled_at = time.monotonic()
        d.wait(lambda: all(first not in s for s in samples[-2:]) and len(samples) > 2, timeout_s=30,
               what="the cancelled dispatch's job deleted")  # fmt: skip
        deleted_after = time.monotonic() - cancelled_at
        d.wait(lambda: any(second in s for s in samples), timeout_s=30, what="the next dispatch admitted, its job made")
        time.sleep(1.0)  # a second more of samples with the second Job running
    finally:
        stop.set()
        sampler.join(timeout=10)

    assert deleted_after < 5 * SWEEP_INTERVAL_S, deleted_after
    assert max(len(s) for s in samples) == 1, [s for s in samples if len(s) > 1][:3]  # never two at once
    assert any(first in s for s in samples) and any(second in s for s in samples)  # both seen running
    with transaction(d.sessions) as session:
        rows = dispatches.get_dispatches(session, [first, second])
        assert rows[first].state == DispatchState.CANCELLED and rows[first].job_stopped_at is not None
        assert rows[second].state == DispatchState.CREATED
    assert d.terminal_events([first])[first] == [(EventType.WORKER_CANCELLED.value, {"reason": "Cancelled"})]
    d.send(names.CANCEL_TASK, second)  # the normal path, to leave nothing running
    d.wait_terminal([second], timeout_s=30)
    d.wait_no_jobs(timeout_s=30)


FAILING = {
    "sim.fail": {
        "worker": "sim", "image": "sim:1", "backoffLimit": 0,
        "annotations": {SIM + "duration-ms": "300", SIM + "outcome": "fail"},
    }
}  # fmt: skip


def test_a_failure_read_from_its_finished_job_frees_its_slot_at_once_not_a_sweep_later(deploy, sim_cluster) -> None:
    d = deploy(
        sim_cluster, capabilities=FAILING, limits=LIMITS, poll_interval_s="0.5", sweep_interval_s="600",
        sweep_grace_s="1",
    )  # fmt: skip
    d.start_worker("w1")
    d.start_beat()
    case_id = d.new_case("solo")
    requests = [
        scheduling.ScheduleRequest(case_id, "solo", "sim.fail", {"i": i}, f"k-{uuid.uuid4()}") for i in range(3)
    ]
    with transaction(d.sessions) as session:
        ids = [
            r.dispatch_id
            for r in schedule_many_in_session(
                session, requests, router=CapabilityResolver.from_settings(d.settings),
                max_input_bytes=d.settings.max_input_bytes, via=d.producer,
            )
        ]  # fmt: skip
    # One at a time, each admitted when the one before failed: its Job had finished, so the worker
    # that recorded the failure frees the slot (the sweep, ten minutes away, never comes).
    events = d.wait_terminal(ids, timeout_s=60)
    assert all(e[0][0] == EventType.WORKER_FAILED.value for e in events.values()), events

    def stopped() -> bool:
        with transaction(d.sessions) as session:
            rows = dispatches.get_dispatches(session, ids)
        return all(r.job_stopped_at is not None for r in rows.values())

    # The last failure's stop is recorded just after its end, in a transaction of its own (its
    # Job read in between): a poll, with a deadline far inside the ten-minute sweep.
    d.wait(stopped, timeout_s=15, what="every failed dispatch's Job recorded stopped")
    d.wait_no_jobs(timeout_s=30)


def test_a_cancel_sent_as_usual_frees_its_slot_once_its_job_is_gone_not_a_sweep_later(deploy, sim_cluster) -> None:
    d = deploy(
        sim_cluster, capabilities=CAPABILITIES, limits=LIMITS, poll_interval_s="0.5", sweep_interval_s="600",
        sweep_grace_s="1",
    )  # fmt: skip
    d.start_worker("w1")
    d.start_beat()
    case_id = d.new_case("solo")
    requests = [
        scheduling.ScheduleRequest(case_id, "solo", "sim.long", {"i": i}, f"k-{uuid.uuid4()}") for i in range(2)
    ]
    with transaction(d.sessions) as session:
        schedule_many_in_session(
            session, requests, router=CapabilityResolver.from_settings(d.settings),
            max_input_bytes=d.settings.max_input_bytes, via=d.producer,
        )  # fmt: skip
    (running,) = d.wait(lambda: d.jobs(), what="the job of the dispatch admitted first")
    first = running["metadata"]["labels"][job_labels.DISPATCH_ID_KEY]
    seen: list[set[str]] = []

    def next_one_alone() -> bool:
        seen.append({j["metadata"]["labels"][job_labels.DISPATCH_ID_KEY] for j in d.jobs()})
        return len(seen[-1]) == 1 and first not in seen[-1]

    d.send(names.CANCEL_TASK, first)  # the cancel task: records the end and deletes the Job
    d.wait(next_one_alone, timeout_s=30, what="the next dispatch's job, alone")  # the sweep is ten minutes away
    assert max(len(s) for s in seen) == 1, seen
    d.send(names.CANCEL_TASK, (seen[-1] - {first}).pop())
    d.wait_no_jobs(timeout_s=30)
