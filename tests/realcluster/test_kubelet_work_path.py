"""The work path on a real node, end to end with real `celery worker|beat` processes, PostgreSQL and
Redis: the kubelet writes the termination message a result is read from, the kernel's OOM killer
ends a container over its memory limit, containerd fails to pull an image that is not on the node
(from a closed loopback port: nothing leaves the machine), and kube-scheduler refuses a request no
node can hold. Each dispatch ends in exactly one terminal event with the cause the node gave.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from k8s_dispatch.engine.models import EventType
from k8s_dispatch.workers.manifest import job_name
from tests.tasks.test_never_started import SLACK_S, SWEEP_S, assert_nothing_left, ended

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((ROOT / "deploy" / "capabilities.example.yaml").read_text())["capabilities"]
RESULT_BYTES = 4096  # the kubelet's cap on a termination message, and ours on a result


def busybox(script: str, **fields: Any) -> dict[str, Any]:
    """A capability running `script` in busybox:1.36 as the example's echo does (non-root, no retry)."""
    return {
        "worker": "shell", "image": "busybox:1.36", "command": ["sh", "-c"], "args": [script],
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "32Mi"}},
        "activeDeadlineSeconds": 60, "runAsUser": 65534, "runAsGroup": 65534, "backoffLimit": 0, **fields,
    }  # fmt: skip


def started(deploy_: Any, cluster: Any, capabilities: dict[str, Any]) -> Any:
    d = deploy_(cluster, capabilities=capabilities, sweep_interval_s=str(SWEEP_S), sweep_grace_s="1")
    d.start_worker("w1")
    d.start_beat()
    return d


def test_the_example_echo_and_a_4096_byte_result_come_back_byte_for_byte_from_the_kubelet(deploy, kubelet_cluster):
    pad = RESULT_BYTES - len('{"x":""}')
    capabilities = {
        "echo": EXAMPLE["echo"],  # deploy/capabilities.example.yaml's, unchanged
        "full": busybox(f"""printf '{{"x":"%s"}}' "$(head -c {pad} /dev/zero | tr '\\0' a)" > /dev/termination-log"""),
    }
    d = started(deploy, kubelet_cluster, capabilities)
    [echo_id] = d.schedule_batch("echo", 1)
    [full_id] = d.schedule_batch("full", 1)
    events = d.wait_terminal([echo_id, full_id], timeout_s=120)
    assert events[echo_id] == [(EventType.WORKER_COMPLETED, {"output": {"echo": {"i": 0}}})]
    assert events[full_id] == [(EventType.WORKER_COMPLETED, {"output": {"x": "a" * pad}})]
    d.wait_no_jobs()
    assert sorted(d.notifications()) == sorted([echo_id, full_id])


def test_a_container_over_its_memory_limit_is_oom_killed_by_the_kernel(deploy, kubelet_cluster):
    # dd's one 64 MiB buffer cannot fit under a 32 MiB limit: the kernel kills it, not an annotation
    d = started(
        deploy, kubelet_cluster, {"oom": busybox("echo allocating; dd if=/dev/zero of=/dev/null bs=64M count=1")}
    )
    [dispatch_id] = d.schedule_batch("oom", 1)
    payload, _ = ended(d, dispatch_id, timeout_s=120)
    assert payload["reason"] == "OOMKilled", payload
    detail = payload["detail"]
    assert (detail["exit_code"], detail["signal"], detail["container_reason"]) == (137, "SIGKILL", "OOMKilled")
    assert detail["log_tail"] == "allocating\n"  # the kubelet's pods/log, read through kube-apiserver
    assert detail["pod"].startswith(job_name(dispatch_id) + "-")
    assert_nothing_left(d)


def test_an_image_not_on_the_node_fails_to_pull_from_nowhere_within_its_timeout(deploy, kubelet_cluster):
    pull_s = 4
    capabilities = {"pull": busybox("true", image="k8s-dispatch.invalid/missing:1", imagePullTimeoutSeconds=pull_s)}
    d = started(deploy, kubelet_cluster, capabilities)
    [dispatch_id] = d.schedule_batch("pull", 1)
    payload, took = ended(d, dispatch_id, timeout_s=pull_s + SWEEP_S + SLACK_S + 60)
    assert payload["reason"] in ("ErrImagePull", "ImagePullBackOff"), payload
    message = payload["message"]
    if payload["reason"] == "ImagePullBackOff":
        assert message == 'Back-off pulling image "k8s-dispatch.invalid/missing:1"', message
    else:  # containerd's own words: every registry is our closed loopback port
        assert "127.0.0.1" in message and "connection refused" in message, message
    assert "exit_code" not in payload["detail"]
    assert took.total_seconds() >= pull_s
    assert_nothing_left(d)


def test_a_request_no_node_can_hold_ends_unschedulable_with_the_schedulers_message(deploy, kubelet_cluster):
    start_s = 8
    capabilities = {"nofit": busybox("true", resources={"requests": {"cpu": "64"}}, startTimeoutSeconds=start_s)}
    d = started(deploy, kubelet_cluster, capabilities)
    [dispatch_id] = d.schedule_batch("nofit", 1)
    payload, took = ended(d, dispatch_id, timeout_s=start_s + SWEEP_S + SLACK_S + 30)
    assert payload["reason"] == "Unschedulable", payload
    assert payload["message"].startswith("0/1 nodes are available: 1 Insufficient cpu."), payload["message"]
    assert start_s <= took.total_seconds() <= start_s + SWEEP_S + SLACK_S, took
    assert_nothing_left(d)
