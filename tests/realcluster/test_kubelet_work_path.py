"""The work path on a real node, end to end with real `celery worker|beat` processes, PostgreSQL and
Redis: the kubelet writes the termination message a result is read from (4,096 bytes come back
byte for byte), the kernel's OOM killer ends a container over its memory limit, containerd fails
to pull an image that is not on the node (from a closed loopback port: nothing leaves the machine)
and refuses a name that is no reference, kube-scheduler refuses a request no node can hold, the
kubelet kills a real `sleep` at `activeDeadlineSeconds` and on a cancel, serves the log tail of a container
that failed, and `kubectl drain` (the Eviction API) disrupts a running dispatch that completes once
after `kubectl uncordon`. Each dispatch ends in exactly one terminal event with the node's cause.
The same path runs as deploy/rbac.yaml's ServiceAccount, every request decided by the real authorizer.
"""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path
from typing import Any

import yaml

from k8s_dispatch import celeryconfig as names
from k8s_dispatch.lab.realcluster.controlplane import NODE_NAME
from k8s_dispatch.store import dispatches
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import EventType
from k8s_dispatch.workers import labels as job_labels
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


def assert_no_pod_left(d: Any) -> None:
    """No Job of ours and no Pod of ours at all: deleting a Job removes its Pods (a Pod orphaned by a
    delete whose propagationPolicy kube-apiserver ignored would stay on the node for ever)."""
    assert_nothing_left(d)
    d.wait(
        lambda: not d.kube.list_pods(d.namespace, label_selector=job_labels.selector()),
        timeout_s=60,
        what="no Pod of ours left",
    )


def started(deploy_: Any, cluster: Any, capabilities: dict[str, Any]) -> Any:
    d = deploy_(cluster, capabilities=capabilities, sweep_interval_s=str(SWEEP_S), sweep_grace_s="1")
    d.start_worker("w1")
    d.start_beat()
    return d


def _writes_x(pad: int) -> dict[str, Any]:
    """A capability whose result is {"x": "aaa..."} with `pad` a's: 8 + `pad` bytes of JSON."""
    return busybox(f"""printf '{{"x":"%s"}}' "$(head -c {pad} /dev/zero | tr '\\0' a)" > /dev/termination-log""")


def test_the_example_echo_and_a_4096_byte_result_come_back_byte_for_byte_from_the_kubelet(deploy, kubelet_cluster):
    pad = RESULT_BYTES - len('{"x":""}')
    capabilities = {
        "echo": EXAMPLE["echo"],  # deploy/capabilities.example.yaml's, unchanged
        "full": _writes_x(pad),
        "over": _writes_x(pad + 1),  # one byte more than a termination message holds
    }
    d = started(deploy, kubelet_cluster, capabilities)
    [echo_id] = d.schedule_batch("echo", 1)
    [full_id] = d.schedule_batch("full", 1)
    [over_id] = d.schedule_batch("over", 1)
    events = d.wait_terminal([echo_id, full_id, over_id], timeout_s=120)
    assert events[echo_id] == [(EventType.WORKER_COMPLETED, {"output": {"echo": {"i": 0}}})]
    assert events[full_id] == [(EventType.WORKER_COMPLETED, {"output": {"x": "a" * pad}})]
    # The kubelet keeps the message's LAST 4,096 bytes: what is left is no result, never a wrong one.
    [(event, payload)] = events[over_id]
    assert (event, payload["reason"]) == (EventType.WORKER_FAILED, "ResultNotJson"), payload
    # one byte over: the kubelet cut the first, the '{'
    assert """the message begins '"x":"aaaa""" in payload["message"], payload["message"]
    assert "where the kubelet cuts a longer one" in payload["message"], payload["message"]  # and says why
    assert_no_pod_left(d)
    assert sorted(d.notifications()) == sorted([echo_id, full_id, over_id])


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
    assert_no_pod_left(d)


def test_an_image_not_on_the_node_fails_to_pull_from_nowhere_within_its_timeout(deploy, kubelet_cluster):
    pull_s = 4
    capabilities = {"pull": busybox("true", image="k8s-dispatch.invalid/missing:1", imagePullTimeoutSeconds=pull_s)}
    d = started(deploy, kubelet_cluster, capabilities)
    [dispatch_id] = d.schedule_batch("pull", 1)
    payload, took = ended(d, dispatch_id, timeout_s=pull_s + SWEEP_S + SLACK_S + 60)
    assert payload["reason"] in ("ErrImagePull", "ImagePullBackOff"), payload
    # kubelet 1.36 words both with containerd's cause: every registry is our closed loopback port
    # (ImagePullBackOff: 'Back-off pulling image "...": ErrImagePull: failed to pull and unpack ...')
    message = payload["message"]
    assert "k8s-dispatch.invalid/missing:1" in message and "127.0.0.1" in message, message
    assert message.endswith("connect: connection refused"), message
    assert "exit_code" not in payload["detail"]
    assert took.total_seconds() >= pull_s
    assert_no_pod_left(d)


def test_a_request_no_node_can_hold_ends_unschedulable_with_the_schedulers_message(deploy, kubelet_cluster):
    start_s = 8
    capabilities = {"nofit": busybox("true", resources={"requests": {"cpu": "64"}}, startTimeoutSeconds=start_s)}
    d = started(deploy, kubelet_cluster, capabilities)
    [dispatch_id] = d.schedule_batch("nofit", 1)
    payload, took = ended(d, dispatch_id, timeout_s=start_s + SWEEP_S + SLACK_S + 30)
    assert payload["reason"] == "Unschedulable", payload
    assert payload["message"].startswith("0/1 nodes are available: 1 Insufficient cpu."), payload["message"]
    assert start_s <= took.total_seconds() <= start_s + SWEEP_S + SLACK_S, took
    assert_no_pod_left(d)


def test_an_invalid_image_name_fails_at_once_with_the_kubelets_words(deploy, kubelet_cluster):
    d = started(deploy, kubelet_cluster, {"badname": busybox("true", image="Foo:1")})
    [dispatch_id] = d.schedule_batch("badname", 1)
    payload, _ = ended(d, dispatch_id, timeout_s=60)
    assert payload["reason"] == "InvalidImageName", payload
    assert "invalid reference format" in payload["message"], payload["message"]
    assert_no_pod_left(d)


def test_a_failing_container_that_wrote_no_result_ends_failed_with_the_lines_it_printed(deploy, kubelet_cluster):
    # terminationMessagePolicy FallbackToLogsOnError; the detail's tail is the kubelet's pods/log
    d = started(deploy, kubelet_cluster, {"fails": busybox("echo first line; echo second line >&2; exit 3")})
    [dispatch_id] = d.schedule_batch("fails", 1)
    payload, _ = ended(d, dispatch_id, timeout_s=120)
    detail = payload["detail"]
    assert (detail["exit_code"], detail["container_reason"]) == (3, "Error"), payload
    # stdout and stderr reach the log through two pipes: their lines' order is not kept
    assert sorted(detail["log_tail"].splitlines()) == ["first line", "second line"], detail["log_tail"]
    assert_no_pod_left(d)


def _processes(argv: bytes) -> list[int]:
    """Pids on this host whose command line is exactly `argv` (NUL-separated, as /proc keeps it)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if (proc / "cmdline").read_bytes() == argv:
                    found.append(int(proc.name))
            except OSError:
                pass
    return found


def test_active_deadline_seconds_kills_a_real_sleep(deploy, kubelet_cluster):
    argv = b"sleep\x00613\x00"  # a duration no other test uses: this container's process, found on the host
    # the shell ends on SIGTERM and its PID namespace's sleep with it (as PID 1 a bare sleep would
    # ignore SIGTERM and live out the 30 s grace period)
    script = "trap 'exit 143' TERM; sleep 613 & wait $!"
    d = started(deploy, kubelet_cluster, {"slow": busybox(script, activeDeadlineSeconds=3)})
    [dispatch_id] = d.schedule_batch("slow", 1)
    d.wait(lambda: _processes(argv), timeout_s=60, what="the container's sleep running on the host")
    payload, _ = ended(d, dispatch_id, timeout_s=90)
    assert payload["reason"] == "DeadlineExceeded", payload
    d.wait(lambda: not _processes(argv), timeout_s=60, what="the kubelet killed the sleep")
    assert_no_pod_left(d)


def test_a_cancel_stops_the_real_container(deploy, kubelet_cluster):
    argv = b"sleep\x00617\x00"
    d = started(deploy, kubelet_cluster, {"long": busybox("trap 'exit 143' TERM; sleep 617 & wait $!")})
    [dispatch_id] = d.schedule_batch("long", 1)
    d.wait(lambda: _processes(argv), timeout_s=60, what="the container's sleep running on the host")
    d.send(names.CANCEL_TASK, dispatch_id, reason="UserCancelled")
    events = d.wait_terminal([dispatch_id], timeout_s=60)
    assert events[dispatch_id] == [(EventType.WORKER_CANCELLED, {"reason": "UserCancelled"})]
    d.wait(lambda: not _processes(argv), timeout_s=60, what="the kubelet stopped the container")
    assert_no_pod_left(d)


def _kubectl(cluster: Any, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["kubectl", "--kubeconfig", str(cluster.kubeconfig), *args], capture_output=True, text=True, timeout=180
    )


def _running_pods(d: Any) -> list[str]:
    pods = d.kube.list_pods(d.namespace, label_selector=job_labels.selector())
    return [
        p["metadata"]["name"]
        for p in pods
        if not p["metadata"].get("deletionTimestamp")
        and any("running" in (s.get("state") or {}) for s in p.get("status", {}).get("containerStatuses") or [])
    ]


def test_kubectl_drain_mid_run_is_a_disruption_and_the_dispatch_completes_once_after_uncordon(deploy, kubelet_cluster):
    # The eviction's SIGTERM ends it (a shell as PID 1 would ignore it, and a script that finished
    # within the grace period would succeed: an eviction is a graceful delete)
    script = """trap 'exit 143' TERM; sleep 6 & wait $!; printf '{"done": true}' > /dev/termination-log"""
    d = started(deploy, kubelet_cluster, {"drained": busybox(script, backoffLimit=0)})
    [dispatch_id] = d.schedule_batch("drained", 1)
    [first] = d.wait(lambda: _running_pods(d), timeout_s=60, what="the Job's container running")
    try:
        drained = _kubectl(kubelet_cluster, "drain", NODE_NAME, "--ignore-daemonsets", "--timeout=120s")
        assert drained.returncode == 0, drained.stderr
        assert f"pod/{first} evicted" in drained.stdout, drained.stdout

        def disrupted() -> bool:
            with transaction(d.sessions) as session:
                return any(e.type == EventType.WORKER_DISRUPTED for e in dispatches.events_for(session, dispatch_id))

        d.wait(disrupted, timeout_s=60, what="WORKER_DISRUPTED recorded")
        assert d.terminal_events([dispatch_id]) == {dispatch_id: []}  # cordoned: the new Pod waits
    finally:
        uncordoned = _kubectl(kubelet_cluster, "uncordon", NODE_NAME)
    assert uncordoned.returncode == 0, uncordoned.stderr
    events = d.wait_terminal([dispatch_id], timeout_s=120)
    assert events[dispatch_id] == [(EventType.WORKER_COMPLETED, {"output": {"done": True}})]
    with transaction(d.sessions) as session:
        story = [(e.type, e.payload) for e in dispatches.events_for(session, dispatch_id)]
    assert [t for t, _ in story] == [
        EventType.WORKER_SCHEDULED, EventType.WORKER_DISRUPTED, EventType.WORKER_COMPLETED
    ]  # fmt: skip
    disruption = story[1][1]
    assert (disruption["reason"], disruption["pod"], disruption["node"]) == ("EvictionByEvictionAPI", first, NODE_NAME)
    assert_no_pod_left(d)


def test_the_roles_service_account_runs_the_work_path_on_a_real_node_through_the_real_authorizer(
    deploy, kubelet_cluster, tmp_path
):
    """Worker and beat with deploy/rbac.yaml's ServiceAccount (a TokenRequest token): every request
    they make is decided by kube-apiserver's RBAC authorizer, the kubelet's `pods/log` included."""
    namespace = f"rbac-{uuid.uuid4().hex[:8]}"
    kubeconfig = kubelet_cluster.service_account_kubeconfig(
        namespace, tmp_path / "worker.kubeconfig", rbac_file=ROOT / "deploy" / "rbac.yaml"
    )
    argv = b"sleep\x00619\x00"
    capabilities = {
        "echo": EXAMPLE["echo"],
        "fails": busybox("echo it broke; exit 3"),
        "long": busybox("trap 'exit 143' TERM; sleep 619 & wait $!"),
    }
    d = deploy(
        kubelet_cluster, capabilities=capabilities, namespace=namespace, kubeconfig=str(kubeconfig),
        sweep_interval_s=str(SWEEP_S), sweep_grace_s="1",
    )  # fmt: skip
    d.start_worker("w1", wait=False).wait_for_log(" ready.", timeout_s=120)  # a cold start on a busy machine
    d.start_beat()
    [echo_id], [fails_id], [long_id] = (d.schedule_batch(c, 1) for c in ("echo", "fails", "long"))
    d.wait(lambda: _processes(argv), timeout_s=60, what="the long container's sleep running on the host")
    d.send(names.CANCEL_TASK, long_id, reason="UserCancelled")
    events = d.wait_terminal([echo_id, fails_id, long_id], timeout_s=120)
    assert events[echo_id] == [(EventType.WORKER_COMPLETED, {"output": {"echo": {"i": 0}}})]
    assert events[long_id] == [(EventType.WORKER_CANCELLED, {"reason": "UserCancelled"})]
    [(event, payload)] = events[fails_id]
    assert (event, payload["detail"]["exit_code"]) == (EventType.WORKER_FAILED, 3), payload
    assert payload["detail"]["log_tail"] == "it broke\n"  # pods/log, granted by the Role
    assert_no_pod_left(d)
    assert sorted(d.notifications()) == sorted([echo_id, fails_id, long_id])
    refused = [line for p in d.procs for line in p.log().splitlines() if "Forbidden" in line or " 403" in line]
    assert not refused, refused
    # the worker's identity is the ServiceAccount's: the authorizer refuses it what the Role does not grant
    token = yaml.safe_load(kubeconfig.read_text())["users"][0]["user"]["token"]
    status, _, _ = kubelet_cluster.raw("GET", f"/api/v1/namespaces/{namespace}/pods/x/exec", token=token)
    assert status == 403
