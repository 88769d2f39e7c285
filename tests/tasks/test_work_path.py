"""The work path end to end with real `celery -A k8s_dispatch.tasks worker|beat` processes, PostgreSQL, Redis
and localcluster: schedule -> create_job -> poll -> complete, and cancel, each dispatch ending
in exactly one terminal event with the right output or reason, and nothing left in the cluster.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter

import pytest

from k8s_dispatch import celeryconfig as names
from k8s_dispatch.delivery.guard import Guard
from k8s_dispatch.demo import functions as demo_functions
from k8s_dispatch.demo.localcluster import LocalCluster
from k8s_dispatch.store import dispatches
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import EventType
from k8s_dispatch.tasks.scheduling import schedule_in_session
from k8s_dispatch.workers.job_status import job_state
from k8s_dispatch.workers.manifest import job_name
from k8s_dispatch.workers.resolver import DEMO_FUNCTIONS, CapabilityResolver

SIM = "localcluster.k8s-dispatch.io/"
DEMO = sorted(DEMO_FUNCTIONS)  # demo.primes, demo.sha256, demo.wordcount


def demo_input(capability: str, i: int) -> dict:
    return {"limit": 100 + i} if capability == "demo.primes" else {"text": f"dispatch {i}: " + "word " * (i % 7)}


def demo_output(capability: str, data: dict) -> dict:
    function = DEMO_FUNCTIONS[capability][1].split(":")[1]
    return getattr(demo_functions, function)(data)


def schedule_many(d, requests: list[tuple[str, dict]], *, by_task_every: int = 2) -> list[str]:
    """Schedule each (capability, input): every `by_task_every`-th by the Celery `schedule` task,
    the rest by `schedule_in_session` in the test's own transaction. Returns the dispatch ids."""
    case_id = d.new_case()
    resolver = CapabilityResolver.from_settings(d.settings)
    ids = []
    for i, (capability, data) in enumerate(requests):
        if i % by_task_every == 0:
            dispatch_id = str(uuid.uuid4())
            d.send(
                names.SCHEDULE_TASK,
                case_id,
                "tenant-a",
                capability,
                data,
                f"key-{dispatch_id}",
                dispatch_id=dispatch_id,
            )
        else:
            with transaction(d.sessions) as session:
                result = schedule_in_session(
                    session,
                    via=d.producer,
                    case_id=case_id,
                    tenancy_id="tenant-a",
                    capability=capability,
                    input=data,
                    idempotency_key=f"key-{uuid.uuid4()}",
                    router=resolver,
                    max_input_bytes=d.settings.max_input_bytes,
                )
            dispatch_id = result.dispatch_id
        ids.append(dispatch_id)
    return ids


def test_a_hundred_dispatches_across_three_capabilities_complete_once_each(deploy, any_cluster):
    d = deploy(any_cluster)
    d.start_worker("w1")
    d.start_beat()
    requests = [(DEMO[i % 3], demo_input(DEMO[i % 3], i)) for i in range(100)]

    started = time.monotonic()
    ids = schedule_many(d, requests)
    events = d.wait_terminal(ids, timeout_s=90)
    elapsed = time.monotonic() - started

    for dispatch_id, (_capability, data) in zip(ids, requests, strict=True):
        # Simulate mode echoes the input the Job carried: proof it went through the Job.
        assert events[dispatch_id] == [(EventType.WORKER_COMPLETED, {"output": {"simulated": True, "input": data}})]
    with transaction(d.sessions) as session:
        rows = dispatches.get_dispatches(session, ids)
    assert {rows[i].capability for i in ids} == set(DEMO)
    assert all(rows[i].notified_at is not None and rows[i].job_name == job_name(i) for i in ids)
    d.wait_no_jobs()
    assert Counter(d.wait_notified(ids)) == Counter(ids)  # each dispatch notified exactly once
    print(f"100 dispatches, simulate mode, one worker: {elapsed:.1f} s")


@pytest.fixture
def exec_cluster():
    with LocalCluster(mode="exec") as cluster:
        yield cluster


def test_exec_mode_runs_the_demo_capabilities_for_real(exec_cluster, deploy):
    d = deploy(exec_cluster)  # no capabilities file: the demo capabilities, run by k8s_dispatch.container.runner
    d.start_worker("w1")
    d.start_beat()
    requests = [(c, demo_input(c, i)) for i, c in enumerate(DEMO * 2)]
    ids = schedule_many(d, requests)
    events = d.wait_terminal(ids, timeout_s=90)
    for dispatch_id, (capability, data) in zip(ids, requests, strict=True):
        assert events[dispatch_id] == [(EventType.WORKER_COMPLETED, {"output": demo_output(capability, data)})]
    d.wait_no_jobs()


FAILING = {
    "sim.fail": {"worker": "sim", "image": "sim:1", "annotations": {SIM + "outcome": "fail", SIM + "exit-code": "2"}},
    "sim.slow": {
        "worker": "sim",
        "image": "sim:1",
        "annotations": {SIM + "outcome": "hang"},
        "activeDeadlineSeconds": 1,
    },
    "sim.hang": {"worker": "sim", "image": "sim:1", "annotations": {SIM + "outcome": "hang"}},
    "sim.notjson": {"worker": "sim", "image": "sim:1", "annotations": {SIM + "result": "<html>oops</html>"}},
}


def test_failure_timeout_bad_result_and_cancel_each_give_their_event_and_reason(deploy, any_cluster):
    d = deploy(any_cluster, capabilities=FAILING)
    d.start_worker("w1")
    d.start_beat()
    fail_id, slow_id, hang_id, notjson_id = schedule_many(
        d, [(c, {"c": c}) for c in ("sim.fail", "sim.slow", "sim.hang", "sim.notjson")]
    )
    # Cancel the one that would run for ever, once its Job exists.
    d.wait(lambda: any(j["metadata"]["name"] == job_name(hang_id) for j in d.jobs()), what="hang job created")
    d.send(names.CANCEL_TASK, hang_id, reason="UserCancelled")

    events = d.wait_terminal([fail_id, slow_id, hang_id, notjson_id])
    [(fail_type, fail_payload)] = events[fail_id]
    assert (fail_type, fail_payload["reason"]) == (EventType.WORKER_FAILED, "BackoffLimitExceeded")
    [(slow_type, slow_payload)] = events[slow_id]
    assert (slow_type, slow_payload["reason"]) == (EventType.WORKER_FAILED, "DeadlineExceeded")
    assert events[hang_id] == [(EventType.WORKER_CANCELLED, {"reason": "UserCancelled"})]
    [(bad_type, bad_payload)] = events[notjson_id]
    assert (bad_type, bad_payload["reason"]) == (EventType.WORKER_FAILED, "ResultNotJson")
    assert "<html>oops</html>" in bad_payload["message"]
    d.wait_no_jobs()
    ended = [fail_id, slow_id, hang_id, notjson_id]
    assert Counter(d.wait_notified(ended)) == Counter(ended)


def test_two_worker_processes_polling_at_once_deliver_each_dispatch_once(deploy, any_cluster):
    d = deploy(any_cluster)
    d.start_worker("w1")
    d.start_worker("w2")
    ids = schedule_many(d, [(DEMO[i % 3], {"text": str(i), "limit": i}) for i in range(60)])
    # Every Job finishes before anyone polls: then both replicas' beats start at once and, on
    # top, each Job is handed to `complete` twice more, as duplicate messages would.
    d.wait(
        lambda: len(d.jobs()) == 60 and all(job_state(j).terminal for j in d.jobs()),
        what="60 finished jobs",
    )
    d.start_beat("beat1")
    d.start_beat("beat2")
    for dispatch_id in ids:
        d.send(names.COMPLETE_TASK, d.namespace, job_name(dispatch_id))
        d.send(names.COMPLETE_TASK, d.namespace, job_name(dispatch_id))

    events = d.wait_terminal(ids)
    assert all(len(events[i]) == 1 and events[i][0][0] == EventType.WORKER_COMPLETED for i in ids)
    d.wait_no_jobs()
    d.wait(lambda: len(d.notifications()) >= len(ids), what="notifications")
    assert Counter(d.notifications()) == Counter(ids)
    # Both processes did work, and the guard turned some duplicates away.
    logs = {p.log_path.name: p.log() for p in d.procs}
    assert "k8s-dispatch.complete" in logs["w1.log"] and "k8s-dispatch.complete" in logs["w2.log"]
    guard = Guard(d.redis, prefix=d.prefix, lease_ms=1)
    print(f"duplicates prevented by the guard: {guard.duplicates_prevented()}")


def test_bad_requests_to_the_schedule_task_write_nothing(deploy, any_cluster):
    d = deploy(any_cluster)
    worker = d.start_worker("w1")
    case_id = d.new_case()
    bad = {
        "UnknownCapability": ("no.such.capability", {"a": 1}),
        "InputTooLarge": ("demo.wordcount", {"text": "x" * (d.settings.max_input_bytes + 1)}),
    }
    for reason, (capability, data) in bad.items():
        d.send(names.SCHEDULE_TASK, case_id, "tenant-a", capability, data, f"bad-{reason}")
    d.send(names.SCHEDULE_TASK, "has\ttab", "tenant-a", "demo.wordcount", {}, "bad-InvalidId")
    d.send(names.SCHEDULE_TASK, case_id, "tenant-b", "demo.wordcount", {}, "bad-TenancyMismatch")
    for reason in [*bad, "InvalidId", "TenancyMismatch"]:
        d.wait(lambda reason=reason: reason in worker.log(), what=f"{reason} logged")
    for reason in [*bad, "InvalidId", "TenancyMismatch"]:
        assert d.dispatch_by_key("tenant-a", f"bad-{reason}") is None
        assert d.dispatch_by_key("tenant-b", f"bad-{reason}") is None
    # Permanent errors are not retried.
    assert "Retry in" not in worker.log()


def test_a_worker_with_a_broken_capability_file_stops_at_start_naming_the_problem(deploy, any_cluster):
    d = deploy(
        any_cluster,
        capabilities={"demo.good": {"worker": "w", "image": "x"}, "demo.bad": {"worker": "Not A Label", "image": "x"}},
    )
    proc = d.start_worker("w-broken", wait=False)
    code = proc.popen.wait(timeout=30)
    d.procs.remove(proc)
    proc.stop()
    output = proc.log()
    assert code == 3
    assert d.settings.capabilities.name in output
    assert "capability 'demo.bad': field 'worker'" in output and "demo.good" not in output
    assert " ready." not in output


def test_a_forged_job_is_polled_but_never_delivered(deploy, any_cluster):
    d = deploy(any_cluster)
    d.start_worker("w1")
    d.start_beat()
    [dispatch_id] = schedule_many(d, [("demo.wordcount", {"text": "mine"})], by_task_every=99)
    events = d.wait_terminal([dispatch_id])
    assert events[dispatch_id][0][0] == EventType.WORKER_COMPLETED
    d.wait_no_jobs()  # its Job released, then deleted by beat's next cleanup
    # A Job with our labels for a dispatch that does not exist.
    from k8s_dispatch.workers import labels as job_labels
    from k8s_dispatch.workers.types import DispatchRef

    forged_id = str(uuid.uuid4())
    labels, annotations = job_labels.encode(
        DispatchRef(forged_id, "case-x", "tenant-a", "demo.wordcount", "demo-text", "k"),  # type: ignore[arg-type]
        deployment=d.settings.effective_deployment,
    )
    d.kube.create_job(
        d.namespace,
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": job_name(forged_id), "labels": labels, "annotations": annotations},
            "spec": {
                "backoffLimit": 0,
                "template": {
                    "metadata": {"annotations": {SIM + "duration-ms": "10"}},
                    "spec": {"restartPolicy": "Never", "containers": [{"name": "worker", "image": "x"}]},
                },
            },
        },
    )
    d.wait(lambda: int(d.redis.get(f"{d.prefix}:stats:jobs_refused") or 0) >= 1, what="forged job refused")
    with transaction(d.sessions) as session:
        assert dispatches.events_for(session, forged_id) == []
    assert [j["metadata"]["name"] for j in d.jobs()] == [job_name(forged_id)]  # left alone
    assert d.wait_notified([dispatch_id]) == [dispatch_id]


@pytest.mark.parametrize("cli_args, reason", [
    (["--capability", "no.such"], "UnknownCapability"),
    (["--capability", "demo.wordcount", "--input", '{"text": "' + "x" * 40_000 + '"}'], "InputTooLarge"),
    (["--capability", "demo.wordcount", "--dispatch-id", "not-a-uuid"], "InvalidId"),
])  # fmt: skip
def test_the_cli_schedule_refuses_bad_input_with_its_typed_error(deploy, any_cluster, cli_args, reason):
    import subprocess
    import sys

    d = deploy(any_cluster)
    key = f"cli-{uuid.uuid4()}"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "k8s_dispatch.cli",
            "schedule",
            "--case",
            "c-cli",
            "--tenancy",
            "tenant-a",
            "--create-case",
            "--idempotency-key",
            key,
            *cli_args,
        ],
        env=d.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 3, result.stderr
    assert reason in result.stderr
    assert d.dispatch_by_key("tenant-a", key) is None


def test_the_cli_schedules_and_cancels(deploy, any_cluster):
    import json
    import subprocess
    import sys

    d = deploy(any_cluster, capabilities=FAILING)
    d.start_worker("w1")

    def cli(*args: str) -> dict:
        result = subprocess.run(
            [sys.executable, "-m", "k8s_dispatch.cli", *args, "--json"],
            env=d.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    scheduled = cli("schedule", "--case", "c-cli-2", "--tenancy", "tenant-a", "--create-case", "--capability", "sim.hang",
                    "--input", '{"x": 1}', "--idempotency-key", f"cli-{uuid.uuid4()}")  # fmt: skip
    assert scheduled["created"] is True and scheduled["state"] == "SCHEDULED"
    dispatch_id = scheduled["dispatch_id"]
    d.wait(lambda: d.jobs(), what="job created by the worker")
    assert cli("cancel", dispatch_id, "--reason", "NotNeeded") == {
        "dispatch_id": dispatch_id,
        "cancelled": True,
        "state": "CANCELLED",
    }
    assert cli("cancel", dispatch_id) == {"dispatch_id": dispatch_id, "cancelled": False, "state": "CANCELLED"}
    assert d.terminal_events([dispatch_id])[dispatch_id] == [(EventType.WORKER_CANCELLED, {"reason": "NotNeeded"})]
    d.wait_no_jobs()
    assert d.wait_notified([dispatch_id]) == [dispatch_id]
