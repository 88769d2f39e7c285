"""Disruptions are not failures, and why a dispatch failed is kept: end to end with real Celery
workers and beat, PostgreSQL, Redis, on localcluster and on the real control plane (kube-apiserver's
Eviction API, the real Job controller applying the Job's podFailurePolicy, our node agent).

Two evictions then success end WORKER_COMPLETED after two WORKER_DISRUPTED events; evictions beyond
maxDisruptions end `Disrupted` with the Job deleted; an OOM kill ends `OOMKilled` with its exit
code, signal and log tail; an exit code in failOnExitCodes fails at once though backoffLimit
would retry, with the Job controller's Warning Event in the detail.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from typing import Any

from k8s_dispatch.store import dispatches
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import EventType
from k8s_dispatch.workers.manifest import job_name

SIM = "localcluster.k8s-dispatch.io/"
CAPABILITIES = {
    "sim.evicted": {
        "worker": "sim",
        "image": "sim:1",
        "backoffLimit": 0,  # an eviction counted as a failure would fail the dispatch at once
        "annotations": {SIM + "duration-ms": "600", SIM + "evict-attempts": "2", SIM + "evict-after-ms": "150"},
    },
    "sim.drained": {
        "worker": "sim",
        "image": "sim:1",
        "maxDisruptions": 1,
        "annotations": {SIM + "duration-ms": "600", SIM + "evict-attempts": "5", SIM + "evict-after-ms": "150"},
    },
    "sim.oom": {
        "worker": "sim",
        "image": "sim:1",
        "annotations": {
            SIM + "oom": "true",
            SIM + "duration-ms": "20",
            SIM + "log": "".join(f"step {i}\n" for i in range(500)) + "allocating the cache\n",
        },
    },
    "sim.fatal": {
        "worker": "sim",
        "image": "sim:1",
        "backoffLimit": 3,
        "failOnExitCodes": [3],
        "annotations": {
            SIM + "outcome": "fail",
            SIM + "exit-code": "3",
            SIM + "duration-ms": "20",
            # what a container writes is bytes: invalid UTF-8 and a NUL here
            SIM + "log-base64": base64.b64encode(b"bad input: \xff\xfe\x00 at line 1\n").decode(),
        },
    },
}


def _cli(d: Any, *args: str) -> subprocess.CompletedProcess[str]:
    """`k8s-dispatch ARGS` on the deployment's database, as an operator runs it; exit 0 or the test fails."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("K8S_DISPATCH_")}
    env["K8S_DISPATCH_DATABASE_URL"] = d.settings.database_url
    env["COLUMNS"] = "200"
    result = subprocess.run(
        [sys.executable, "-m", "k8s_dispatch.cli", *args], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result


def _story(d: Any, dispatch_id: str) -> list[tuple[str, dict[str, Any]]]:
    with transaction(d.sessions) as session:
        return [(e.type, e.payload) for e in dispatches.events_for(session, dispatch_id)]


def _types(story: list[tuple[str, dict[str, Any]]]) -> list[str]:
    return [t for t, _ in story]


def _run_one(deploy: Any, cluster: Any, capability: str, *, timeout_s: float) -> tuple[Any, str, str, dict[str, Any]]:
    """One dispatch of `capability` through a worker and beat on `cluster`: the deployment, the
    dispatch id and its one terminal event (type, payload); twice `timeout_s` on the real plane."""
    d = deploy(cluster, capabilities=CAPABILITIES)
    d.start_worker("w1")
    d.start_beat()
    (dispatch_id,) = d.schedule_batch(capability, 1)
    events = d.wait_terminal([dispatch_id], timeout_s=2 * timeout_s if cluster.is_real else timeout_s)
    ((kind, payload),) = events[dispatch_id]
    return d, dispatch_id, kind, payload


def test_two_evictions_then_success_complete_after_two_disruption_events(deploy, any_cluster):
    d = deploy(any_cluster, capabilities=CAPABILITIES)
    d.start_worker("w1")
    d.start_worker("w2")  # two replicas polling and completing: still one event per disrupted Pod
    d.start_beat()
    (dispatch_id,) = d.schedule_batch("sim.evicted", 1)
    d.wait_terminal([dispatch_id], timeout_s=90 if any_cluster.is_real else 40)
    story = _story(d, dispatch_id)
    assert _types(story) == [
        EventType.WORKER_SCHEDULED,
        EventType.WORKER_DISRUPTED,
        EventType.WORKER_DISRUPTED,
        EventType.WORKER_COMPLETED,
    ]
    disrupted = [p for t, p in story if t == EventType.WORKER_DISRUPTED]
    assert len({p["pod_uid"] for p in disrupted}) == 2
    for payload in disrupted:
        assert payload["reason"] == "EvictionByEvictionAPI"
        assert payload["node"]  # the node it ran on
        assert payload["pod"].startswith(job_name(dispatch_id) + "-")
    assert story[-1][1]["output"]["simulated"] is True
    d.wait_no_jobs()


def test_evictions_beyond_max_disruptions_fail_the_dispatch_as_disrupted(deploy, any_cluster):
    d, dispatch_id, kind, payload = _run_one(deploy, any_cluster, "sim.drained", timeout_s=40)
    assert (kind, payload["reason"]) == (EventType.WORKER_FAILED, "Disrupted")
    # Disruptions are found by beat's cleanup (every 5 polls): Pods evicted every ~150 ms may be
    # evicted again before it looks; each is recorded, and the count it failed at is the log's.
    times = payload["detail"]["disruptions"]
    assert times >= 2
    assert payload["message"] == f"disrupted {times} times, more than the capability's maxDisruptions of 1"
    assert payload["detail"]["last_disruption"]["reason"] == "EvictionByEvictionAPI"
    assert _types(_story(d, dispatch_id)).count(EventType.WORKER_DISRUPTED) == times
    d.wait_no_jobs()  # deleted, not left to be evicted for ever
    story = json.loads(_cli(d, "show", dispatch_id, "--json").stdout)
    assert [p["reason"] for p in story["disruptions"]] == ["EvictionByEvictionAPI"] * times
    assert "replaced" in _cli(d, "show", dispatch_id).stdout


def test_an_oom_kill_ends_oomkilled_with_exit_code_signal_and_log_tail(deploy, any_cluster):
    d, dispatch_id, kind, payload = _run_one(deploy, any_cluster, "sim.oom", timeout_s=30)
    assert (kind, payload["reason"]) == (EventType.WORKER_FAILED, "OOMKilled")
    detail = payload["detail"]
    assert (detail["exit_code"], detail["signal"], detail["container_reason"]) == (137, "SIGKILL", "OOMKilled")
    assert detail["job_reason"] == "BackoffLimitExceeded"
    assert detail["log_tail"].endswith("step 499\nallocating the cache\n")
    assert detail["log_tail"].startswith("step ") and len(detail["log_tail"].encode()) <= 2048
    assert detail["node"] and detail["pod"].startswith(job_name(dispatch_id) + "-")
    assert [(e["object"], e["reason"]) for e in detail["events"]] == [
        (f"Job/{job_name(dispatch_id)}", "BackoffLimitExceeded")
    ]
    d.wait_no_jobs()

    story = json.loads(_cli(d, "show", dispatch_id, "--json").stdout)
    assert (story["state"], story["reason"], story["attempts"]) == ("FAILED", "OOMKilled", 1)
    assert [e["type"] for e in story["events"]] == [EventType.WORKER_SCHEDULED, EventType.WORKER_FAILED]
    assert story["failure"]["log_tail"] == detail["log_tail"] and story["disruptions"] == []
    assert story["timings"]["total_s"] >= story["timings"]["ran_s"] > 0
    text = _cli(d, "show", dispatch_id).stdout
    for shown in ("OOMKilled", "exit code 137 (SIGKILL)", "allocating the cache", "BackoffLimitExceeded"):
        assert shown in text
    (failure,) = json.loads(_cli(d, "status", "--json").stdout)["recent_failures"]
    assert (failure["reason"], failure["exit_code"], failure["signal"], failure["container_reason"]) == (
        "OOMKilled", 137, "SIGKILL", "OOMKilled"
    )  # fmt: skip
    assert "container: OOMKilled exit code 137 (SIGKILL)" in _cli(d, "status").stdout


def test_an_exit_code_in_fail_on_exit_codes_fails_at_once(deploy, any_cluster):
    d, _, kind, payload = _run_one(deploy, any_cluster, "sim.fatal", timeout_s=30)
    assert (kind, payload["reason"]) == (EventType.WORKER_FAILED, "PodFailurePolicy")
    detail = payload["detail"]
    assert (detail["exit_code"], detail.get("signal")) == (3, None)
    assert "failed with exit code 3 matching FailJob rule at index 1" in detail["job_message"]
    assert detail["log_tail"] == "bad input: \ufffd\ufffd\x00 at line 1\n"
    assert [e["reason"] for e in detail["events"]] == ["PodFailurePolicy"]
    d.wait_no_jobs()
