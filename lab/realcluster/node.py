"""A real node for the control plane: containerd 2.x (CRI, runc, the overlayfs snapshotter, a CNI
bridge) and the kubelet, with our own images imported at start. Everything it makes on the host
(mounts, network namespaces, cgroups, the bridge, containers) it removes again on `stop()`, even
after a crash of the kubelet or containerd.

Host settings it needs (checked at start, each failure a NodeFailed saying what to do): root; runc,
the CNI plugins and busybox-static from Debian (`tools/build.sh containerd` installs them); cgroup
v1 (this machine) or v2. On cgroup v1 the kubelet needs `failCgroupV1: false`; without
CAP_SYS_RESOURCE no container may lower its oom_score_adj, so containerd runs at `oom_score = 1000`
with `restrict_oom_score_adj` (every container then gets 1000, which only raises).

No image pull leaves the machine: every registry is sent to a loopback port we hold bound and never
listen on, so a missing image fails here with `connection refused`.

Several nodes can run on one host (`ControlPlane(nodes=2)`): each has its own containerd (root,
state, sockets), kubelet (port, root, certificate and Pod-log directories), cgroup root, bridge and
Pod subnet. What they share is keyed apart: the shims' sockets in SHIM_SOCKETS by a hash of their
containerd's address, libcni's cache entries by network name and sandbox id, the log links in
CONTAINER_LOGS by container id. One path is shared for real: the kubelet's device-plugin socket
(/var/lib/kubelet/device-plugins, a constant of the kubelet): the last kubelet started holds it,
which costs nothing while no device plugin registers (none does here).
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from k8s_dispatch.lab.realcluster import images
from k8s_dispatch.lab.realcluster.binaries import NodeBinaries
from k8s_dispatch.ops.processes import ManagedProcess, free_port, project_env, wait_until

RUNC = Path("/usr/sbin/runc")
CNI_BIN = Path("/usr/lib/cni")
BUSYBOX = Path("/bin/busybox")
CNI_CACHE = Path("/var/lib/cni")  # libcni's result cache: a path containerd does not let us move
CONTAINER_LOGS = Path("/var/log/containers")  # the kubelet's symlinks, a path it does not let us move
SHIM_SOCKETS = Path("/run/containerd")  # the runc shim's sockets: fixed for root (unix socket paths are short)
PODS_NETWORK = "10.88.0.0/16"  # every node's Pod subnet is in it (pod_subnet)
NAMESPACE = "k8s.io"  # containerd's namespace for the CRI


class NodeFailed(RuntimeError):
    """containerd or the kubelet would not start, or the host lacks what they need."""


def missing_host_tools() -> list[str]:
    """What this host lacks for a kubelet node (pure look-up; empty when everything is there)."""
    problems = []
    if os.geteuid() != 0:
        problems.append("the kubelet node runs as root")
    for path, package in ((RUNC, "runc"), (CNI_BIN / "bridge", "containernetworking-plugins"),
                          (BUSYBOX, "busybox-static")):  # fmt: skip
        if not path.exists():
            problems.append(f"{path} is missing (Debian's {package}: tools/build.sh containerd installs it)")
    return problems


def cgroup_hierarchies(mounts: str) -> list[Path]:
    """Where a cgroup of ours is made and removed, from /proc/self/mounts' text: every cgroup
    hierarchy, v1 and v2 (on a hybrid host runc mirrors the kubelet's v1 cgroups in the unified one)."""
    return sorted(
        Path(f[1])
        for f in (line.split() for line in mounts.splitlines())
        if len(f) >= 3 and f[2] in ("cgroup", "cgroup2")
    )


def mounts_under(mountinfo: str, directory: Path) -> list[Path]:
    """The mount points in /proc/self/mountinfo's text at or below `directory`, deepest first (the
    order to unmount them in); a point mounted twice is listed twice."""
    prefix = str(directory).rstrip("/") + "/"
    points = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) < 5:
            continue
        point = fields[4].encode().decode("unicode_escape")  # \040 for a space, as the kernel writes it
        if point == prefix.rstrip("/") or point.startswith(prefix):
            points.append(Path(point))
    return sorted(points, key=lambda p: (len(p.parts), str(p)), reverse=True)


def containerd_config(*, root: Path, state: Path, socket_path: Path, cni_conf: Path, certs: Path, opt: Path) -> str:
    """containerd's config (version 3). NRI and CDI off (they would open sockets and watch paths
    outside our directory); the network namespaces' mounts under our state directory."""
    return f"""version = 3
root = '{root}'
state = '{state}'
oom_score = 1000

[grpc]
  address = '{socket_path}'

[ttrpc]
  address = '{socket_path}.ttrpc'

[plugins.'io.containerd.internal.v1.opt']
  path = '{opt}'

[plugins.'io.containerd.nri.v1.nri']
  disable = true

[plugins.'io.containerd.cri.v1.runtime']
  enable_selinux = false
  disable_apparmor = true
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  enable_cdi = false
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = 'runc'
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = 'io.containerd.runc.v2'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = '{RUNC}'
        Root = '{state / "runc"}'
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ['{CNI_BIN}']
    conf_dir = '{cni_conf}'

[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = '{images.PAUSE}'
  [plugins.'io.containerd.cri.v1.images'.registry]
    config_path = '{certs}'

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = '127.0.0.1'
  stream_server_port = '0'
"""


def hosts_toml(port: int) -> str:
    """certs.d/_default/hosts.toml: every registry (docker.io included) is this loopback port."""
    return f"server = 'https://127.0.0.1:{port}'\n\n[host.'https://127.0.0.1:{port}']\n  capabilities = ['pull', 'resolve']\n"


def pod_subnet(routes: str, pick: Callable[[int], int] = secrets.randbelow) -> str:
    """A 10.88.4K.0/22 for this node's Pods (1,022 addresses: a steady state of 300 Pods and the
    ones still being torn down) that no route in `ip -o route`'s text already uses (another node's
    bridge on this host): K drawn by `pick` among the free ones. Raises NodeFailed if none is."""
    used = {int(m.group(1)) // 4 for m in re.finditer(r"\b10\.88\.(\d+)\.", routes)}
    free = [k for k in range(1, 64) if k not in used]
    if not free:
        raise NodeFailed("every 10.88.4K.0/22 on this host is taken by another node's bridge")
    return f"10.88.{4 * free[pick(len(free))]}.0/22"


def cni_conflist(*, network: str, bridge: str, subnet: str, data_dir: Path) -> str:
    """A bridge with host-local addresses and no NAT: Pods get a network namespace, an address and
    a loopback, and reach nothing beyond this machine. Their one route is PODS_NETWORK through their
    bridge: every node's Pods and bridge address, so a service this host offers on one bridge's
    address (a test's relay) is reached from the Pods of every node; there is no default route."""
    return json.dumps({
        "cniVersion": "1.0.0", "name": network,
        "plugins": [
            {"type": "bridge", "bridge": bridge, "isGateway": True, "ipMasq": False,
             "ipam": {"type": "host-local", "ranges": [[{"subnet": subnet}]], "routes": [{"dst": PODS_NETWORK}],
                      "dataDir": str(data_dir)}},
        ],
    }, indent=2)  # fmt: skip


def gateway(subnet: str) -> str:
    """The bridge's address in `subnet`: its first, as host-local gives the Pods for their gateway."""
    return str(ipaddress.ip_network(subnet)[1])


def kubelet_config(*, port: int, runtime_socket: Path, cgroup_root: str, ca_file: Path, pod_logs: Path) -> str:
    """The KubeletConfiguration of a single loopback node: cgroupfs on cgroup v1, the kubelet's API
    on 127.0.0.1 for kube-apiserver only (a client certificate from our CA, decided by webhook),
    no image GC of the images we import, evictions only on a nearly full disk."""
    doc = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "address": "127.0.0.1", "port": port, "readOnlyPort": 0, "healthzPort": 0,
        "containerRuntimeEndpoint": f"unix://{runtime_socket}",
        "cgroupDriver": "cgroupfs", "cgroupRoot": cgroup_root, "failCgroupV1": False, "failSwapOn": False,
        "oomScoreAdj": 0,  # -999 would need CAP_SYS_RESOURCE
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                           "x509": {"clientCAFile": str(ca_file)}},
        "authorization": {"mode": "Webhook"},
        "podLogsDir": str(pod_logs), "resolvConf": "",
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                         "nodefs.inodesFree": "1%"},
        "registerNode": True, "serializeImagePulls": False,
        "kubeAPIQPS": 50, "kubeAPIBurst": 100,
        "maxPods": 1000,  # 110 by default: api_load keeps 300 Jobs' Pods on this one node
        "shutdownGracePeriod": "0s",
    }  # fmt: skip
    return yaml.safe_dump(doc, sort_keys=False)


@dataclass
class Node:
    """containerd and the kubelet on this host, registered as `name` through `kubeconfig`."""

    directory: Path
    name: str
    kubeconfig: Path
    ca_cert: Path
    bins: NodeBinaries
    node_ready: Callable[[], bool]
    ready_timeout: float = 180.0
    processes: dict[str, ManagedProcess] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.directory = Path(self.directory)
        self.logs = self.directory / "logs"
        suffix = secrets.token_hex(3)
        self.cgroup_root = f"/k8s-dispatch-{suffix}"
        self.network = f"k8s-dispatch-{suffix}"
        self.bridge = f"kd{suffix}"  # at most 15 characters
        self.subnet = ""  # chosen at start, apart from every other node's on this host
        self.socket = self.directory / "containerd" / "containerd.sock"
        self.state = self.directory / "containerd" / "state"
        self.images: list[images.Archive] = []
        self._registry_port: socket.socket | None = None
        self._made_shim_dir = self._made_logs_dir = self._made_cni_cache = False
        self._container_ids: set[str] = set()  # sandboxes' among them: libcni's cache names its entries by them

    @property
    def address(self) -> str:
        """The bridge's address: the one address of this host the node's Pods reach (set at start)."""
        return gateway(self.subnet)

    # --- start ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start containerd, import the images, start the kubelet, wait until the node is Ready.
        Raises NodeFailed (having removed whatever it made)."""
        problems = missing_host_tools()
        if problems:
            raise NodeFailed("the kubelet node cannot run here: " + "; ".join(problems))
        self._made_shim_dir = not SHIM_SOCKETS.exists()
        self._made_logs_dir = not CONTAINER_LOGS.exists()
        self._made_cni_cache = not CNI_CACHE.exists()
        try:
            self._make_cgroups()
            self._make_bridge()
            self._start_containerd()
            self._import_images()
            self._start_kubelet()
        except BaseException:
            self.stop()
            raise

    def _make_cgroups(self) -> None:
        for hierarchy in cgroup_hierarchies(Path("/proc/self/mounts").read_text()):
            (hierarchy / self.cgroup_root.lstrip("/")).mkdir(exist_ok=True)

    def _spawn(self, name: str, argv: list[str]) -> ManagedProcess:
        # containerd finds its runc shim on PATH
        path = os.pathsep.join((str(self.bins.shim.parent), os.environ.get("PATH", "")))
        proc = ManagedProcess(name, argv, project_env({"PATH": path}), self.logs / f"{name}.log").start()
        self.processes[name] = proc
        return proc

    def _wait(self, proc: ManagedProcess, condition: Callable[[], bool], what: str) -> None:
        def check() -> bool:
            if not proc.alive:
                raise NodeFailed(f"{proc.name} exited ({proc.returncode}):\n{proc.log_tail(40)}")
            return condition()

        try:
            wait_until(check, timeout=self.ready_timeout, interval=0.2, what=what)
        except TimeoutError as e:
            raise NodeFailed(f"{e}\n{proc.log_tail(40)}") from e

    def _make_bridge(self) -> None:
        """The bridge with its address, made now rather than by the CNI plugin with the first Pod:
        its route then keeps the next node from drawing the same subnet, and the address can be
        served on before any Pod runs (the plugin adopts a bridge holding the gateway it would set)."""
        routes = subprocess.run(["ip", "-o", "route"], capture_output=True, text=True, check=False).stdout
        self.subnet = pod_subnet(routes)
        prefix = ipaddress.ip_network(self.subnet).prefixlen
        for argv in (
            ["ip", "link", "add", "name", self.bridge, "type", "bridge"],
            ["ip", "addr", "add", f"{gateway(self.subnet)}/{prefix}", "dev", self.bridge],
            ["ip", "link", "set", self.bridge, "up"],
        ):
            made = subprocess.run(argv, capture_output=True, text=True, check=False)
            if made.returncode != 0:
                raise NodeFailed(f"{' '.join(argv)} failed: {made.stderr.strip()}")

    def _start_containerd(self) -> None:
        base = self.directory / "containerd"
        cni_conf, certs = base / "net.d", base / "certs.d" / "_default"
        for d in (cni_conf, certs, self.state):
            d.mkdir(parents=True, exist_ok=True)
        # Held bound and never listened on: nothing else can take the port, every connect is refused.
        self._registry_port = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._registry_port.bind(("127.0.0.1", 0))
        (certs / "hosts.toml").write_text(hosts_toml(self._registry_port.getsockname()[1]))
        (cni_conf / "10-k8s-dispatch.conflist").write_text(
            cni_conflist(network=self.network, bridge=self.bridge, subnet=self.subnet, data_dir=base / "ipam")
        )
        config = base / "config.toml"
        config.write_text(containerd_config(
            root=base / "root", state=self.state, socket_path=self.socket, cni_conf=cni_conf,
            certs=certs.parent, opt=base / "opt",
        ))  # fmt: skip
        proc = self._spawn("containerd", [str(self.bins.containerd), "--config", str(config)])
        self._wait(proc, lambda: self._ctr("version", check=False).returncode == 0, "containerd answering")

    def _ctr(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(self.bins.ctr), "--address", str(self.socket), "--namespace", NAMESPACE, *args],
            capture_output=True, text=True, check=False, timeout=timeout,
        )  # fmt: skip
        if check and result.returncode != 0:
            raise NodeFailed(f"ctr {' '.join(args)} failed: {result.stderr.strip()}")
        return result

    def _import_images(self) -> None:
        made = self.directory / "images"
        for image in (images.pause_image(self.bins.pause), images.busybox_image(BUSYBOX)):
            archive = images.write(image, made)
            self._ctr("images", "import", str(archive.path))
            self.images.append(archive)

    def _start_kubelet(self) -> None:
        config = self.directory / "kubelet.yaml"
        config.write_text(kubelet_config(
            port=free_port(), runtime_socket=self.socket, cgroup_root=self.cgroup_root, ca_file=self.ca_cert,
            pod_logs=self.directory / "pod-logs",
        ))  # fmt: skip
        proc = self._spawn("kubelet", [
            str(self.bins.kubelet), f"--config={config}", f"--kubeconfig={self.kubeconfig}",
            f"--root-dir={self.directory / 'kubelet'}", f"--cert-dir={self.directory / 'kubelet-pki'}",
            # external: the Node's address is set by the control plane (127.0.0.1, which the kubelet
            # itself refuses as a node IP), as a cloud node controller would
            f"--hostname-override={self.name}", "--cloud-provider=external", "--v=1",
        ])  # fmt: skip
        self._wait(proc, self.node_ready, f"node {self.name} Ready")

    # --- stop -------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop the kubelet, remove every container, stop containerd, then remove what is left on
        the host: processes in our cgroups, mounts under our directory (the network namespaces'
        among them), the bridge, our cgroups, the CNI cache entries and the kubelet's log links.
        Safe to call twice and after any crash."""
        kubelet = self.processes.pop("kubelet", None)
        if kubelet is not None:
            kubelet.stop(timeout=20)
        containerd = self.processes.pop("containerd", None)
        if containerd is not None and containerd.alive:
            self._container_ids.update(self._ctr("containers", "ls", "-q", check=False).stdout.split())
            self._remove_containers()
        if containerd is not None:
            containerd.stop(timeout=20)
        self._kill_leftovers()
        self._unmount_all()
        subprocess.run(["ip", "link", "delete", self.bridge], capture_output=True, check=False)
        self._remove_cgroups()
        self._remove_host_files()
        if self._registry_port is not None:
            self._registry_port.close()
            self._registry_port = None

    def _remove_containers(self) -> None:
        """Kill and delete every task and container (sandboxes included) while containerd runs:
        runc then removes their cgroups and containerd their rootfs mounts and snapshots."""
        try:
            tasks = self._ctr("tasks", "ls", "-q", check=False).stdout.split()
            for task in tasks:
                self._ctr("tasks", "kill", "--all", "--signal", "SIGKILL", task, check=False)
            for task in tasks:
                self._ctr("tasks", "delete", "--force", task, check=False)
            containers = self._ctr("containers", "ls", "-q", check=False).stdout.split()
            if containers:
                self._ctr("containers", "delete", *containers, check=False)
        except subprocess.TimeoutExpired:
            pass  # what is left is removed from the host below

    def _our_pids(self) -> set[int]:
        """Processes in our cgroups, and the shims serving our containerd (they live outside them)."""
        pids: set[int] = set()
        for cgroup in self._cgroup_dirs():
            for procs in cgroup.rglob("cgroup.procs"):
                with contextlib.suppress(OSError):
                    pids.update(int(p) for p in procs.read_text().split())
        needle = str(self.socket).encode()
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                try:
                    if needle in (proc / "cmdline").read_bytes():
                        pids.add(int(proc.name))
                except OSError:
                    pass
        pids.discard(os.getpid())
        return pids

    def _kill_leftovers(self) -> None:
        deadline = time.monotonic() + 15
        while (pids := self._our_pids()) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)

    def _unmount_all(self) -> None:
        for _ in range(5):  # a point can be mounted over itself: repeat until none is left
            points = mounts_under(Path("/proc/self/mountinfo").read_text(), self.directory)
            if not points:
                return
            for point in points:
                if subprocess.run(["umount", str(point)], capture_output=True, check=False).returncode != 0:
                    subprocess.run(["umount", "--lazy", str(point)], capture_output=True, check=False)

    def _cgroup_dirs(self) -> list[Path]:
        return [
            h / self.cgroup_root.lstrip("/")
            for h in cgroup_hierarchies(Path("/proc/self/mounts").read_text())
            if (h / self.cgroup_root.lstrip("/")).is_dir()
        ]

    def _remove_cgroups(self) -> None:
        for top in self._cgroup_dirs():
            for d in sorted(_walk_dirs(top), key=lambda p: len(p.parts), reverse=True):
                _rmdir_retrying(d)

    def _remove_host_files(self) -> None:
        sandboxes = self.directory / "containerd" / "root" / "io.containerd.grpc.v1.cri" / "sandboxes"
        ids = self._container_ids | ({d.name for d in sandboxes.iterdir()} if sandboxes.is_dir() else set())
        results = CNI_CACHE / "results"
        for entry in results.iterdir() if results.is_dir() else ():
            # <network>-<sandbox id>-eth0 and cni-loopback-<sandbox id>-lo: what no CNI DEL removed
            if entry.name.startswith(f"{self.network}-") or any(f"-{i}-" in entry.name for i in ids):
                entry.unlink(missing_ok=True)
        if self._made_cni_cache:
            _rmdir_if_empty(CNI_CACHE / "results")
            _rmdir_if_empty(CNI_CACHE)
        if CONTAINER_LOGS.is_dir():
            for link in CONTAINER_LOGS.iterdir():
                if link.is_symlink() and os.readlink(link).startswith(str(self.directory)):
                    link.unlink(missing_ok=True)
            if self._made_logs_dir:
                _rmdir_if_empty(CONTAINER_LOGS)
        if self._made_shim_dir:
            _rmdir_if_empty(SHIM_SOCKETS / "s")
            _rmdir_if_empty(SHIM_SOCKETS)

    def logs_tail(self, lines: int = 30) -> str:
        return "\n".join(f"--- {name}\n{p.log_tail(lines)}" for name, p in self.processes.items())


def _walk_dirs(top: Path) -> Iterator[Path]:
    yield top
    for dirpath, dirnames, _ in os.walk(top):
        for d in dirnames:
            yield Path(dirpath) / d


def _rmdir_retrying(path: Path, timeout: float = 10.0) -> None:
    """A cgroup's rmdir is refused while a dying process is still in it: retry for a while."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                return
        time.sleep(0.1)


def _rmdir_if_empty(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.rmdir()
