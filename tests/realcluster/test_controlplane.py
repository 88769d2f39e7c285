"""The real control plane itself: built from the pinned modules, the version kubectl shows, RBAC
enforced by the real authorizer, the real Job controller running Pods through our node agent, and
a kube-apiserver restart that clients survive."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from clusters import ClusterHandle
from kubernetes import client

from k8s_dispatch.lab.realcluster import binaries
from k8s_dispatch.ops.processes import wait_until

ROOT = Path(__file__).resolve().parents[2]
SIM = "localcluster.k8s-dispatch.io/"


def _kubectl(*args: str, kubeconfig: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["kubectl", "--kubeconfig", str(kubeconfig), *args], capture_output=True, text=True, timeout=60, check=False
    )


def _wait(fn, *, timeout: float = 60.0, what: str):
    return wait_until(fn, timeout=timeout, interval=0.1, what=what)


def test_the_build_is_keyed_and_idempotent(real_cluster: ClusterHandle) -> None:
    first = binaries.build("kube")
    started = time.monotonic()
    again = binaries.build("kube")
    assert again == first and (first / ".complete").exists()
    assert time.monotonic() - started < 5, "a warm build must find the cache, not compile"
    assert ROOT not in first.parents, "binaries live in the tool cache, never in the repository"


def test_kubectl_shows_the_pinned_version(real_cluster: ClusterHandle) -> None:
    pinned = re.search(
        r"^(?:require)?\s*k8s\.io/kubernetes (v\S+)", (ROOT / "tools/kube/go.mod").read_text(), re.M
    ).group(1)
    out = _kubectl("version", "-o", "json", kubeconfig=real_cluster.kubeconfig)
    assert out.returncode == 0, out.stderr
    server = json.loads(out.stdout)["serverVersion"]
    assert server["gitVersion"] == pinned
    assert (server["major"], server["minor"]) == tuple(pinned.lstrip("v").split(".")[:2])


def test_rbac_is_enforced_for_a_service_account(real_cluster: ClusterHandle, tmp_path: Path) -> None:
    ns = real_cluster.ensure_namespace("rbac-check")
    with real_cluster.api_client() as api:
        core = client.CoreV1Api(api)
        core.create_namespaced_service_account(ns, {"metadata": {"name": "nobody"}})
        token = core.create_namespaced_service_account_token(
            "nobody", ns, {"spec": {"expirationSeconds": 600}}
        ).status.token
    status, _, body = real_cluster.raw("GET", f"/apis/batch/v1/namespaces/{ns}/jobs", token=token)
    assert status == 403, body
    assert json.loads(body)["reason"] == "Forbidden"
    status, _, _ = real_cluster.raw("GET", f"/apis/batch/v1/namespaces/{ns}/jobs", token="not-a-token")
    assert status == 401


@pytest.mark.parametrize("restart_first", [False, True], ids=["running", "after-a-controller-manager-restart"])
def test_the_job_controller_runs_a_pod_on_our_node(real_cluster: ClusterHandle, restart_first: bool) -> None:
    if restart_first:
        real_cluster.backend.restart_controller_manager()
    ns = real_cluster.ensure_namespace(f"job-runs-{int(restart_first)}")
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "hello"},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "metadata": {"annotations": {SIM + "duration-ms": "200", SIM + "result": '{"ok": 1}'}},
                "spec": {"restartPolicy": "Never", "containers": [{"name": "main", "image": "sim:1"}]},
            },
        },
    }
    with real_cluster.api_client() as api:
        batch, core = client.BatchV1Api(api), client.CoreV1Api(api)
        batch.create_namespaced_job(ns, job)

        def complete():
            j = batch.read_namespaced_job("hello", ns)
            return j if any(c.type == "Complete" and c.status == "True" for c in j.status.conditions or []) else None

        done = _wait(complete, what="the Job to complete")
        assert done.status.succeeded == 1
        pods = core.list_namespaced_pod(ns, label_selector="batch.kubernetes.io/job-name=hello").items
        assert len(pods) == 1 and pods[0].spec.node_name
        term = pods[0].status.container_statuses[0].state.terminated
        assert term.exit_code == 0 and json.loads(term.message) == {"ok": 1}
        # the real controller's tracking finalizer is gone once the Pod is counted
        assert "batch.kubernetes.io/job-tracking" not in (pods[0].metadata.finalizers or [])


def test_clients_survive_an_apiserver_restart(real_cluster: ClusterHandle) -> None:
    ns = real_cluster.ensure_namespace("restart")
    with real_cluster.api_client() as api:
        core = client.CoreV1Api(api)
        core.create_namespaced_config_map(ns, {"metadata": {"name": "kept"}, "data": {"a": "1"}})
        real_cluster.backend.restart_apiserver()
        assert core.read_namespaced_config_map("kept", ns).data == {"a": "1"}


def test_serve_writes_a_kubeconfig_and_removes_everything_on_sigterm(tmp_path: Path) -> None:
    import os
    import signal
    import sys

    kubeconfig = tmp_path / "rc.kubeconfig"
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "k8s_dispatch.lab.realcluster",
            "serve",
            "--kubeconfig",
            str(kubeconfig),
            "--mode",
            "none",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait(lambda: kubeconfig.exists(), timeout=120, what="the kubeconfig")
        doc = yaml.safe_load(kubeconfig.read_text())
        assert doc["clusters"][0]["cluster"]["server"].startswith("https://127.0.0.1:")
        _wait(
            lambda: _kubectl("get", "--raw", "/readyz", kubeconfig=kubeconfig).returncode == 0,
            timeout=60,
            what="readyz through the written kubeconfig",
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert not kubeconfig.exists()
    assert not list(tmp_path.glob("realcluster-*")), "serve must remove its directory"
