"""kubectl 1.32 against the cluster, unchanged: create -f, get (-l, -o json, -w), label, patch,
delete, wait --for=condition=complete, logs job/NAME. Each test uses a fresh HOME and discovery
cache so nothing is remembered from another server."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Api, wait_for

KUBECTL = shutil.which("kubectl")

JOB_YAML = """\
apiVersion: batch/v1
kind: Job
metadata:
  name: {name}
  labels: {{app: demo, tier: {tier}}}
spec:
  backoffLimit: 1
  template:
    metadata:
      annotations:
        localcluster.k8s-dispatch.io/duration-ms: "{duration}"
        localcluster.k8s-dispatch.io/result: '{{"answer": 42}}'
    spec:
      restartPolicy: Never
      containers:
      - name: main
        image: python:3.11
        command: ["python", "-c", "print(42)"]
"""


@pytest.fixture
def kubectl(sim: Api, tmp_path: Path) -> Iterator:
    if KUBECTL is None:
        pytest.fail("kubectl is not on PATH: these tests check kubectl 1.32 against localcluster")
    home = tmp_path / "home"
    home.mkdir()
    base = [
        KUBECTL,
        "--kubeconfig",
        str(sim.cluster.kubeconfig),
        "--cache-dir",
        str(tmp_path / "cache"),
        "-n",
        sim.namespace,
    ]
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin"}

    def run(*args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([*base, *args], input=input, capture_output=True, text=True, env=env, timeout=60)
        if check and result.returncode != 0:
            pytest.fail(f"kubectl {' '.join(args)} failed ({result.returncode}): {result.stderr}")
        return result

    run.base = base  # type: ignore[attr-defined]
    run.env = env  # type: ignore[attr-defined]
    yield run


def _create(kubectl, tmp_path: Path, name: str, *, tier: str = "a", duration: int = 50) -> None:
    path = tmp_path / f"{name}.yaml"
    path.write_text(JOB_YAML.format(name=name, tier=tier, duration=duration))
    out = kubectl("create", "-f", str(path))
    assert out.stdout.strip() == f"job.batch/{name} created"


def test_create_get_wait_logs(kubectl, sim: Api, tmp_path: Path) -> None:
    _create(kubectl, tmp_path, "kc1", tier="front")
    _create(kubectl, tmp_path, "kc2", tier="back")
    out = kubectl("wait", "--for=condition=complete", "job/kc1", "--timeout=20s")
    assert out.stdout.strip() == "job.batch/kc1 condition met"
    table = kubectl("get", "jobs", "-l", "tier=front").stdout.splitlines()
    assert table[0].split() == ["NAME", "STATUS", "COMPLETIONS", "DURATION", "AGE"]
    assert [line.split()[:3] for line in table[1:]] == [["kc1", "Complete", "1/1"]]
    pods = kubectl("get", "pods", "-l", "job-name=kc1").stdout.splitlines()
    assert pods[0].split() == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
    assert pods[1].split()[1:4] == ["0/1", "Completed", "0"]
    listed = json.loads(kubectl("get", "jobs", "-o", "json").stdout)
    assert listed["kind"] == "List" and {i["metadata"]["name"] for i in listed["items"]} == {"kc1", "kc2"}
    one = json.loads(kubectl("get", "job", "kc1", "-o", "json").stdout)
    assert one["status"]["succeeded"] == 1 and one["metadata"]["labels"]["tier"] == "front"
    assert kubectl("logs", "job/kc1").stdout.strip() == '{"answer": 42}'
    missing = kubectl("get", "job", "nope", check=False)
    assert missing.returncode == 1
    assert missing.stderr.strip() == 'Error from server (NotFound): jobs.batch "nope" not found'


def test_label_patch_and_delete(kubectl, sim: Api, tmp_path: Path) -> None:
    _create(kubectl, tmp_path, "kl", duration=10)
    assert kubectl("label", "job", "kl", "owner=me").stdout.strip() == "job.batch/kl labeled"
    assert sim.job("kl").metadata.labels["owner"] == "me"
    assert (
        kubectl("patch", "job", "kl", "-p", '{"metadata":{"annotations":{"note":"x"}}}').stdout.strip()
        == "job.batch/kl patched"
    )
    kubectl(
        "patch",
        "job",
        "kl",
        "--type",
        "merge",
        "-p",
        '{"metadata":{"finalizers":["k8s-dispatch.io/result-protection"]}}',
    )
    kubectl("patch", "job", "kl", "--type", "json", "-p", '[{"op":"add","path":"/metadata/labels/step","value":"3"}]')
    job = sim.job("kl")
    assert job.metadata.annotations["note"] == "x" and job.metadata.labels["step"] == "3"
    assert job.metadata.finalizers == ["k8s-dispatch.io/result-protection"]
    # delete waits for the Job to go: it goes once the finalizer is removed
    proc = subprocess.Popen(
        [*kubectl.base, "delete", "job", "kl", "--timeout=30s"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=kubectl.env,
    )
    try:
        wait_for(lambda: sim.job("kl").metadata.deletion_timestamp, what="deletionTimestamp")
        assert proc.poll() is None  # still waiting
        kubectl("patch", "job", "kl", "--type", "json", "-p", '[{"op":"remove","path":"/metadata/finalizers"}]')
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert out.strip() == 'job.batch "kl" deleted'
    assert sim.gone(lambda: sim.job("kl"))
    wait_for(lambda: not sim.pods_of("kl"), what="kubectl's Background deletion removes the pods")


def test_get_watch_streams_changes(kubectl, sim: Api, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [*kubectl.base, "get", "jobs", "-w"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=kubectl.env
    )
    try:
        assert proc.stdout is not None
        time.sleep(0.5)  # kubectl lists then watches; a Job created meanwhile shows up either way
        _create(kubectl, tmp_path, "kw", duration=200)
        lines = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.split())
            if line.split()[1:3] == ["Complete", "1/1"]:
                break
        assert lines[0] == ["NAME", "STATUS", "COMPLETIONS", "DURATION", "AGE"]
        assert lines[1][:3] == ["kw", "Running", "0/1"]
        assert lines[-1][:3] == ["kw", "Complete", "1/1"]
    finally:
        proc.kill()
        proc.communicate()


def test_create_rejects_unknown_fields_like_the_real_server(kubectl, sim: Api, tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        JOB_YAML.format(name="kbad", tier="a", duration=5).replace(
            "  backoffLimit: 1\n", "  backoffLimit: 1\n  bogus: 2\n"
        )
    )
    out = kubectl("create", "-f", str(path), check=False)
    assert out.returncode == 1
    assert 'strict decoding error: unknown field "spec.bogus"' in out.stderr
