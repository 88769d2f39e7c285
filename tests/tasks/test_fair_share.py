"""Fair share end to end: two tenancies under limits (3 and 10, weights 1 and 2, sharing a
capability limited to 6), 200 dispatches each, three real workers and beat on localcluster.
Sampled every 100 ms: the cluster's running Jobs of each tenancy (by label) and the database's
slots; never above a limit, the contended slots split by the weights, all 400 complete once,
and no slot is left held or queued."""

from __future__ import annotations

import signal
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import sqlalchemy as sa

from k8s_dispatch.delivery.crashpoints import ENV_VAR as CRASH_AT
from k8s_dispatch.delivery.crashpoints import Point
from k8s_dispatch.store import dispatches, scheduling
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import HOLDING_STATES, Dispatch, DispatchState
from k8s_dispatch.tasks.scheduling import schedule_many_in_session
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.job_status import job_state
from k8s_dispatch.workers.resolver import CapabilityResolver
from tests.tasks.conftest import wait_until

SIM = "localcluster.k8s-dispatch.io/"
CAPABILITIES = {"sim.ok": {"worker": "sim", "image": "sim:1", "annotations": {SIM + "duration-ms": "300"}}}
LIMITS = {
    "tenancies": {"small": {"maxRunning": 3, "weight": 1}, "big": {"maxRunning": 10, "weight": 2}},
    "capabilities": {"sim.ok": {"maxRunning": 6}},
}
PER_TENANCY = 200


@dataclass
class Samples:
    cluster: list[Counter[str]] = field(default_factory=list)  # running Jobs by tenancy
    holding: list[Counter[str]] = field(default_factory=list)  # the database's slots by tenancy
    queued: list[Counter[str]] = field(default_factory=list)


def sample(d, stop: threading.Event, out: Samples) -> None:
    while not stop.wait(0.1):
        running = Counter(
            (j["metadata"].get("labels") or {}).get(job_labels.TENANCY_ID_KEY, "?")
            for j in d.jobs()
            if not job_state(j).terminal
        )
        with transaction(d.sessions) as session:
            rows = session.execute(
                sa.select(Dispatch.tenancy_id, Dispatch.state, sa.func.count())
                .where(Dispatch.state.in_(sorted({*HOLDING_STATES, DispatchState.QUEUED})))
                .group_by(Dispatch.tenancy_id, Dispatch.state)
            ).all()
        holding: Counter[str] = Counter()
        queued: Counter[str] = Counter()
        for tenancy, state, n in rows:
            (queued if state == DispatchState.QUEUED else holding)[tenancy] += n
        out.cluster.append(running)
        out.holding.append(holding)
        out.queued.append(queued)


def schedule(d, tenancy: str, router: CapabilityResolver, *, count: int = PER_TENANCY) -> list[str]:
    case_id = d.new_case(tenancy)
    requests = [
        scheduling.ScheduleRequest(case_id, tenancy, "sim.ok", {"i": i}, f"key-{uuid.uuid4()}") for i in range(count)
    ]
    with transaction(d.sessions) as session:
        results = schedule_many_in_session(
            session, requests, router=router, max_input_bytes=d.settings.max_input_bytes, via=d.producer
        )
    assert {r.state for r in results} == {DispatchState.QUEUED}
    return [r.dispatch_id for r in results]


def test_two_tenancies_never_exceed_their_limits_share_by_weight_and_all_complete(deploy, sim_cluster) -> None:
    d = deploy(sim_cluster, capabilities=CAPABILITIES, limits=LIMITS)
    router = CapabilityResolver.from_settings(d.settings)
    small, big = schedule(d, "small", router), schedule(d, "big", router)
    samples, stop = Samples(), threading.Event()
    sampler = threading.Thread(target=sample, args=(d, stop, samples), daemon=True)
    sampler.start()
    started = time.monotonic()
    for name in ("w1", "w2", "w3"):
        d.start_worker(name)
    d.start_beat()
    try:
        events = d.wait_terminal(small + big, timeout_s=300.0)
    finally:
        stop.set()
        sampler.join(timeout=10)
    took = time.monotonic() - started

    assert all(len(e) == 1 and e[0][0] == "WORKER_COMPLETED" for e in events.values()), "each completes once"
    for series, what in ((samples.cluster, "running Jobs"), (samples.holding, "database slots")):
        assert max(s["small"] for s in series) <= 3, what
        assert max(s["big"] for s in series) <= 10, what
        assert max(s["small"] + s["big"] for s in series) <= 6, what
    assert max(s["small"] for s in samples.holding) == 3  # its own limit was reached once big drained
    # While both wait, the 6 shared slots split 1:2 (2 and 4): the database's exactly, the cluster's
    # running Jobs lag admission by a create and a Pod start.
    both = [i for i, q in enumerate(samples.queued) if q["small"] and q["big"]]
    assert len(both) >= 20, f"only {len(both)} samples of contention in {took:.0f}s"
    contended = [samples.holding[i] for i in both if sum(samples.holding[i].values()) == 6]
    assert len(contended) >= len(both) // 2
    assert Counter((h["small"], h["big"]) for h in contended).most_common(1)[0][0] == (2, 4)
    ratio = sum(samples.cluster[i]["big"] for i in both) / max(1, sum(samples.cluster[i]["small"] for i in both))
    assert 1.4 <= ratio <= 2.8, ratio
    with transaction(d.sessions) as session:
        left = session.scalar(
            sa.select(sa.func.count()).where(Dispatch.state.in_(sorted({*HOLDING_STATES, DispatchState.QUEUED})))
        )
    assert left == 0  # no slot leaked, nothing queued


def test_a_worker_killed_between_admission_and_create_neither_leaks_nor_doubles_a_slot(deploy, sim_cluster) -> None:
    d = deploy(
        sim_cluster, capabilities=CAPABILITIES, limits={"tenancies": {"small": {"maxRunning": 2}}},
        sweep_interval_s="1", sweep_grace_s="1",
    )  # fmt: skip
    doomed = d.start_worker("doomed", env={CRASH_AT: Point.AFTER_ADMIT_COMMIT.value})
    router = CapabilityResolver.from_settings(d.settings)
    ids = schedule(d, "small", router, count=6)
    wait_until(
        lambda: not doomed.managed.alive, timeout_s=60, what="the worker to die at its crash point", on_fail=doomed.tail
    )
    assert doomed.managed.returncode == -signal.SIGKILL
    d.procs.remove(doomed)
    with transaction(d.sessions) as session:
        rows = dispatches.get_dispatches(session, ids)
    assert sorted(str(DispatchState(r.state)) for r in rows.values()) == ["QUEUED"] * 4 + ["SCHEDULED"] * 2
    assert d.jobs() == []  # admitted, slots held, no Job: what the sweep repairs

    samples, stop = Samples(), threading.Event()
    sampler = threading.Thread(target=sample, args=(d, stop, samples), daemon=True)
    sampler.start()
    d.start_worker("w1")
    d.start_beat()
    try:
        events = d.wait_terminal(ids, timeout_s=120.0)
    finally:
        stop.set()
        sampler.join(timeout=10)
    assert all(len(e) == 1 and e[0][0] == "WORKER_COMPLETED" for e in events.values())
    assert max(s["small"] for s in samples.holding) <= 2 and max(s["small"] for s in samples.cluster) <= 2
    d.wait_no_jobs()
