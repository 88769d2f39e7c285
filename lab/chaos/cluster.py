"""The cluster a chaos run abuses, behind one small surface: start it, restart its API server,
switch the API faults on and off, count them, and bring back a component that died by itself.

- `LocalChaosCluster`: `localcluster serve` on a state file; a restart is the process stopped and
  started on the same state; the faults are its own (`/localcluster/faults`).
- `RealChaosCluster`: the real control plane (etcd, kube-apiserver, kube-controller-manager, the
  node agent); a restart is `ControlPlane.restart_apiserver` (same port, same etcd). kube-apiserver
  has no fault injection: the workers reach it through `lab.realcluster.faultproxy`, which answers
  500/503/429 Status bodies, resets connections and loses responses after forwarding. The workers
  authenticate with a ServiceAccount token bound to `deploy/rbac.yaml`'s Role, so the real
  authorizer judges every call they make. The harness's own reads go straight to kube-apiserver
  as the admin, never through the faults.

The `_Run` of `lab.chaos.run` holds its cluster lock around every call here.
"""

from __future__ import annotations

import base64
import json
import logging
import secrets
import urllib.request
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import yaml

from k8s_dispatch.lab.kubeclient import opened
from k8s_dispatch.ops.processes import LISTENING, ManagedProcess, free_port, localcluster_server, wait_for_log

log = logging.getLogger(__name__)

LOCALCLUSTER, REALCLUSTER = "localcluster", "realcluster"
CLUSTERS = (LOCALCLUSTER, REALCLUSTER)
START_TIMEOUT_S = 90.0
RBAC_FILE = Path(__file__).resolve().parents[2] / "deploy" / "rbac.yaml"
WORKER_TOKEN_S = 24 * 3600  # the workers' ServiceAccount token: longer than any run
# kube-apiserver stops listening at SIGTERM, then waits for its open watches to end with no limit
# by default (measured: still running 60 s later, idle; ControlPlane's stop kills it after 20 s).
# Bounded, it exits in about a second: a restart is then a short outage, as localcluster's is.
APISERVER_ARGS = ("--shutdown-watch-termination-grace-period=2s",)


class ChaosCluster(Protocol):
    kind: str
    worker_kubeconfig: Path  # what the workers (and beat) use: through the faults
    fault_words: str  # what its API faults are, for the report
    harness_kubeconfig: Path  # what the harness's checks use

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def restart_api(self) -> str: ...
    def set_faults(self, rate: float, latency_ms: int) -> None: ...
    def injected(self) -> Counter[str]: ...
    def revive(self) -> list[str]: ...


def make(kind: str, *, directory: Path, mode: str, namespaces: tuple[str, ...], env: Mapping[str, str],
         ready_gate: bool = True) -> ChaosCluster:  # fmt: skip
    """The run's cluster of `kind` (not started); `ready_gate` False lets the real one's workers reach
    a kube-apiserver that is not ready yet. Raises ValueError for an unknown kind."""
    if kind == LOCALCLUSTER:
        return LocalChaosCluster(directory=directory, mode=mode, env=env)
    if kind == REALCLUSTER:
        return RealChaosCluster(directory=directory, mode=mode, namespaces=namespaces, ready_gate=ready_gate)
    raise ValueError(f"cluster must be one of {', '.join(CLUSTERS)}, got {kind!r}")


class LocalChaosCluster:
    kind = LOCALCLUSTER
    fault_words = "500/503/429"

    def __init__(self, *, directory: Path, mode: str, env: Mapping[str, str]) -> None:
        self.mode = mode
        self.worker_kubeconfig = self.harness_kubeconfig = directory / "kubeconfig"
        port = free_port()
        self.api_url = f"http://127.0.0.1:{port}"  # the faults endpoint, on the http listener
        self.proc = localcluster_server(
            log_dir=directory, kubeconfig=self.worker_kubeconfig, mode=mode, state=directory / "cluster-state.jsonl",
            port=port, tls_port=free_port(), env=env,
        )  # fmt: skip
        self.faults_now = (0.0, 0)
        self.injected_before: Counter[str] = Counter()  # by servers since restarted
        self.token = ""

    def start(self) -> None:
        self._start()
        self.token = yaml.safe_load(self.worker_kubeconfig.read_text())["users"][0]["user"]["token"]

    def _start(self) -> None:
        self.proc.start()
        wait_for_log(self.proc, LISTENING, timeout=START_TIMEOUT_S)

    def stop(self) -> None:
        self.proc.stop()

    def restart_api(self) -> str:
        self.injected_before += self._injected_now()
        self.proc.stop()
        self._restart()
        return "localcluster stopped and started again on the same state"

    def _restart(self) -> None:
        self._start()
        try:
            self.set_faults(*self.faults_now)  # a new server starts without faults
        except OSError as e:
            log.warning("could not set the API faults again after a restart: %s", e)

    def set_faults(self, rate: float, latency_ms: int) -> None:
        self.faults_now = (rate, latency_ms)
        self._call({"rate": rate, "latency_ms": latency_ms})

    def injected(self) -> Counter[str]:
        return self.injected_before + self._injected_now()

    def _injected_now(self) -> Counter[str]:
        # localcluster counts its injected errors (500/503/429), not which was which
        return Counter({"status": int(self._call(None).get("injected", 0))})

    def revive(self) -> list[str]:
        if self.proc.alive:
            return []
        note = f"localcluster exited by itself with code {self.proc.returncode} (restarted)"
        log.warning("%s\n%s", note, self.proc.log_tail(20))
        self._restart()
        return [note]

    def _call(self, body: dict[str, Any] | None) -> dict[str, Any]:
        request = urllib.request.Request(
            f"{self.api_url}/localcluster/faults",
            data=json.dumps(body).encode() if body is not None else None,
            method="POST" if body is not None else "GET",
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            return dict(json.loads(response.read()))


class RealChaosCluster:
    kind = REALCLUSTER
    fault_words = "500/503/429, connection reset, response lost after forwarding"

    def __init__(self, *, directory: Path, mode: str, namespaces: tuple[str, ...], ready_gate: bool = True) -> None:
        from k8s_dispatch.lab.realcluster.controlplane import ControlPlane

        self.mode = mode
        self.ready_gate = ready_gate
        self.namespaces = namespaces
        self.namespace = namespaces[0]  # the workers' ServiceAccount lives here
        self.directory = directory
        self.plane = ControlPlane(directory=directory / "realcluster", mode=mode, apiserver_args=APISERVER_ARGS)
        self.harness_kubeconfig = self.plane.kubeconfig
        self.worker_kubeconfig = directory / "worker.kubeconfig"
        self.proxy_token_file = directory / "faultproxy.token"
        self.proxy: ManagedProcess | None = None
        self.proxy_url = ""
        self.faults_now = (0.0, 0)

    def start(self) -> None:
        from k8s_dispatch.lab.realcluster import faultproxy

        self.plane.start()
        token = self._worker_identity()
        self.proxy_token_file.write_text(secrets.token_urlsafe(24))
        self.proxy_token_file.chmod(0o600)
        port = free_port()
        self.proxy_url = f"https://127.0.0.1:{port}"
        self.proxy = faultproxy.process(self.plane, port=port, token_file=self.proxy_token_file, log_dir=self.directory,
                                        ready_gate=self.ready_gate)  # fmt: skip
        self._start_proxy()
        self._write_worker_kubeconfig(token)

    def _start_proxy(self) -> None:
        from k8s_dispatch.lab.realcluster import faultproxy

        assert self.proxy is not None
        self.proxy.start()
        wait_for_log(self.proxy, faultproxy.LISTENING, timeout=START_TIMEOUT_S)

    def _worker_identity(self) -> str:
        """The namespaces; deploy/rbac.yaml's ServiceAccount in the first, its Role and RoleBinding
        (to that ServiceAccount) in each; the ServiceAccount's token. Raises RuntimeError:
        kube-apiserver refused one of them."""
        from kubernetes import client

        try:
            return self._create_worker_identity()
        except client.ApiException as e:
            raise RuntimeError(f"setting up the workers' identity in {self.namespace}: {e.status} {e.reason}: "
                               f"{e.body!r}") from e  # fmt: skip

    def _create_worker_identity(self) -> str:
        from kubernetes import client

        with opened(self.plane.kubeconfig) as api:
            core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
            account = ""
            for namespace in self.namespaces:
                core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
                for doc in yaml.safe_load_all(RBAC_FILE.read_text()):
                    if doc["kind"] == "ServiceAccount" and namespace != self.namespace:
                        continue
                    doc["metadata"]["namespace"] = namespace
                    for subject in doc.get("subjects") or []:
                        subject["namespace"] = self.namespace
                    # each takes the YAML's dict as its body (the client validates it into its model)
                    creators: dict[str, Callable[..., object]] = {
                        "ServiceAccount": core.create_namespaced_service_account,
                        "Role": rbac.create_namespaced_role,
                        "RoleBinding": rbac.create_namespaced_role_binding,
                    }
                    creators[doc["kind"]](namespace, doc)
                    if doc["kind"] == "ServiceAccount":
                        account = doc["metadata"]["name"]
            request = client.AuthenticationV1TokenRequest(
                spec=client.V1TokenRequestSpec(expiration_seconds=WORKER_TOKEN_S)
            )
            status = core.create_namespaced_service_account_token(account, self.namespace, request).status
            if status is None or not status.token:
                raise RuntimeError(f"kube-apiserver issued no token for {account} in {self.namespace}")
            return status.token

    def _write_worker_kubeconfig(self, token: str) -> None:
        from k8s_dispatch.lab.realcluster.controlplane import User, kubeconfig_text

        ca_data = base64.b64encode((self.plane.directory / "pki" / "ca.crt").read_bytes()).decode()
        user = User("k8s-dispatch-worker", token)
        self.worker_kubeconfig.write_text(kubeconfig_text(self.proxy_url, ca_data, user, namespace=self.namespace))
        self.worker_kubeconfig.chmod(0o600)

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        self.plane.stop()

    def restart_api(self) -> str:
        # As a control-plane upgrade does: kube-apiserver, then kube-controller-manager. With
        # kube-apiserver alone, the 1.36 Job controller was seen (2 runs in 6) to leave a Job
        # whose failed Pod was deleted (held by our finalizer) across the restart without its
        # Failed condition for good, its stale-read guard ("read version ... is not as new as
        # written version") never passing, until kube-controller-manager restarted: a fault
        # of the controller's the product cannot repair (README, the chaos test).
        self.plane.restart_apiserver()
        self.plane.restart_controller_manager()
        return "kube-apiserver and kube-controller-manager stopped and started again (same port, same etcd)"

    def set_faults(self, rate: float, latency_ms: int) -> None:
        self.faults_now = (rate, latency_ms)
        self._call({"rate": rate, "latency_ms": latency_ms})

    def injected(self) -> Counter[str]:
        # The proxy is not a fault target: it runs for the whole run (one that died by itself
        # takes its counts with it, and says so in the unexpected exits).
        return Counter(self._call(None).get("by_kind") or {})

    def revive(self) -> list[str]:
        notes = []
        for name, proc in self.plane.processes.items():
            if not proc.alive:
                notes.append(f"{name} exited by itself with code {proc.returncode} (restarted)")
                log.warning("%s\n%s", notes[-1], proc.log_tail(20))
                if name == "kube-apiserver":
                    self.plane.restart_apiserver()  # starts it and waits until it is ready
                else:
                    proc.start()
        if self.proxy is not None and not self.proxy.alive:
            notes.append(f"faultproxy exited by itself with code {self.proxy.returncode} (restarted)")
            log.warning("%s\n%s", notes[-1], self.proxy.log_tail(20))
            self._start_proxy()
            try:
                self.set_faults(*self.faults_now)
            except OSError as e:
                log.warning("could not set the API faults again after a restart: %s", e)
        return notes

    def _call(self, settings: dict[str, Any] | None) -> dict[str, Any]:
        from k8s_dispatch.lab.realcluster import faultproxy

        return faultproxy.call(self.proxy_url, token=self.proxy_token_file.read_text().strip(),
                               ca_file=self.plane.directory / "pki" / "ca.crt", settings=settings)  # fmt: skip
