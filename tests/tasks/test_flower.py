"""Flower, the real one (`celery -A k8s_dispatch.tasks flower`), against the test broker with a real worker:
through its HTTP API it lists the worker with our queues and the tasks a dispatch went through
(schedule, create_job, poll, complete_batch), each succeeded, as the worker's events told it.
"""

from __future__ import annotations

import ast
import base64
import json
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from k8s_dispatch import celeryconfig as names
from k8s_dispatch.ops import processes

AUTH = ("ops", "s3cret")


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
    d = deploy(sim_cluster)
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


def test_flower_sees_the_worker_and_the_tasks_of_a_dispatch(flower) -> None:
    d, port = flower
    d.start_worker("w1")
    d.start_beat()
    case_id = d.new_case()
    ids = [str(uuid.uuid4()) for _ in range(3)]
    for dispatch_id in ids:
        d.send(
            names.SCHEDULE_TASK,
            case_id,
            "tenant-a",
            "demo.wordcount",
            {"text": "a b"},
            f"k-{dispatch_id}",
            dispatch_id=dispatch_id,
        )
    d.wait_terminal(ids)

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

    def seen_tasks() -> dict[str, list[dict[str, Any]]] | None:
        tasks = api(port, "/api/tasks")
        by_name: dict[str, list[dict[str, Any]]] = {}
        for task in tasks.values():
            by_name.setdefault(task["name"], []).append(task)
        created = [t for t in by_name.get(names.CREATE_JOB_TASK, []) if t["state"] == "SUCCESS"]
        batches = [t for t in by_name.get(names.COMPLETE_BATCH_TASK, []) if t["state"] == "SUCCESS"]
        # Jobs the batches dealt with, whatever the outcome (a sweep may have delivered one first).
        completed = sum(sum(ast.literal_eval(t["result"]).values()) for t in batches)
        if all(any(i in t["args"] for t in created) for i in ids) and completed >= len(ids):
            return by_name
        return None

    by_name = processes.wait_until(seen_tasks, timeout=30, interval=0.5, what="the dispatches' tasks in /api/tasks")
    for task_name in (names.SCHEDULE_TASK, names.CREATE_JOB_TASK, names.COMPLETE_BATCH_TASK, names.POLL_TASK):
        assert by_name.get(task_name), f"{task_name} not seen by Flower"
    scheduled = [t for t in by_name[names.SCHEDULE_TASK] if t["state"] == "SUCCESS"]
    assert sorted(t["result"].strip("'\"") for t in scheduled) == sorted(ids)
    assert all(t["worker"].startswith("w1@") for t in scheduled)
