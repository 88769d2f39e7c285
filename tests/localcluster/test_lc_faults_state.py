"""Authentication, fault injection (in process and through the fault endpoint), and --state
persistence across a restart of a `python -m k8s_dispatch.demo.localcluster serve` process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import condition_types, job_manifest, raw_request, wait_for
from kubernetes import client, config
from kubernetes.client import ApiException

from k8s_dispatch.demo.localcluster import LocalCluster

SIM = "localcluster.k8s-dispatch.io/"


def test_requests_without_the_token_are_401(sim_cluster: LocalCluster) -> None:
    for token in ("", "wrong"):
        code, _, body = raw_request(sim_cluster, "GET", "/apis/batch/v1/namespaces/default/jobs", token=token)
        status = json.loads(body)
        assert code == 401 and status["kind"] == "Status" and status["reason"] == "Unauthorized"
    code, _, body = raw_request(sim_cluster, "GET", "/healthz", token="")
    assert (code, body) == (200, b"ok")
    cfg = client.Configuration(host=sim_cluster.url)
    with client.ApiClient(cfg) as anonymous:
        with pytest.raises(ApiException) as e:
            client.BatchV1Api(anonymous).list_namespaced_job("default")
        assert e.value.status == 401


def test_fault_injection_and_latency_at_runtime() -> None:
    with LocalCluster(mode="simulate", fault_rate=1.0, tls=False) as cluster:
        path = "/api/v1/namespaces/default/pods"
        seen = set()
        for _ in range(30):
            code, headers, body = raw_request(cluster, "GET", path)
            seen.add(code)
            assert json.loads(body)["kind"] == "Status"
            if code == 429:
                assert headers["retry-after"] == "1"
        assert seen == {500, 503, 429}
        assert raw_request(cluster, "GET", "/healthz")[0] == 200  # never faulted
        cluster.set_faults(0.0, 150)
        started = time.monotonic()
        assert raw_request(cluster, "GET", path)[0] == 200
        assert time.monotonic() - started >= 0.15
        code, _, body = raw_request(cluster, "POST", "/localcluster/faults", {"rate": 0.0, "latency_ms": 0})
        assert code == 200 and json.loads(body) == {"rate": 0.0, "latency_ms": 0, "injected": 30}
        assert raw_request(cluster, "POST", "/localcluster/faults", {"rate": 0.5}, token="bad")[0] == 401
        assert raw_request(cluster, "POST", "/localcluster/faults", {"rate": 2})[0] == 400
        with pytest.raises(ValueError):
            cluster.set_faults(1.5, 0)


def test_the_fault_endpoint_drives_a_partial_rate() -> None:
    with LocalCluster(mode="simulate", tls=False) as cluster:
        raw_request(cluster, "POST", "/localcluster/faults", {"rate": 0.5, "latency_ms": 0})
        codes = [raw_request(cluster, "GET", "/api/v1/namespaces/default/pods")[0] for _ in range(200)]
        failed = sum(1 for c in codes if c != 200)
        assert 50 < failed < 150  # ~100 expected; far outside on a broken injector


# --- persistence -------------------------------------------------------------------------------


class ServeProcess:
    def __init__(self, tmp: Path, *, mode: str, port: int = 0, tls_port: int = 0) -> None:
        self.kubeconfig = tmp / "kubeconfig"
        cmd = [
            sys.executable,
            "-m",
            "k8s_dispatch.demo.localcluster",
            "serve",
            "--mode",
            mode,
            "--state",
            str(tmp / "state.jsonl"),
            "--kubeconfig",
            str(self.kubeconfig),
            "--port",
            str(port),
            "--tls-port",
            str(tls_port),
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2]
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("listening on http://127.0.0.1:"), (
            line,
            self.proc.stderr.read() if self.proc.poll() is not None else "",
        )
        self.url = line.split()[-1]

    def api(self) -> client.ApiClient:
        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)
        try:
            self.proc.wait(20)
        finally:
            assert self.proc.stdout and self.proc.stderr
            self.proc.stdout.close()
            self.proc.stderr.close()


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[type[ServeProcess]]:
    started: list[ServeProcess] = []

    class Tracked(ServeProcess):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            started.append(self)

    yield Tracked
    for s in started:
        if s.proc.poll() is None:
            s.stop(signal.SIGKILL)


def test_state_survives_a_restart_and_running_exec_pods_fail_like_a_lost_node(
    tmp_path: Path, serve: type[ServeProcess]
) -> None:
    first = serve(tmp_path, mode="exec")
    api = first.api()
    try:
        batch, _core = client.BatchV1Api(api), client.CoreV1Api(api)
        batch.create_namespaced_job("default", job_manifest("done", command=["python", "-c", "print('ok')"]))
        keep = job_manifest("kept", labels={"keep": "me"}, annotations={"a": "b"}, command=["python", "-c", "print(1)"])
        keep["metadata"]["finalizers"] = ["k8s-dispatch.io/result-protection"]
        batch.create_namespaced_job("default", keep)
        batch.create_namespaced_job(
            "default", job_manifest("lost", command=["python", "-c", "import time; time.sleep(120)"], backoffLimit=0)
        )
        wait_for(
            lambda: "Complete" in condition_types(batch.read_namespaced_job("done", "default")), timeout=30, what="done"
        )
        wait_for(
            lambda: "Complete" in condition_types(batch.read_namespaced_job("kept", "default")), timeout=30, what="kept"
        )
        wait_for(
            lambda: batch.read_namespaced_job("lost", "default").status.ready == 1, timeout=30, what="lost running"
        )
        rv_before = int(batch.list_namespaced_job("default").metadata.resource_version)
        uid = batch.read_namespaced_job("kept", "default").metadata.uid
    finally:
        api.close()
    first.stop()  # SIGTERM: saves state, kills the child

    second = serve(tmp_path, mode="exec")
    api = second.api()  # the same kubeconfig: token and certificate kept
    try:
        batch, _core = client.BatchV1Api(api), client.CoreV1Api(api)
        kept = batch.read_namespaced_job("kept", "default")
        assert kept.metadata.uid == uid and kept.metadata.labels["keep"] == "me"
        assert kept.metadata.finalizers == ["k8s-dispatch.io/result-protection"]
        assert "Complete" in condition_types(kept)
        assert int(batch.list_namespaced_job("default").metadata.resource_version) >= rv_before
        lost = wait_for(
            lambda: (lambda j: j if "Failed" in condition_types(j) else None)(
                batch.read_namespaced_job("lost", "default")
            ),
            timeout=20,
            what="lost job failed",
        )
        assert lost.status.conditions[-1].reason == "BackoffLimitExceeded"
        # the new server keeps writing state: a job created now survives the next restart
        batch.create_namespaced_job("default", job_manifest("later", command=["python", "-c", "print(2)"]))
    finally:
        api.close()
    second.stop(signal.SIGINT)

    third = serve(tmp_path, mode="simulate")
    api = third.api()
    try:
        names = {j.metadata.name for j in client.BatchV1Api(api).list_namespaced_job("default").items}
        assert {"done", "kept", "lost", "later"} <= names
    finally:
        api.close()
    third.stop()


def test_state_is_written_soon_after_a_change_even_if_the_server_is_killed(
    tmp_path: Path, serve: type[ServeProcess]
) -> None:
    first = serve(tmp_path, mode="simulate")
    api = first.api()
    try:
        client.BatchV1Api(api).create_namespaced_job(
            "default", job_manifest("quick", annotations={SIM + "outcome": "hang"})
        )
        state = tmp_path / "state.jsonl"
        wait_for(lambda: state.exists() and b'"name":"quick"' in state.read_bytes(), timeout=5, what="snapshot")
    finally:
        api.close()
    first.stop(signal.SIGKILL)
    second = serve(tmp_path, mode="simulate")
    api = second.api()
    try:
        job = client.BatchV1Api(api).read_namespaced_job("quick", "default")
        assert job.metadata.name == "quick"
        # simulated pods resume after a restart: a hanging one is still running
        pods = client.CoreV1Api(api).list_namespaced_pod("default", label_selector="job-name=quick").items
        assert pods and pods[0].status.phase == "Running"
    finally:
        api.close()
    second.stop()
    assert os.path.exists(tmp_path / "state.jsonl")
