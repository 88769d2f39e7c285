"""Flower, the real one (`k8s-dispatch flower`), against the test broker with a real worker:
through its HTTP API it lists the worker with our queues and the tasks the dispatches went
through (schedule, create_job, complete_batch) as the worker's events told it; housekeeping
(poll, admit, cleanup, sweeps) not at all; a search for a dispatch id finds the batch that
recorded it; and a failed dispatch is a failed task (`tasks.task_events`).
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest

from k8s_dispatch import celeryconfig as names
from k8s_dispatch.ops import processes

AUTH = ("ops", "s3cret")
SIM = "localcluster.k8s-dispatch.io/"
CAPABILITIES = {
    "sim.ok": {"worker": "sim", "image": "sim:1", "annotations": {SIM + "duration-ms": "20"}},
    "sim.fail": {
        "worker": "sim",
        "image": "sim:1",
        "backoffLimit": 0,
        "annotations": {SIM + "duration-ms": "20", SIM + "outcome": "fail", SIM + "exit-code": "3"},
    },
}


def api(port: int, path: str, *, auth: tuple[str, str] | None = AUTH) -> Any:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if auth is not None:
        token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthcheck", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.fixture
def flower(deploy, sim_cluster, tmp_path) -> Iterator[tuple[Any, int]]:
    d = deploy(sim_cluster, capabilities=CAPABILITIES)
    port = processes.free_port()
    process = processes.celery_flower(
        env=d.env, log_dir=tmp_path, port=port, extra=(f"--basic-auth={AUTH[0]}:{AUTH[1]}",)
    )
    process.start()
    try:
        processes.wait_until(lambda: (process.alive and answers(port)) or _exited(process), timeout=60, what="Flower")
        yield d, port
    finally:
        process.stop(timeout=15)
        print(process.log_tail(20))


def _exited(process: processes.ManagedProcess) -> bool:
    if not process.alive:
        raise AssertionError(f"Flower exited ({process.returncode}):\n{process.log_tail()}")
    return False


def schedule(d: Any, case_id: str, capability: str) -> str:
    dispatch_id = str(uuid.uuid4())
    d.send(names.SCHEDULE_TASK, case_id, "tenant-a", capability, {"n": 1}, f"k-{dispatch_id}", dispatch_id=dispatch_id)
    return dispatch_id


def test_flower_shows_the_work_findable_by_dispatch_and_a_failure_as_a_failure(flower) -> None:
    d, port = flower
    d.start_worker("w1")
    d.start_beat()
    case_id = d.new_case()
    ok = [schedule(d, case_id, "sim.ok") for _ in range(2)]
    failed = schedule(d, case_id, "sim.fail")
    ended = d.wait_terminal([*ok, failed])
    [(event, payload)] = ended[failed]
    assert event == "WORKER_FAILED", payload

    # The API is not open to anyone: without credentials it refuses.
    with pytest.raises(urllib.error.HTTPError) as refused:
        api(port, "/api/workers", auth=None)
    assert refused.value.code == 401
    refused.value.close()

    def our_worker() -> dict[str, Any] | None:
        workers = api(port, "/api/workers?refresh=1")
        return next((info for name, info in workers.items() if name.startswith("w1@")), None)

    worker = processes.wait_until(our_worker, timeout=30, interval=0.5, what="w1 in Flower's /api/workers")
    queues = {q["name"] for q in worker["active_queues"]}
    assert {names.JOBS_QUEUE, names.COMPLETE_QUEUE, names.SWEEP_QUEUE} <= queues
    assert worker["stats"]["pool"]["max-concurrency"] == d.settings.worker_concurrency

    # A failed dispatch is a failed task, naming the dispatch and its reason.
    def echoes() -> list[dict[str, Any]] | None:
        tasks = api(port, f"/api/tasks?state=FAILURE&taskname={names.DISPATCH_FAILED_TASK}").values()
        return [t for t in tasks if failed in t["kwargs"]] or None

    [echo] = processes.wait_until(echoes, timeout=30, interval=0.5, what="the failed dispatch as a FAILURE")
    assert echo["worker"].startswith("w1@") and f"dispatch {failed} failed: {payload['reason']}" in echo["exception"]

    # Each dispatch id finds the batch that recorded it.
    def batches_of(dispatch_id: str) -> list[dict[str, Any]] | None:
        found = api(port, f"/api/tasks?search={dispatch_id}").values()
        return [t for t in found if t["name"] == names.COMPLETE_BATCH_TASK and t["state"] == "SUCCESS"] or None

    for dispatch_id in [*ok, failed]:
        [batch, *_] = processes.wait_until(
            partial(batches_of, dispatch_id), timeout=30, interval=0.5, what=f"complete_batch of {dispatch_id}"
        )
        assert dispatch_id in batch["args"] and batch["worker"].startswith("w1@")

    # The work is listed; housekeeping is not, though it ran every 0.2 s all along (poll found the Jobs).
    tasks = api(port, "/api/tasks").values()
    seen = {t["name"] for t in tasks}
    assert {names.SCHEDULE_TASK, names.CREATE_JOB_TASK, names.COMPLETE_BATCH_TASK} <= seen, seen
    assert not seen & names.HOUSEKEEPING_TASKS, seen
    scheduled = [t for t in tasks if t["name"] == names.SCHEDULE_TASK and t["state"] == "SUCCESS"]
    assert sorted(t["result"].strip("'\"") for t in scheduled) == sorted([*ok, failed])
    assert all(t["worker"].startswith("w1@") for t in scheduled)
