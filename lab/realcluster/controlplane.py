"""Start, restart and stop a real control plane on loopback: etcd, kube-apiserver (TLS from our own
CA, static-token authentication, RBAC authorization) and kube-controller-manager with the Job,
garbage-collector, TTL-after-finished, ServiceAccount, namespace and Pod-GC controllers, plus a node:
localcluster's node agent (`node="agent"`, the default: no scheduler, the agent binds the Pods), or
a real one (`node="kubelet"`: kube-scheduler, the kubelet and containerd, `lab/realcluster/node.py`,
with the node lifecycle and root-CA publisher controllers a kubelet's Pods need, and the Deployment,
ReplicaSet and disruption controllers the Helm chart's workloads and PodDisruptionBudget need). With
`nodes=2` (or `add_kubelet_node()` on a running plane) a second kubelet node runs beside the first,
each with its own containerd: a drain of one moves its Pods to the other.

    with ControlPlane(directory=tmp, mode="simulate") as cp:
        config.load_kube_config(config_file=str(cp.kubeconfig))

Every process is a real subprocess with its own log in `directory/logs`; free ports are picked at
start and kept, so a restarted kube-apiserver comes back at the same URL on the same etcd.
"""

from __future__ import annotations

import json
import secrets
import shutil
import ssl
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from k8s_dispatch.demo.localcluster import kubeconfig as kubeconfig_file
from k8s_dispatch.lab.realcluster import binaries, pki
from k8s_dispatch.lab.realcluster.node import Node
from k8s_dispatch.ops.processes import ManagedProcess, free_port, project_env, wait_until

CONTEXT = "realcluster"
NODE_NAME = "k8s-dispatch-node"
MAX_NODES = 4  # kubelet nodes one plane can run: their users are in the token file kube-apiserver reads once
SERVICE_CIDR = "10.96.0.0/24"  # only a setting: nothing is ever sent to it
CONTROLLERS = "job,garbagecollector,ttl-after-finished,serviceaccount,serviceaccount-token,namespace,podgc"
# A kubelet's node also needs its not-ready taint lifted and `kube-root-ca.crt` in every namespace
# (a ServiceAccount token volume mounts it); the chart installed on it (tests/realcluster's product
# image) runs Deployments, and a drain's evictions are judged against its PodDisruptionBudget,
# whose status only the disruption controller writes (without it every eviction is refused).
KUBELET_CONTROLLERS = CONTROLLERS + ",nodelifecycle,root-ca-cert-publisher,deployment,replicaset,disruption"
NODE_KINDS = ("agent", "kubelet")
UNINITIALIZED_TAINT = "node.cloudprovider.kubernetes.io/uninitialized"  # the kubelet's, with an external cloud provider


def node_name(index: int) -> str:
    """The name of the plane's `index`-th node (0: NODE_NAME, the only one unless more are asked for)."""
    return NODE_NAME if index == 0 else f"{NODE_NAME}-{index + 1}"


class ControlPlaneFailed(RuntimeError):
    """A component did not start or become ready; the message carries its log's tail."""


@dataclass(frozen=True)
class User:
    name: str
    token: str
    groups: tuple[str, ...] = ()


def kubeconfig_text(url: str, ca_data: str, user: User, *, namespace: str = "default") -> str:
    doc = {
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": CONTEXT, "cluster": {"server": url, "certificate-authority-data": ca_data}}],
        "users": [{"name": user.name, "user": {"token": user.token}}],
        "contexts": [{"name": CONTEXT, "context": {"cluster": CONTEXT, "user": user.name, "namespace": namespace}}],
        "current-context": CONTEXT, "preferences": {},
    }  # fmt: skip
    return yaml.safe_dump(doc, sort_keys=False)


def token_file_text(users: list[User]) -> str:
    """kube-apiserver's --token-auth-file: token,user,uid,"group1,group2"."""
    return "".join(f'{u.token},{u.name},{u.name},"{",".join(u.groups)}"\n' for u in users)


@dataclass
class ControlPlane:
    directory: Path
    mode: str = "simulate"  # the node agent's: exec | simulate | none (no node: Pods stay Pending)
    node: str = "agent"  # agent | kubelet (kube-scheduler, the kubelet and containerd: real containers)
    nodes: int = 1  # kubelet nodes started with the plane (node="kubelet" only), at most MAX_NODES
    pod_gc_threshold: int = 12500  # --terminated-pod-gc-threshold (Kubernetes' default)
    kube_api_qps: int = 400  # the controller manager's client budget: the Job controller creates Pods with it
    max_running: int | None = None  # the agent's exec-mode processes at once (None: its default, 2 per CPU)
    apiserver_args: tuple[str, ...] = ()
    ready_timeout: float = 120.0
    admin: User = field(default_factory=lambda: User("admin", secrets.token_urlsafe(24), ("system:masters",)))
    processes: dict[str, ManagedProcess] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.directory = Path(self.directory)
        self.logs = self.directory / "logs"
        self.kubeconfig = self.directory / "admin.kubeconfig"
        self._ports: dict[str, int] = {}
        self._ctx: ssl.SSLContext | None = None
        self._keys: pki.Pki | None = None
        self._node_kubeconfigs: list[Path] = []
        self._nodes_made = 0  # a removed node's name and directory are never reused
        self.kubelet_nodes: list[Node] = []
        if self.node not in NODE_KINDS:
            raise ValueError(f"node must be one of {NODE_KINDS}, not {self.node!r}")
        if not 1 <= self.nodes <= (MAX_NODES if self.node == "kubelet" else 1):
            raise ValueError(f"nodes must be 1 for the agent, 1 to {MAX_NODES} for kubelet nodes, not {self.nodes}")

    # --- the public surface ----------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self._ports['apiserver']}"

    @property
    def token(self) -> str:
        return self.admin.token

    @property
    def kubelet_node(self) -> Node | None:
        """The first kubelet node (NODE_NAME), None with the agent or once stopped."""
        return self.kubelet_nodes[0] if self.kubelet_nodes else None

    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Build what is missing, then start and wait for every component. Raises ControlPlaneFailed."""
        bins = binaries.control_plane()
        self.directory.mkdir(parents=True, exist_ok=True)
        keys = self._keys = pki.make(self.directory / "pki")
        self._ctx = ssl.create_default_context(cafile=str(keys.ca_cert))
        self._ports = {"etcd": free_port(), "etcd_peer": free_port(), "apiserver": free_port()}
        controller_manager = User("system:kube-controller-manager", secrets.token_urlsafe(24))
        node_users = [
            User(f"system:node:{node_name(i)}", secrets.token_urlsafe(24), ("system:nodes", "system:masters"))
            for i in range(MAX_NODES)
        ]
        scheduler = User("system:kube-scheduler", secrets.token_urlsafe(24))
        (self.directory / "tokens.csv").write_text(
            token_file_text([self.admin, controller_manager, *node_users, scheduler])
        )
        self._write_kubeconfig(self.kubeconfig, keys, self.admin)
        cm_kubeconfig = self._write_kubeconfig(
            self.directory / "controller-manager.kubeconfig", keys, controller_manager
        )
        self._node_kubeconfigs = [
            self._write_kubeconfig(self.directory / f"{'node' if i == 0 else f'node-{i + 1}'}.kubeconfig", keys, user)
            for i, user in enumerate(node_users)
        ]
        try:
            self._start_etcd(bins)
            self._start_apiserver(bins, keys)
            self._start_controller_manager(bins, keys, cm_kubeconfig)
            if self.node == "kubelet":
                self._start_scheduler(self._write_kubeconfig(self.directory / "scheduler.kubeconfig", keys, scheduler))
                for _ in range(self.nodes):
                    self.add_kubelet_node()
            elif self.mode != "none":
                self._start_node(self._node_kubeconfigs[0])
        except BaseException:
            self.stop()
            raise

    def restart_apiserver(self) -> None:
        """Stop kube-apiserver and start it again on the same port and etcd (what an upgrade or a
        crash does to clients); returns once it is ready."""
        proc = self.processes["kube-apiserver"]
        proc.stop(timeout=20)
        proc.start()
        self._wait_ready(proc)

    def restart_controller_manager(self) -> None:
        """Stop kube-controller-manager and start it again (its informers list everything anew)."""
        proc = self.processes["kube-controller-manager"]
        proc.stop(timeout=20)
        proc.start()

    def add_kubelet_node(self) -> Node:
        """Start one more kubelet node (its own containerd, kubelet, bridge and Pod subnet) and wait
        until Pods can land on it. Raises ControlPlaneFailed on an agent's plane or past MAX_NODES,
        NodeFailed if it does not start (having removed what it made)."""
        if self.node != "kubelet" or self._keys is None:
            raise ControlPlaneFailed("kubelet nodes join a started plane with node='kubelet'")
        index = self._nodes_made
        if index >= MAX_NODES:
            raise ControlPlaneFailed(f"a plane runs at most {MAX_NODES} kubelet nodes over its life")
        self._nodes_made += 1
        name = node_name(index)
        node = Node(
            directory=self.directory / ("node" if index == 0 else f"node-{index + 1}"), name=name,
            kubeconfig=self._node_kubeconfigs[index], ca_cert=self._keys.ca_cert, bins=binaries.node(),
            node_ready=lambda: self._node_schedulable(name), ready_timeout=self.ready_timeout,
        )  # fmt: skip
        node.start()
        self.kubelet_nodes.append(node)
        return node

    def remove_kubelet_node(self, node: Node) -> None:
        """Stop `node` (removing what it made on the host) and delete its Node object: Pods still
        bound to it are then the Pod GC controller's, as after a node's real loss."""
        self.kubelet_nodes.remove(node)
        node.stop()
        status, body = self.request("DELETE", f"/api/v1/nodes/{node.name}")
        if status not in (200, 404):
            raise ControlPlaneFailed(f"deleting node {node.name}: {status} {body[:300]!r}")

    def stop(self) -> None:
        """Stop every component, the nodes first (each stops its containers; the first node last,
        as it made the host directories the nodes share), etcd last."""
        while self.kubelet_nodes:
            self.kubelet_nodes.pop().stop()
        for name in ("node", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"):
            proc = self.processes.pop(name, None)
            if proc is not None:
                proc.stop(timeout=20)

    def all_processes(self) -> dict[str, ManagedProcess]:
        """Every running component, the kubelet nodes' containerd and kubelet included (a node
        after the first named `<node name>/containerd`, `<node name>/kubelet`)."""
        procs = dict(self.processes)
        for i, node in enumerate(self.kubelet_nodes):
            procs.update({name if i == 0 else f"{node.name}/{name}": p for name, p in node.processes.items()})
        return procs

    def logs_tail(self, lines: int = 30) -> str:
        return "\n".join(f"--- {name}\n{p.log_tail(lines)}" for name, p in self.all_processes().items())

    def get(self, path: str, *, timeout: float = 5.0) -> tuple[int, bytes]:
        """An authenticated GET as the admin: (status, body). For readiness checks and tests."""
        return self.request("GET", path, timeout=timeout)

    def request(
        self, method: str, path: str, body: Any = None, *, content_type: str = "application/json", timeout: float = 5.0
    ) -> tuple[int, bytes]:
        """One authenticated request as the admin, `body` sent as JSON: (status, body); 0 when unreachable."""
        headers = {"Authorization": f"Bearer {self.admin.token}", "Content-Type": content_type}
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=self._ctx) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
        except (urllib.error.URLError, OSError):
            return 0, b""

    # --- components ----------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> ManagedProcess:
        proc = ManagedProcess(name, argv, project_env({}), self.logs / f"{name}.log").start()
        self.processes[name] = proc
        return proc

    def _wait(self, proc: ManagedProcess, condition: Any, what: str) -> None:
        def check() -> Any:
            if not proc.alive:
                raise ControlPlaneFailed(f"{proc.name} exited ({proc.returncode}):\n{proc.log_tail(40)}")
            return condition()

        try:
            wait_until(check, timeout=self.ready_timeout, interval=0.2, what=what)
        except TimeoutError as e:
            raise ControlPlaneFailed(f"{e}\n{proc.log_tail(40)}") from e

    def _start_etcd(self, bins: binaries.Binaries) -> None:
        client = f"http://127.0.0.1:{self._ports['etcd']}"
        peer = f"http://127.0.0.1:{self._ports['etcd_peer']}"
        proc = self._spawn("etcd", [
            str(bins.etcd), "--name=default", f"--data-dir={self.directory / 'etcd'}",
            f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=default={peer}", "--log-level=warn",
            # a test cluster's data is thrown away: fsync buys nothing and costs every write
            "--unsafe-no-fsync=true",
            "--quota-backend-bytes=8589934592",
        ])  # fmt: skip

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=2) as resp:
                    return bool(json.loads(resp.read()).get("health") == "true")
            except (urllib.error.URLError, OSError, ValueError):
                return False

        self._wait(proc, healthy, "etcd /health")

    def _start_apiserver(self, bins: binaries.Binaries, keys: pki.Pki) -> None:
        kubelet_client: list[str] = []
        if self.node == "kubelet":  # pods/log, exec and port-forward are forwarded to the kubelet
            cert, key = pki.client_cert(keys, "apiserver-kubelet-client", common_name="kube-apiserver-kubelet-client",
                                        organization="system:masters")  # fmt: skip
            kubelet_client = [f"--kubelet-client-certificate={cert}", f"--kubelet-client-key={key}"]
        proc = self._spawn("kube-apiserver", [
            str(bins.kube_apiserver),
            f"--etcd-servers=http://127.0.0.1:{self._ports['etcd']}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={self._ports['apiserver']}",
            f"--tls-cert-file={keys.server_cert}", f"--tls-private-key-file={keys.server_key}",
            f"--client-ca-file={keys.ca_cert}",
            f"--token-auth-file={self.directory / 'tokens.csv'}",
            "--authorization-mode=RBAC", "--anonymous-auth=false",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={keys.sa_pub}", f"--service-account-signing-key-file={keys.sa_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--kubelet-preferred-address-types=InternalIP",
            "--endpoint-reconciler-type=none",
            # on SIGTERM it would wait for open watches with no limit: a restart would take 20 s
            "--shutdown-watch-termination-grace-period=2s",
            f"--cert-dir={self.directory / 'apiserver-certs'}",
            *kubelet_client,
            *self.apiserver_args,
        ])  # fmt: skip
        self._wait_ready(proc)

    def _wait_ready(self, proc: ManagedProcess) -> None:
        self._wait(proc, lambda: self.get("/readyz")[0] == 200, "kube-apiserver /readyz")

    def _start_controller_manager(self, bins: binaries.Binaries, keys: pki.Pki, kubeconfig: Path) -> None:
        proc = self._spawn("kube-controller-manager", [
            str(bins.kube_controller_manager),
            f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            f"--controllers={KUBELET_CONTROLLERS if self.node == 'kubelet' else CONTROLLERS}",
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={keys.sa_key}", f"--root-ca-file={keys.ca_cert}",
            "--leader-elect=false", "--bind-address=127.0.0.1", "--secure-port=0",
            f"--terminated-pod-gc-threshold={self.pod_gc_threshold}",
            f"--kube-api-qps={self.kube_api_qps}", f"--kube-api-burst={2 * self.kube_api_qps}",
            "--concurrent-job-syncs=20",
        ])  # fmt: skip
        # The ServiceAccount controller has run once a namespace has its `default` account, and
        # the Job controller starts with it: until then a Pod could not even be admitted.
        self._wait(
            proc,
            lambda: self.get("/api/v1/namespaces/default/serviceaccounts/default")[0] == 200,
            "the default ServiceAccount (kube-controller-manager running)",
        )

    def _start_scheduler(self, kubeconfig: Path) -> None:
        """kube-scheduler, no leader election, no port: the kubelet node's Pods are bound by it."""
        self._spawn("kube-scheduler", [
            str(binaries.kube_scheduler()), f"--kubeconfig={kubeconfig}", "--leader-elect=false", "--secure-port=0",
        ])  # fmt: skip

    def _node_schedulable(self, name: str) -> bool:
        """Ready, initialised, and the node lifecycle controller has lifted the not-ready taint:
        Pods can land on node `name` (polled; initialises the Node when it sees it uninitialised)."""
        status, body = self.get(f"/api/v1/nodes/{name}")
        if status != 200:
            return False
        node = json.loads(body)
        if self._initialize_node(node):
            return False  # look again at what the patch made
        conditions = node.get("status", {}).get("conditions") or []
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
        return ready and not node.get("spec", {}).get("taints")

    def _initialize_node(self, node: dict[str, Any]) -> bool:
        """What a cloud node controller does for a kubelet run with `--cloud-provider=external`: the
        kubelet refuses a loopback `--node-ip`, and kube-apiserver reaches a kubelet (pods/log) only
        at a Node address, so we set InternalIP 127.0.0.1, then lift the `uninitialized` taint.
        Each patch carries the resourceVersion read (a 409 is retried by the next poll). True if
        it patched."""
        name = node["metadata"]["name"]
        path = f"/api/v1/nodes/{name}"
        rv = node["metadata"]["resourceVersion"]
        addresses = node.get("status", {}).get("addresses") or []
        if not any(a.get("type") == "InternalIP" for a in addresses):
            wanted = [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": name}]
            patch = {"metadata": {"resourceVersion": rv}, "status": {"addresses": wanted}}
            self.request("PATCH", path + "/status", patch, content_type="application/merge-patch+json")
            return True
        taints = node.get("spec", {}).get("taints") or []
        kept = [t for t in taints if t.get("key") != UNINITIALIZED_TAINT]
        if len(kept) != len(taints):
            patch = {"metadata": {"resourceVersion": rv}, "spec": {"taints": kept or None}}
            self.request("PATCH", path, patch, content_type="application/merge-patch+json")
            return True
        return False

    def _start_node(self, kubeconfig: Path) -> None:
        workdir = self.directory / "node"
        proc = self._spawn("node", [
            sys.executable, "-m", "k8s_dispatch.demo.localcluster", "node", "--kubeconfig", str(kubeconfig), "--mode", self.mode,
            "--name", NODE_NAME, "--workdir", str(workdir), "--log-port", str(free_port()),
            *(["--max-running", str(self.max_running)] if self.max_running is not None else []),
        ])  # fmt: skip

        def ready() -> bool:
            status, body = self.get(f"/api/v1/nodes/{NODE_NAME}")
            if status != 200:
                return False
            conditions = json.loads(body).get("status", {}).get("conditions") or []
            return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)

        self._wait(proc, ready, f"node {NODE_NAME} Ready")

    def _write_kubeconfig(self, path: Path, keys: pki.Pki, user: User) -> Path:
        return kubeconfig_file.write_private(path, kubeconfig_text(self.url, keys.ca_data(), user))


def remove(directory: Path) -> None:
    """Remove a stopped control plane's files (etcd's data, keys, logs)."""
    shutil.rmtree(directory, ignore_errors=True)


def serve(directory: Path, *, kubeconfig: Path | None, mode: str, node: str = "agent", nodes: int = 1) -> int:
    """`realcluster serve`: start, copy the admin kubeconfig, wait for a signal, stop, clean up."""
    import signal

    stop = {"now": False}

    def on_signal(signum: int, frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    cp = ControlPlane(directory=directory, mode=mode, node=node, nodes=nodes)
    try:
        cp.start()
        if kubeconfig is not None:
            kubeconfig_file.write_private(kubeconfig, cp.kubeconfig.read_text())
        print(
            f"realcluster: kube-apiserver listening on {cp.url} (kubeconfig {kubeconfig or cp.kubeconfig})", flush=True
        )
        while not stop["now"] and all(p.alive for p in cp.all_processes().values()):
            time.sleep(0.2)
        dead = [n for n, p in cp.all_processes().items() if not p.alive]
        if dead:
            print(f"realcluster: {', '.join(dead)} exited:\n{cp.logs_tail()}", file=sys.stderr)
            return 1
        return 0
    finally:
        cp.stop()
        if kubeconfig is not None:
            kubeconfig.unlink(missing_ok=True)
        remove(directory)
