"""The node agent (`python -m k8s_dispatch.demo.localcluster node`) as a separate process against localcluster with
no kubelet of its own (`LocalCluster(kubelet=False)`), in both modes: the Node and its Lease, the
binding of unscheduled Pods, Pod statuses through pods/status, deletion with the grace period,
`kubectl logs` proxied to the agent's HTTPS log endpoint, restarts and a clean shutdown. The
tests speak only to a kubeconfig, so they hold for any API server. Plus the pure pieces and
localcluster's pods/binding subresource."""

from __future__ import annotations

import importlib.util
import json
import os
import select
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import job_manifest, wait_for
from kubernetes import client, config, watch

from k8s_dispatch.demo.localcluster import LocalCluster
from k8s_dispatch.demo.localcluster.kubelet import has_started
from k8s_dispatch.demo.localcluster.node import KUBELET_VERSION, log_slice, micro_time, node_status, schedulable
from k8s_dispatch.demo.localcluster.timestamps import parse_rfc3339

SIM = "localcluster.k8s-dispatch.io/"
RESULT = '{"answer": 42}'


class Agent:
    """One `localcluster node` process; `port` is its log endpoint's, read from its first line."""

    def __init__(self, kubeconfig: Path, *, mode: str, name: str, workdir: Path) -> None:
        self.kubeconfig, self.mode, self.name, self.workdir = kubeconfig, mode, name, workdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    def start(self) -> Agent:
        self.workdir.mkdir(parents=True, exist_ok=True)
        stderr = open(self.workdir / "agent.log", "ab")  # noqa: SIM115 - the agent writes to it for its whole life
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "k8s_dispatch.demo.localcluster",
                "node",
                "--kubeconfig",
                str(self.kubeconfig),
                "--mode",
                self.mode,
                "--name",
                self.name,
                "--workdir",
                str(self.workdir),
            ],
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
        stderr.close()
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 60)
        line = self.proc.stdout.readline().decode() if ready else ""
        if "ready" not in line:
            self.proc.kill()
            pytest.fail(f"the agent did not start: {line!r}\n{(self.workdir / 'agent.log').read_text()}")
        self.port = int(line.rsplit(":", 1)[1])
        return self

    def signal(self, sig: int, *, timeout: float = 30) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        code = self.proc.wait(timeout)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        self.proc = None
        return code

    def stop(self) -> None:
        if self.proc is not None:
            self.signal(signal.SIGTERM)

    def get(self, path: str) -> tuple[int, bytes]:
        """GET on the agent's HTTPS endpoint (its certificate is self-signed: not verified, as
        kube-apiserver does not without --kubelet-certificate-authority)."""
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        try:
            with urllib.request.urlopen(f"https://127.0.0.1:{self.port}{path}", context=ctx, timeout=10) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()


class Node:
    """A cluster, the agent serving it, and official-client APIs bound to it."""

    def __init__(self, cluster: LocalCluster | Served, agent: Agent, namespace: str) -> None:
        self.cluster, self.agent, self.namespace = cluster, agent, namespace
        self.api = config.new_client_from_config(config_file=str(cluster.kubeconfig))
        self.core = client.CoreV1Api(self.api)
        self.batch = client.BatchV1Api(self.api)

    @property
    def mode(self) -> str:
        return self.agent.mode

    def pod_of(self, job: str) -> Any:
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=f"batch.kubernetes.io/job-name={job}").items
        return pods[0] if pods else None

    def wait_pod(self, job: str, phase: str, *, timeout: float = 30) -> Any:
        return wait_for(
            lambda: (lambda p: p if p is not None and p.status.phase == phase else None)(self.pod_of(job)),
            timeout=timeout,
            what=f"the pod of {job} {phase}",
        )

    def kubectl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["kubectl", "--kubeconfig", str(self.cluster.kubeconfig), "-n", self.namespace, *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )


def _cluster_with_agent(tmp: Path, mode: str, name: str) -> Iterator[tuple[LocalCluster, Agent]]:
    with LocalCluster(mode=mode, kubelet=False, kubeconfig_path=tmp / "kubeconfig") as cluster:
        agent = Agent(cluster.kubeconfig, mode=mode, name=name, workdir=tmp / "node").start()
        try:
            yield cluster, agent
        finally:
            agent.stop()


# The real control plane too, where the tree has it (lab/realcluster/): the same tests, unchanged.
CLUSTERS = ["localcluster"] + (["realcluster"] if importlib.util.find_spec("k8s_dispatch.lab.realcluster") else [])


@dataclass
class Served:
    kubeconfig: Path
    real: bool = False


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from k8s_dispatch.lab.realcluster.controlplane import ControlPlane

    with ControlPlane(directory=tmp_path_factory.mktemp("realcluster"), mode="none") as cp:
        yield cp


@pytest.fixture(
    scope="module", params=[(c, m) for c in CLUSTERS for m in ("exec", "simulate")], ids=lambda p: f"{p[0]}-{p[1]}"
)
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, Agent]]:
    kind, mode = request.param
    tmp = tmp_path_factory.mktemp(f"{kind}-{mode}")
    if kind == "localcluster":
        for cluster, agent in _cluster_with_agent(tmp, mode, f"node-{mode}"):
            yield Served(cluster.kubeconfig), agent
        return
    from k8s_dispatch.lab.realcluster.controlplane import NODE_NAME

    cp = request.getfixturevalue("control_plane")
    agent = Agent(cp.directory / "node.kubeconfig", mode=mode, name=NODE_NAME, workdir=tmp / "node").start()
    try:
        yield Served(cp.kubeconfig, real=True), agent
    finally:
        agent.stop()


@pytest.fixture
def node(served: tuple[Served, Agent], namespace: str) -> Iterator[Node]:
    cluster, agent = served
    n = Node(cluster, agent, namespace)
    n.core.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    if cluster.real:  # a Pod is admitted once its namespace has the default ServiceAccount
        wait_for(
            lambda: n.core.list_namespaced_service_account(namespace).items,
            timeout=30,
            what="the default ServiceAccount",
        )
    try:
        yield n
    finally:
        n.core.delete_namespace(namespace)
        n.api.close()


def _job(
    name: str, mode: str, *, code: int = 0, message: str = RESULT, hang: bool = False, marks: Path | None = None
) -> dict[str, Any]:
    """A Job that does the same in both modes: prints `hello`, writes `message` as its result (or
    hangs, noting its pid and a SIGTERM in files under `marks`), exits `code`. Exec mode runs the
    command, simulate mode reads the annotations."""
    if hang:
        script = (
            "import os, signal, sys, time\n"
            "def term(*_):\n    open(os.environ['MARK'], 'w').write('TERM'); sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, term)\nopen(os.environ['MARK'] + '.pid', 'w').write(str(os.getpid()))\n"
            "print('hello', flush=True)\ntime.sleep(120)\n"
        )
    else:
        script = (
            f"import os, sys\nprint('hello', flush=True)\nif {message!r}:\n"
            f"    open(os.environ['TERMINATION_MESSAGE_PATH'], 'w').write({message!r})\nsys.exit({code})\n"
        )
    annotations = {
        SIM + "outcome": "hang" if hang else ("succeed" if code == 0 else "fail"),
        SIM + "exit-code": str(code),
        SIM + "result": message,
        SIM + "duration-ms": "300",
    }
    return job_manifest(
        name,
        command=["python", "-c", script],
        annotations=annotations if mode == "simulate" else None,
        env=[{"name": "MARK", "value": str((marks or Path("/nonexistent")) / f"{name}-{time.time_ns()}")}],
        container={"terminationMessagePolicy": "FallbackToLogsOnError"},
        backoffLimit=0,
    )


def _terminated(pod: Any) -> Any:
    return pod.status.container_statuses[0].state.terminated


# --- the node -----------------------------------------------------------------------------


def test_the_agent_registers_a_ready_node_with_its_log_port_and_a_lease(node: Node) -> None:
    got = node.core.read_node(node.agent.name)
    ready = {c.type: c.status for c in got.status.conditions}
    assert ready["Ready"] == "True" and ready["MemoryPressure"] == "False"
    assert {(a.type, a.address) for a in got.status.addresses} >= {("InternalIP", "127.0.0.1")}
    assert got.status.daemon_endpoints.kubelet_endpoint.port == node.agent.port
    assert got.status.allocatable == got.status.capacity
    assert got.status.capacity["pods"] in ("10000", "10k")  # kube-apiserver writes quantities in canonical form
    assert got.status.node_info.kubelet_version == KUBELET_VERSION
    lease = client.CoordinationV1Api(node.api).read_namespaced_lease(node.agent.name, "kube-node-lease")
    assert lease.spec.holder_identity == node.agent.name and lease.spec.lease_duration_seconds == 40
    assert lease.metadata.owner_references[0].uid == got.metadata.uid
    assert node.agent.get("/healthz") == (200, b"ok")
    listed = node.kubectl("get", "nodes", "--no-headers")
    assert listed.stdout.split()[:2] == [node.agent.name, "Ready"], listed.stderr


def test_a_job_that_succeeds_is_bound_run_and_reported_with_its_result(node: Node) -> None:
    node.batch.create_namespaced_job(node.namespace, _job("ok", node.mode))
    pod = node.wait_pod("ok", "Succeeded")
    assert pod.spec.node_name == node.agent.name
    conditions = {c.type: c.status for c in pod.status.conditions}
    assert conditions["PodScheduled"] == "True" and conditions["Ready"] == "False"
    term = _terminated(pod)
    assert (term.exit_code, term.reason, term.message) == (0, "Completed", RESULT)
    assert term.container_id.startswith("localcluster://") and term.started_at <= term.finished_at
    assert pod.status.host_ip == "127.0.0.1" and pod.status.start_time is not None
    job = wait_for(
        lambda: (lambda j: j if j.status.succeeded == 1 else None)(
            node.batch.read_namespaced_job("ok", node.namespace)
        ),
        timeout=30,
        what="the job counts its success",
    )
    assert [c.type for c in job.status.conditions if c.status == "True"][-1] == "Complete"
    expected = "hello" if node.mode == "exec" else RESULT
    logs = node.kubectl("logs", pod.metadata.name)  # proxied by the API server to the agent
    assert (logs.returncode, logs.stdout.strip()) == (0, expected), logs.stderr
    code, body = node.agent.get(f"/containerLogs/{node.namespace}/{pod.metadata.name}/main?tailLines=1&limitBytes=3")
    assert (code, body) == (200, expected.encode()[:3])


def test_a_job_that_fails_reports_its_exit_code_and_message(node: Node) -> None:
    node.batch.create_namespaced_job(node.namespace, _job("bad", node.mode, code=3, message=""))
    pod = node.wait_pod("bad", "Failed")
    term = _terminated(pod)
    assert (term.exit_code, term.reason) == (3, "Error")
    if node.mode == "exec":  # no termination message: FallbackToLogsOnError takes the log's tail
        assert term.message == "hello\n"
    wait_for(
        lambda: node.batch.read_namespaced_job("bad", node.namespace).status.failed == 1,
        timeout=30,
        what="the job counts its failure",
    )


def test_a_long_result_keeps_its_last_4_kib(node: Node) -> None:
    """As the kubelet does: the end of the file, so the start (here the `{`) is what is cut."""
    node.batch.create_namespaced_job(node.namespace, _job("long", node.mode, message="{" + "x" * 5000))
    assert _terminated(node.wait_pod("long", "Succeeded")).message == "x" * 4096


def test_deleting_a_running_pod_stops_its_container_within_the_grace_period(node: Node) -> None:
    manifest = _job("hang", node.mode, hang=True, marks=node.agent.workdir)
    mark = Path(manifest["spec"]["template"]["spec"]["containers"][0]["env"][0]["value"])
    node.batch.create_namespaced_job(node.namespace, manifest)
    pod = node.wait_pod("hang", "Running")
    running = pod.status.container_statuses[0].state.running
    assert running is not None and running.started_at is not None
    assert {c.type: c.status for c in pod.status.conditions}["Ready"] == "True"
    name = pod.metadata.name
    if node.mode == "exec":  # its SIGTERM handler is in place once it printed
        wait_for(
            lambda: node.agent.get(f"/containerLogs/{node.namespace}/{name}/main") == (200, b"hello\n"),
            timeout=30,
            what="the container's first line",
        )
    events = watch.Watch().stream(
        node.core.list_namespaced_pod,
        node.namespace,
        field_selector=f"metadata.name={name}",
        resource_version=pod.metadata.resource_version,
        timeout_seconds=30,
    )
    node.core.delete_namespaced_pod(name, node.namespace, grace_period_seconds=5)
    last = None
    for event in events:
        if event["type"] == "DELETED":
            last = event["object"]
            break
    assert last is not None, "the pod was not removed within 30 s"
    term = _terminated(last)
    if node.mode == "exec":  # SIGTERM first: the container's handler ran and exited 0
        assert mark.read_text() == "TERM" and term.exit_code == 0
    else:
        assert term.exit_code == 143
    assert last.metadata.deletion_timestamp is not None


def test_the_pods_deadline_fails_it_with_deadline_exceeded(node: Node) -> None:
    manifest = _job("late", node.mode, hang=True, marks=node.agent.workdir)
    manifest["spec"]["template"]["spec"]["activeDeadlineSeconds"] = 1
    node.batch.create_namespaced_job(node.namespace, manifest)
    pod = node.wait_pod("late", "Failed")
    assert (pod.status.reason, _terminated(pod).exit_code) == ("DeadlineExceeded", 137 if node.mode == "exec" else 143)


def test_restart_policy_on_failure_restarts_the_container(node: Node) -> None:
    manifest = _job("again", node.mode, code=5, message="")
    manifest["spec"]["backoffLimit"] = 6
    manifest["spec"]["template"]["spec"]["restartPolicy"] = "OnFailure"
    node.batch.create_namespaced_job(node.namespace, manifest)
    pod = wait_for(
        lambda: (
            lambda p: (
                p
                if p is not None and p.status.container_statuses and p.status.container_statuses[0].restart_count >= 2
                else None
            )
        )(node.pod_of("again")),
        timeout=30,
        what="two restarts",
    )
    last = pod.status.container_statuses[0].last_state.terminated
    assert last is not None and last.exit_code == 5


def test_a_container_whose_secret_is_missing_waits_then_starts_with_its_value(node: Node) -> None:
    """As the kubelet: CreateContainerConfigError with its message while the Secret is missing,
    the container started once it exists (the agent watches Secrets), the value in its env."""
    script = "import os\nopen(os.environ['TERMINATION_MESSAGE_PATH'], 'w').write(os.environ['VALUE'])\n"
    env = [{"name": "VALUE", "valueFrom": {"secretKeyRef": {"name": "input", "key": "k"}}}]
    annotations = {SIM + "result": RESULT} if node.mode == "simulate" else None
    node.batch.create_namespaced_job(
        node.namespace, job_manifest("sec", command=["python", "-c", script], env=env, annotations=annotations)
    )

    def waiting() -> Any:
        pod = node.pod_of("sec")
        statuses = (pod.status.container_statuses or []) if pod is not None else []
        return statuses[0].state.waiting if statuses and statuses[0].state.waiting else None

    held = wait_for(
        lambda: (lambda w: w if w is not None and w.reason == "CreateContainerConfigError" else None)(waiting()),
        timeout=30,
        what="the container held back",
    )
    assert held.message == 'secret "input" not found'
    assert node.pod_of("sec").spec.node_name == node.agent.name
    value = f"v-{time.time_ns()}"
    secret = {"metadata": {"name": "input"}, "stringData": {"k": value}}
    node.core.create_namespaced_secret(node.namespace, secret)
    pod = node.wait_pod("sec", "Succeeded")
    assert _terminated(pod).message == (value if node.mode == "exec" else RESULT)


# --- restarts and shutdown ----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["exec", "simulate"])
def test_after_a_crash_the_restarted_agent_fails_lost_processes_and_resumes_simulated_ones(
    tmp_path: Path, mode: str
) -> None:
    for cluster, agent in _cluster_with_agent(tmp_path, mode, "crashy"):
        n = Node(cluster, agent, "default")
        manifest = _job("cut", mode, hang=True, marks=tmp_path)
        if mode == "simulate":
            manifest["spec"]["template"]["metadata"]["annotations"].update(
                {SIM + "outcome": "succeed", SIM + "duration-ms": "3000"}
            )
        mark = Path(manifest["spec"]["template"]["spec"]["containers"][0]["env"][0]["value"])
        n.batch.create_namespaced_job("default", manifest)
        started = n.wait_pod("cut", "Running").status.container_statuses[0].state.running.started_at
        agent.signal(signal.SIGKILL)
        if mode == "exec":  # the process outlives its agent, as a container would its kubelet: end it
            pid_file = Path(str(mark) + ".pid")
            # written, not only made: the file exists a moment before the process writes its pid
            wait_for(lambda f=pid_file: f.exists() and f.read_text().strip(), what="the pid file")
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        agent.start()
        if mode == "exec":
            pod = n.wait_pod("cut", "Failed")
            term = _terminated(pod)
            assert (term.exit_code, term.reason) == (137, "ContainerStatusUnknown")
            assert {c.type: c.reason for c in pod.status.conditions}["DisruptionTarget"] == "DeletionByPodGC"
        else:
            pod = n.wait_pod("cut", "Succeeded")
            assert _terminated(pod).started_at == started  # the same container, resumed
        n.api.close()


def test_the_agent_rides_out_an_api_server_restart(tmp_path: Path) -> None:
    """The API server goes away and comes back (same ports and state, its watch history gone):
    the agent's status write waits for it, its watches reconnect and list again."""
    options: dict[str, Any] = {
        "mode": "simulate",
        "kubelet": False,
        "kubeconfig_path": tmp_path / "kubeconfig",
        "state_path": tmp_path / "state.jsonl",
    }
    first = LocalCluster(**options)
    first.start()
    agent = Agent(first.kubeconfig, mode="simulate", name="steady", workdir=tmp_path / "node").start()
    try:
        n = Node(first, agent, "default")
        before = _job("before", "simulate")
        before["spec"]["template"]["metadata"]["annotations"][SIM + "duration-ms"] = "2500"
        n.batch.create_namespaced_job("default", before)
        n.wait_pod("before", "Running")
        ports = {"port": int(first.url.rsplit(":", 1)[1]), "tls_port": int(first.https_url.rsplit(":", 1)[1])}
        first.stop()
        time.sleep(3)  # the pod ends while nothing answers
        with LocalCluster(**options, **ports, token=first.token) as second:
            n.batch.create_namespaced_job("default", _job("after", "simulate"))
            for job in ("before", "after"):
                term = _terminated(n.wait_pod(job, "Succeeded"))
                assert (term.exit_code, term.message) == (0, RESULT)
            assert second.url == first.url
            assert agent.proc is not None and agent.proc.poll() is None
            agent.stop()
        n.api.close()
    finally:
        first.stop()
        agent.stop()


def test_sigterm_stops_the_containers_removes_the_node_and_exits_0(tmp_path: Path) -> None:
    for cluster, agent in _cluster_with_agent(tmp_path, "simulate", "leaving"):
        n = Node(cluster, agent, "default")
        n.batch.create_namespaced_job("default", _job("stay", "simulate", hang=True, marks=tmp_path))
        n.wait_pod("stay", "Running")
        assert agent.signal(signal.SIGTERM) == 0
        pod = n.pod_of("stay")
        assert (pod.status.phase, pod.status.reason) == ("Failed", "Terminated")
        assert {c.type: c.reason for c in pod.status.conditions}["DisruptionTarget"] == "TerminationByKubelet"
        for read in (
            lambda n=n: n.core.read_node("leaving"),
            lambda n=n: client.CoordinationV1Api(n.api).read_namespaced_lease("leaving", "kube-node-lease"),
        ):
            with pytest.raises(client.ApiException) as e:
                read()
            assert e.value.status == 404
        n.api.close()


# --- localcluster's side: pods/binding ------------------------------------------------------


def test_binding_assigns_an_unscheduled_pod_once() -> None:
    with LocalCluster(mode="simulate", kubelet=False) as cluster:
        api = config.new_client_from_config(config_file=str(cluster.kubeconfig))
        core = client.CoreV1Api(api)
        pod = core.create_namespaced_pod(
            "default",
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "p"},
                "spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "i"}]},
            },
        )
        assert [
            p.metadata.name for p in core.list_namespaced_pod("default", field_selector="spec.nodeName=").items
        ] == ["p"]
        time.sleep(0.3)
        assert core.read_namespaced_pod("p", "default").status.phase == "Pending"  # no node runs it

        def bind(node: str, uid: str | None = None) -> tuple[int, dict[str, Any]]:
            body = {
                "apiVersion": "v1",
                "kind": "Binding",
                "metadata": {"name": "p", "uid": uid},
                "target": {"apiVersion": "v1", "kind": "Node", "name": node},
            }
            try:
                resp = core.create_namespaced_pod_binding("p", "default", body, _preload_content=False)
                return resp.status, json.loads(resp.data)
            except client.ApiException as e:
                return e.status, json.loads(e.body)

        code, status = bind("n1", uid="not-the-uid")  # the words kube-apiserver 1.36 uses
        assert (code, status["reason"], status["details"]) == (409, "Conflict", {"name": "p", "kind": "pods"})
        assert status["message"].endswith(
            f"Precondition failed: UID in precondition: not-the-uid, UID in object meta: {pod.metadata.uid}"
        )
        code, status = bind("n1", uid=pod.metadata.uid)
        assert (code, status["status"]) == (201, "Success")
        bound = core.read_namespaced_pod("p", "default")
        assert bound.spec.node_name == "n1"
        assert [(c.type, c.status) for c in bound.status.conditions] == [("PodScheduled", "True")]
        code, status = bind("n2")
        assert (code, status["reason"]) == (409, "Conflict")
        assert (
            status["message"]
            == 'Operation cannot be fulfilled on pods/binding "p": pod p is already assigned to node "n1"'
        )
        assert [
            p.metadata.name for p in core.list_namespaced_pod("default", field_selector="spec.nodeName=n1").items
        ] == ["p"]
        assert core.list_namespaced_pod("default", field_selector="spec.nodeName=").items == []
        api.close()


# --- pure ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "meta", "expected"),
    [
        ({}, {}, True),
        ({"schedulerName": "default-scheduler"}, {}, True),
        ({"nodeName": "n"}, {}, False),
        ({"schedulerName": "other"}, {}, False),
        ({"schedulingGates": [{"name": "wait"}]}, {}, False),
        ({}, {"deletionTimestamp": "2024-01-01T00:00:00Z"}, False),
    ],
)
def test_which_pods_the_agent_binds(spec: dict[str, Any], meta: dict[str, Any], expected: bool) -> None:
    assert schedulable({"metadata": meta, "spec": spec}) is expected


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        ({}, False),
        ({"phase": "Pending", "containerStatuses": [{"state": {"waiting": {"reason": "ContainerCreating"}}}]}, False),
        ({"phase": "Running"}, True),
        ({"phase": "Pending", "containerStatuses": [{"state": {"running": {}}}]}, True),
        (
            {
                "phase": "Pending",
                "containerStatuses": [
                    {"state": {"waiting": {"reason": "CrashLoopBackOff"}}, "lastState": {"terminated": {"exitCode": 1}}}
                ],
            },
            True,
        ),
    ],
)
def test_a_pod_with_no_process_is_lost_only_if_it_ever_started(status: dict[str, Any], expected: bool) -> None:
    assert has_started({"status": status}) is expected


def test_log_slice_micro_time_and_node_status() -> None:
    data = b"a\nb\nc\n"
    assert log_slice(data, tail_lines=None, limit_bytes=None) == data
    assert log_slice(data, tail_lines=2, limit_bytes=None) == b"b\nc\n"
    assert log_slice(data, tail_lines=0, limit_bytes=None) == b""
    assert log_slice(data, tail_lines=2, limit_bytes=3) == b"b\nc"
    assert micro_time(1700000000.25) == "2023-11-14T22:13:20.250000Z"
    assert parse_rfc3339(micro_time(1700000000.25)) == 1700000000.25
    status = node_status(log_port=12345, heartbeat=1700000060, started=1700000000, mode="exec")
    assert status["daemonEndpoints"] == {"kubeletEndpoint": {"Port": 12345}}
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["lastHeartbeatTime"], ready["lastTransitionTime"]) == (
        "True",
        "2023-11-14T22:14:20Z",
        "2023-11-14T22:13:20Z",
    )
