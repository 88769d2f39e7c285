"""Kueue's controller (`sigs.k8s.io/kueue/cmd/kueue`, built by `tools/build.sh kueue`) against a
running `ControlPlane`, for the tests that check a capability's `queue:` end to end.

    with ControlPlane(directory=tmp) as cp, Kueue(cp, directory=tmp / "kueue") as kueue:
        ...  # create a ResourceFlavor, ClusterQueue and LocalQueue; dispatch to the queue

Kueue's CRDs are read from its module in Go's module cache at start (never copied here). It runs
as the control plane's admin, its webhooks served but not registered: our Jobs are created
suspended and labelled already, which is all Kueue's Job webhook would add. Kueue reads its
metrics certificate from the fixed path /etc/kueue/metrics/certs, so it runs in a mount namespace
of its own with /etc overlaid by a directory of ours: the machine's /etc is never written.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config

from k8s_dispatch.lab.realcluster import binaries
from k8s_dispatch.lab.realcluster.controlplane import ControlPlane, ControlPlaneFailed
from k8s_dispatch.ops.processes import ManagedProcess, free_port, project_env, wait_until

GROUP = "kueue.x-k8s.io"
VERSION = "v1beta2"  # the version Kueue stores; the test's objects are written in it
NAMESPACE = "kueue-system"
MODULE = "sigs.k8s.io/kueue"
METRICS_CERTS = "kueue/metrics/certs"  # under /etc: where Kueue's main reads them, not configurable
WRAPPER = Path(__file__).resolve().parents[2] / "tools" / "kueue"


def crd_directory() -> Path:
    """config/components/crd/bases of the Kueue module the wrapper pins, in Go's module cache."""
    env = {**os.environ, "GOFLAGS": "-mod=mod", "GOTOOLCHAIN": os.environ.get("GOTOOLCHAIN", "local")}
    result = subprocess.run(
        ["go", "list", "-m", "-f", "{{.Dir}}", MODULE], cwd=WRAPPER, env=env, capture_output=True, text=True
    )
    if result.returncode != 0 or not result.stdout.strip():
        raise ControlPlaneFailed(f"go list -m {MODULE} failed: {result.stderr.strip()}")
    return Path(result.stdout.strip()) / "config" / "components" / "crd" / "bases"


def configuration(*, webhook_port: int, health_port: int, cert_dir: Path) -> dict[str, Any]:
    """Kueue's Configuration: one replica (no leader election), only Jobs with a queue label
    managed, no certificate management of its own, metrics off."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": NAMESPACE,
        "manageJobsWithoutQueueName": False,
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(cert_dir)},
        "integrations": {"frameworks": ["batch/job"]},
        "clientConnection": {"qps": 100, "burst": 200},
    }


class Kueue:
    """One Kueue controller process on `plane`; its files and log under `directory`."""

    def __init__(self, plane: ControlPlane, *, directory: Path, ready_timeout: float = 120.0) -> None:
        self.plane = plane
        self.directory = Path(directory)
        self.ready_timeout = ready_timeout
        self.process: ManagedProcess | None = None
        self._health = 0

    def __enter__(self) -> Kueue:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Build Kueue if needed, install its CRDs, start it, wait until it is ready. Raises
        ControlPlaneFailed (with its log's tail) or binaries.BuildFailed."""
        program = binaries.build("kueue") / "kueue"
        self.directory.mkdir(parents=True, exist_ok=True)
        self.install_crds()
        serving = self.directory / "serving-certs"
        etc_upper = self.directory / "etc" / "upper"
        _self_signed(serving, "tls")
        _self_signed(etc_upper / METRICS_CERTS, "tls")
        (self.directory / "etc" / "work").mkdir(parents=True, exist_ok=True)
        self._health = free_port()
        cfg = self.directory / "config.yaml"
        cfg.write_text(
            yaml.safe_dump(configuration(webhook_port=free_port(), health_port=self._health, cert_dir=serving))
        )
        overlay = f"lowerdir=/etc,upperdir={etc_upper},workdir={self.directory / 'etc' / 'work'}"
        argv = [
            "unshare", "--mount", "--propagation", "private", "sh", "-c",
            f'mount -t overlay overlay -o {overlay} /etc && exec "$0" "$@"',
            str(program), f"--config={cfg}", f"--kubeconfig={self.plane.kubeconfig}",
            "--feature-gates=VisibilityOnDemand=false", "--zap-log-level=info",
        ]  # fmt: skip
        self.process = ManagedProcess("kueue", argv, project_env({}), self.directory / "kueue.log").start()
        self._wait_ready()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop(timeout=20)
            self.process = None

    def log_tail(self, lines: int = 40) -> str:
        return self.process.log_tail(lines) if self.process is not None else ""

    def install_crds(self) -> None:
        """Create Kueue's CRDs (kept if there) and its namespace; wait until every CRD is Established."""
        with config.new_client_from_config(config_file=str(self.plane.kubeconfig)) as api:
            extensions = client.ApiextensionsV1Api(api)
            names = []
            for path in sorted(crd_directory().glob("*.yaml")):
                for doc in yaml.safe_load_all(path.read_text()):
                    if not doc:
                        continue
                    names.append(doc["metadata"]["name"])
                    try:
                        extensions.create_custom_resource_definition(doc)
                    except client.ApiException as e:
                        if e.status != 409:
                            raise
            try:
                client.CoreV1Api(api).create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=NAMESPACE)))
            except client.ApiException as e:
                if e.status != 409:
                    raise

            def established() -> bool:
                for name in names:
                    crd = extensions.read_custom_resource_definition(name)
                    conditions = (crd.status.conditions if crd.status else None) or []
                    if not any(c.type == "Established" and c.status == "True" for c in conditions):
                        return False
                return True

            wait_until(established, timeout=self.ready_timeout, interval=0.2, what="Kueue's CRDs Established")

    def _wait_ready(self) -> None:
        import urllib.error
        import urllib.request

        def ready() -> bool:
            if self.process is None or not self.process.alive:
                code = None if self.process is None else self.process.returncode
                raise ControlPlaneFailed(f"kueue exited ({code}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self._health}/readyz", timeout=2) as resp:
                    return bool(resp.status == 200)
            except (urllib.error.URLError, OSError):
                return False

        try:
            wait_until(ready, timeout=self.ready_timeout, interval=0.3, what="kueue /readyz")
        except TimeoutError as e:
            raise ControlPlaneFailed(f"{e}\n{self.log_tail()}") from e


def _self_signed(directory: Path, stem: str) -> None:
    """A self-signed certificate for 127.0.0.1 (`stem`.crt, `stem`.key): nothing verifies it (no
    webhook is registered, metrics are off), but Kueue will not start without one."""
    directory.mkdir(parents=True, exist_ok=True)
    openssl = shutil.which("openssl")
    if openssl is None:
        raise ControlPlaneFailed("the openssl command is not installed")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    key, cert = directory / f"{stem}.key", directory / f"{stem}.crt"
    argv = [openssl, "req", "-x509", *ec, "-keyout", str(key), "-out", str(cert), "-days", "30", "-subj", "/CN=kueue"]
    argv += ["-addext", "subjectAltName=IP:127.0.0.1"]
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise ControlPlaneFailed(f"openssl req failed: {result.stderr.strip()}")
