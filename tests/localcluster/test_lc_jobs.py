"""The Job controller in simulate and exec mode: outcomes, termination messages, backoffLimit
retries, activeDeadlineSeconds, ttlSecondsAfterFinished (with and without finalizers), suspend,
parallelism, and exec-mode env, logs and FallbackToLogsOnError."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from conftest import Api, condition_types, job_manifest, raw_request, wait_for
from kubernetes.client import ApiException

SIM = "localcluster.k8s-dispatch.io/"


def _terminated(pod):
    return pod.status.container_statuses[0].state.terminated


def _processes_with(marker: str) -> list[int]:
    """Pids of live processes whose command line contains `marker`."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if marker.encode() in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


# --- simulate mode ---------------------------------------------------------------------------


def test_simulated_success_echoes_the_input(sim: Api) -> None:
    env = [{"name": "K8S_DISPATCH_INPUT", "value": json.dumps({"n": 3, "s": "x"})}]
    sim.create_job(job_manifest("ok", env=env, annotations={SIM + "duration-ms": "20"}))
    job = sim.wait_job("ok")
    assert condition_types(job) == ["SuccessCriteriaMet", "Complete"]
    assert {c.reason for c in job.status.conditions} == {"CompletionsReached"}
    assert job.status.succeeded == 1 and not job.status.failed and not job.status.active
    assert job.status.completion_time >= job.status.start_time
    pod = wait_for(
        lambda: (lambda ps: ps[0] if ps and not ps[0].metadata.finalizers else None)(sim.pods_of("ok")),
        what="pod counted (finalizer removed)",
    )
    term = _terminated(pod)
    assert pod.status.phase == "Succeeded" and term.exit_code == 0 and term.reason == "Completed"
    assert json.loads(term.message) == {"simulated": True, "input": {"n": 3, "s": "x"}}


def test_a_quick_job_writes_its_status_once_per_phase(lsim: Api) -> None:
    """Pod events reach the controller batched, as in Kubernetes: a Pod that starts and ends
    within one batch period costs its Job one status write, not one per Pod step. localcluster
    alone: the real controller's 1 s batch makes one more write here (its `ready` count), a count
    of writes is no semantics to hold it to."""
    sim = lsim
    rv = sim.batch.list_namespaced_job(sim.namespace).metadata.resource_version
    sim.create_job(job_manifest("quick", annotations={SIM + "duration-ms": "0"}))
    sim.wait_job("quick")
    wait_for(lambda: (lambda ps: ps and not ps[0].metadata.finalizers)(sim.pods_of("quick")), what="pod counted")

    def events(plural: str) -> list[tuple[str, dict]]:
        group = "apis/batch/v1" if plural == "jobs" else "api/v1"
        path = f"/{group}/namespaces/{sim.namespace}/{plural}?watch=true&resourceVersion={rv}&timeoutSeconds=1"
        code, _, body = raw_request(sim.cluster, "GET", path)
        assert code == 200
        return [(e["type"], e["object"]) for e in map(json.loads, body.splitlines())]

    jobs = events("jobs")
    assert [t for t, _ in jobs] == ["ADDED", "MODIFIED", "MODIFIED"]
    started, done = jobs[1][1]["status"], jobs[2][1]["status"]
    assert (started["active"], started["ready"]) == (1, 0) and started["startTime"]  # the new Pod counts as active
    assert done["succeeded"] == 1 and [c["type"] for c in done["conditions"]] == ["SuccessCriteriaMet", "Complete"]
    pods = events("pods")
    assert [(t, o["status"]["phase"], bool(o["metadata"].get("finalizers"))) for t, o in pods] == [
        ("ADDED", "Pending", True),
        ("MODIFIED", "Running", True),
        ("MODIFIED", "Succeeded", True),
        ("MODIFIED", "Succeeded", False),
    ]
    rvs = [int(o["metadata"]["resourceVersion"]) for _, o in jobs + pods]
    assert len(set(rvs)) == len(rvs) and all(r > int(rv) for r in rvs)


def test_simulated_failure_retries_until_the_backoff_limit(sim: Api) -> None:
    ann = {SIM + "outcome": "fail", SIM + "exit-code": "7", SIM + "duration-ms": "5", SIM + "result": '{"error": 1}'}
    sim.create_job(job_manifest("bad", annotations=ann, backoffLimit=2))
    # the real controller waits 10 s, then 20 s, before each replacement Pod
    job = sim.wait_job("bad", "Failed", timeout=90 if sim.cluster.is_real else 10)
    assert condition_types(job) == ["FailureTarget", "Failed"]
    assert job.status.conditions[-1].reason == "BackoffLimitExceeded"
    assert job.status.conditions[-1].message == "Job has reached the specified backoff limit"
    assert job.status.failed == 3 and not job.status.succeeded and job.status.completion_time is None
    pods = sim.pods_of("bad")
    assert len(pods) == 3
    assert {(_terminated(p).exit_code, _terminated(p).reason, _terminated(p).message) for p in pods} == {
        (7, "Error", '{"error": 1}')
    }


def test_a_hanging_job_hits_its_deadline(sim: Api) -> None:
    started = time.monotonic()
    sim.create_job(job_manifest("slow", annotations={SIM + "outcome": "hang"}, activeDeadlineSeconds=1))
    job = sim.wait_job("slow", "Failed")
    assert time.monotonic() - started >= 0.9
    assert job.status.conditions[-1].reason == "DeadlineExceeded"
    assert job.status.conditions[-1].message == "Job was active longer than specified deadline"
    assert job.status.failed == 1 and not job.status.active
    wait_for(lambda: not sim.pods_of("slow"), what="the deadline's pod deletion to finish")


def test_parallel_completions(sim: Api) -> None:
    sim.create_job(job_manifest("many", annotations={SIM + "duration-ms": "30"}, completions=5, parallelism=2))
    seen_active = wait_for(lambda: sim.job("many").status.active, what="active pods")
    assert seen_active <= 2
    job = sim.wait_job("many", "Complete")
    assert job.status.succeeded == 5 and len(sim.pods_of("many")) == 5


def test_suspend_and_resume(sim: Api) -> None:
    sim.create_job(job_manifest("sus", annotations={SIM + "duration-ms": "10"}, suspend=True))
    job = wait_for(
        lambda: (lambda j: j if "Suspended" in condition_types(j) else None)(sim.job("sus")), what="Suspended"
    )
    assert job.status.conditions[0].reason == "JobSuspended" and not sim.pods_of("sus")
    sim.batch.patch_namespaced_job("sus", sim.namespace, {"spec": {"suspend": False}})
    job = sim.wait_job("sus", "Complete")
    resumed = next(c for c in job.status.conditions if c.type == "Suspended")
    assert (resumed.status, resumed.reason) == ("False", "JobResumed")


def test_a_running_job_suspended_loses_its_pod_without_a_failure_and_completes_when_resumed(sim: Api) -> None:
    """Kueue's preemption is a suspend: the Job controller deletes the Pod it no longer wants with
    its tracking finalizer taken off first, so the Pod's end counts against no backoffLimit."""
    sim.create_job(job_manifest("pre", annotations={SIM + "duration-ms": "3000"}, backoffLimit=0))
    wait_for(lambda: [p for p in sim.pods_of("pre") if p.status.phase == "Running"], what="the pod running")
    sim.batch.patch_namespaced_job("pre", sim.namespace, {"spec": {"suspend": True}})
    wait_for(lambda: not sim.pods_of("pre"), timeout=30, what="the suspended job's pod gone")
    job = sim.job("pre")
    assert "Suspended" in condition_types(job) and not job.status.failed and not job.status.active
    sim.batch.patch_namespaced_job("pre", sim.namespace, {"spec": {"suspend": False}})
    job = sim.wait_job("pre", "Complete", timeout=30)
    assert job.status.succeeded == 1 and not job.status.failed


def test_ttl_deletes_a_finished_job_and_its_pods(sim: Api) -> None:
    sim.create_job(job_manifest("ttl", annotations={SIM + "duration-ms": "5"}, ttlSecondsAfterFinished=0))
    wait_for(lambda: sim.gone(lambda: sim.job("ttl")), what="ttl deletion")
    wait_for(lambda: not sim.pods_of("ttl"), what="pods deleted")


def test_ttl_respects_finalizers(sim: Api) -> None:
    # The finalizer on the Job and, through its template, on its Pod: kube-apiserver's TTL
    # controller deletes in the foreground, so the Pods go first, and only a finalizer of their
    # own keeps the one holding the result.
    finalizer = "k8s-dispatch.io/result-protection"
    manifest = job_manifest("ttlf", annotations={SIM + "duration-ms": "5"}, ttlSecondsAfterFinished=0)
    manifest["metadata"]["finalizers"] = [finalizer]
    manifest["spec"]["template"]["metadata"]["finalizers"] = [finalizer]
    sim.create_job(manifest)
    job = wait_for(
        lambda: (lambda j: j if j.metadata.deletion_timestamp else None)(sim.job("ttlf")),
        timeout=30,
        what="ttl marks deletion",
    )
    assert "Complete" in condition_types(job)  # the result is still readable
    [pod] = sim.pods_of("ttlf")
    assert _terminated(pod).exit_code == 0 and finalizer in pod.metadata.finalizers
    sim.core.patch_namespaced_pod(
        pod.metadata.name, sim.namespace, {"metadata": {"$deleteFromPrimitiveList/finalizers": [finalizer]}}
    )
    sim.batch.patch_namespaced_job(
        "ttlf", sim.namespace, {"metadata": {"$deleteFromPrimitiveList/finalizers": [finalizer]}}
    )
    wait_for(lambda: sim.gone(lambda: sim.job("ttlf")), timeout=30, what="job gone once the finalizers are removed")
    wait_for(lambda: not sim.pods_of("ttlf"), timeout=30, what="its pod gone too")


def test_job_names_longer_than_63_characters_are_invalid(sim: Api) -> None:
    with pytest.raises(ApiException) as e:
        sim.create_job(job_manifest("j" * 64))
    name = "j" * 64
    assert e.value.status == 422
    # the name itself may be a 253-character subdomain: it is the job-name label it gets that is too long
    assert json.loads(e.value.body)["message"] == (
        f'Job.batch "{name}" is invalid: spec.template.labels: Invalid value: "{name}": must be no more than 63 bytes'
    )


# --- exec mode -------------------------------------------------------------------------------

WRITE_MESSAGE = (
    "import json, os, sys; print('running as', os.environ['POD_NAME'], os.environ['APP']); "
    "json.dump({'echo': json.loads(os.environ['K8S_DISPATCH_INPUT']), 'python': sys.executable}, "
    "open(os.environ['TERMINATION_MESSAGE_PATH'], 'w'))"
)


def test_exec_runs_the_command_with_env_and_reads_the_termination_message(ex: Api) -> None:
    env = [
        {"name": "K8S_DISPATCH_INPUT", "value": json.dumps({"a": 1})},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
    ]
    manifest = job_manifest("runs", command=["python", "-c", WRITE_MESSAGE], env=env)
    manifest["spec"]["template"].setdefault("metadata", {})["labels"] = {"app": "calc"}
    ex.create_job(manifest)
    job = ex.wait_job("runs", timeout=30)
    assert condition_types(job) == ["SuccessCriteriaMet", "Complete"]
    pod = ex.pods_of("runs")[0]
    term = _terminated(pod)
    assert term.exit_code == 0 and term.reason == "Completed" and term.container_id.startswith("localcluster://")
    assert json.loads(term.message) == {"echo": {"a": 1}, "python": sys.executable}
    log = ex.core.read_namespaced_pod_log(pod.metadata.name, ex.namespace)
    assert log == f"running as {pod.metadata.name} calc\n"


def test_exec_failure_falls_back_to_the_log_tail_and_retries(ex: Api) -> None:
    script = "import sys; [print('line', i) for i in range(200)]; sys.exit(3)"
    manifest = job_manifest(
        "fails",
        command=["python", "-c", script],
        backoffLimit=1,
        container={"terminationMessagePolicy": "FallbackToLogsOnError"},
    )
    ex.create_job(manifest)
    job = ex.wait_job("fails", "Failed", timeout=30)
    assert job.status.conditions[-1].reason == "BackoffLimitExceeded" and job.status.failed == 2
    pods = ex.pods_of("fails")
    assert len(pods) == 2
    for pod in pods:
        term = _terminated(pod)
        assert (term.exit_code, term.reason, pod.status.phase) == (3, "Error", "Failed")
        lines = term.message.splitlines()
        assert len(lines) == 80 and lines[-1] == "line 199" and len(term.message.encode()) <= 2048


def test_exec_deadline_kills_the_process(ex: Api) -> None:
    marker = f"sleeps-{ex.namespace}"
    ex.create_job(
        job_manifest("sleeps", command=["python", "-c", "import time; time.sleep(60)", marker], activeDeadlineSeconds=1)
    )
    wait_for(lambda: _processes_with(marker), what="the process to start")
    job = ex.wait_job("sleeps", "Failed", timeout=20)
    assert job.status.conditions[-1].reason == "DeadlineExceeded"
    assert job.status.failed == 1
    wait_for(lambda: not ex.pods_of("sleeps"), what="the killed pod to go")
    assert not _processes_with(marker)


def test_exec_a_missing_command_is_a_start_error(ex: Api) -> None:
    ex.create_job(job_manifest("nocmd", command=["definitely-not-a-command-xyz"], backoffLimit=0))
    ex.wait_job("nocmd", "Failed", timeout=20)
    term = _terminated(ex.pods_of("nocmd")[0])
    assert term.exit_code == 128 and term.reason == "StartError" and "definitely-not-a-command-xyz" in term.message


def test_exec_bounds_the_processes_running_at_once() -> None:
    from kubernetes import client, config

    from k8s_dispatch.demo.localcluster import LocalCluster

    script = "import time; time.sleep(0.4)"
    with LocalCluster(mode="exec", max_running=1, tls=False) as cluster:
        api_client = config.new_client_from_config(config_file=str(cluster.kubeconfig))
        try:
            batch, core = client.BatchV1Api(api_client), client.CoreV1Api(api_client)
            for i in range(3):
                batch.create_namespaced_job("default", job_manifest(f"q{i}", command=["python", "-c", script]))
            most = 0
            waiting_seen = False

            def all_done() -> bool:
                nonlocal most, waiting_seen
                pods = core.list_namespaced_pod("default").items
                running = [p for p in pods if p.status.phase == "Running"]
                most = max(most, len(running))
                waiting_seen |= any(
                    p.status.phase == "Pending"
                    and p.status.container_statuses
                    and p.status.container_statuses[0].state.waiting.reason == "ContainerCreating"
                    for p in pods
                )
                return len(pods) == 3 and all(p.status.phase == "Succeeded" for p in pods)

            wait_for(all_done, timeout=30, interval=0.05, what="three queued jobs to finish")
            assert most == 1 and waiting_seen
        finally:
            api_client.close()


def test_following_a_running_pods_log_streams_until_it_ends(sim: Api) -> None:
    # on the real control plane kube-apiserver proxies this to the node agent's endpoint
    sim.create_job(job_manifest("follow", annotations={SIM + "duration-ms": "1500", SIM + "result": '{"ok": 1}'}))
    pod = wait_for(
        lambda: next((p for p in sim.pods_of("follow") if p.status.phase == "Running"), None),
        timeout=30,
        what="the pod running",
    )
    started = time.monotonic()
    code, _, body = raw_request(
        sim.cluster, "GET", f"/api/v1/namespaces/{sim.namespace}/pods/{pod.metadata.name}/log?follow=true"
    )
    assert code == 200
    assert time.monotonic() - started < 20  # the stream ends with the container, it does not hang
    assert sim.job("follow").status.succeeded == 1 or sim.wait_job("follow", "Complete", timeout=30)
    assert json.loads(body) == json.loads(sim.core.read_namespaced_pod_log(pod.metadata.name, sim.namespace))
