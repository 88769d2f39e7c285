"""The kubelet node: its configuration (pure), and `realcluster serve --node kubelet` for real: a Pod
runs in a real container, and SIGTERM leaves nothing of it on the host (no process, mount, network
namespace, interface or cgroup)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
import uuid
from pathlib import Path
from typing import BinaryIO

import pytest
import yaml
from kubernetes import client, config

from k8s_dispatch.lab.realcluster import images, node
from k8s_dispatch.ops.processes import wait_until

MOUNTINFO = """\
22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
90 22 0:50 / /tmp/n/containerd/state/netns/cni-1 rw shared:40 - nsfs nsfs rw
91 22 0:51 / /tmp/n/kubelet/pods/u/volumes/kube-api-access rw - tmpfs tmpfs rw
92 22 0:52 / /tmp/n/containerd/state/io.containerd.runtime.v2.task/k8s.io/abc/rootfs rw - overlay overlay rw
93 92 0:53 / /tmp/n/containerd/state/io.containerd.runtime.v2.task/k8s.io/abc/rootfs rw - overlay overlay rw
94 22 0:54 / /tmp/n2/other rw - tmpfs tmpfs rw
95 22 0:55 / /tmp/n/with\\040space rw - tmpfs tmpfs rw
"""


def test_mounts_under_the_directory_are_found_deepest_first_and_a_sibling_is_not() -> None:
    points = node.mounts_under(MOUNTINFO, Path("/tmp/n"))
    rootfs = Path("/tmp/n/containerd/state/io.containerd.runtime.v2.task/k8s.io/abc/rootfs")
    assert points[:2] == [rootfs, rootfs]  # mounted twice: listed twice, unmounted twice
    assert set(points[2:]) == {
        Path("/tmp/n/kubelet/pods/u/volumes/kube-api-access"),
        Path("/tmp/n/containerd/state/netns/cni-1"),
        Path("/tmp/n/with space"),
    }
    assert [len(p.parts) for p in points] == sorted((len(p.parts) for p in points), reverse=True)


def test_cgroups_are_made_and_removed_in_every_hierarchy_the_unified_one_of_a_hybrid_host_too() -> None:
    hybrid = (
        "cgroup /sys/fs/cgroup/memory cgroup rw,memory 0 0\n"
        "cgroup /sys/fs/cgroup/cpu cgroup rw,cpu 0 0\n"
        "cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n"
        "tmpfs /sys/fs/cgroup tmpfs ro 0 0\n"
    )
    assert node.cgroup_hierarchies(hybrid) == [
        Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup/unified")
    ]  # fmt: skip
    assert node.cgroup_hierarchies("cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n") == [Path("/sys/fs/cgroup")]


def test_containerd_runs_everything_under_our_directory_and_pulls_from_nowhere(tmp_path: Path) -> None:
    text = node.containerd_config(
        root=tmp_path / "root", state=tmp_path / "state", socket_path=tmp_path / "c.sock",
        cni_conf=tmp_path / "net.d", certs=tmp_path / "certs.d", opt=tmp_path / "opt",
    )  # fmt: skip
    doc = tomllib.loads(text)
    runtime = doc["plugins"]["io.containerd.cri.v1.runtime"]
    assert (doc["oom_score"], runtime["restrict_oom_score_adj"]) == (1000, True)  # no CAP_SYS_RESOURCE here
    assert runtime["netns_mounts_under_state_dir"] is True
    assert runtime["containerd"]["runtimes"]["runc"]["options"]["Root"].startswith(str(tmp_path))
    assert doc["plugins"]["io.containerd.nri.v1.nri"]["disable"] is True
    image_config = doc["plugins"]["io.containerd.cri.v1.images"]
    assert image_config["pinned_images"]["sandbox"] == images.PAUSE
    assert image_config["registry"]["config_path"] == str(tmp_path / "certs.d")
    hosts = tomllib.loads(node.hosts_toml(4711))
    assert hosts["server"] == "https://127.0.0.1:4711" and list(hosts["host"]) == ["https://127.0.0.1:4711"]


def test_the_kubelet_runs_on_cgroup_v1_with_cgroupfs_and_serves_only_loopback(tmp_path: Path) -> None:
    doc = yaml.safe_load(node.kubelet_config(
        port=10250, runtime_socket=tmp_path / "c.sock", cgroup_root="/k8s-dispatch-x", ca_file=tmp_path / "ca.crt",
        pod_logs=tmp_path / "logs",
    ))  # fmt: skip
    assert (doc["failCgroupV1"], doc["cgroupDriver"], doc["cgroupRoot"]) == (False, "cgroupfs", "/k8s-dispatch-x")
    assert (doc["address"], doc["readOnlyPort"], doc["authentication"]["anonymous"]["enabled"]) == (
        "127.0.0.1",
        0,
        False,
    )
    assert doc["containerRuntimeEndpoint"] == f"unix://{tmp_path / 'c.sock'}"
    conflist = json.loads(node.cni_conflist(network="n", bridge="kdabc", subnet="10.88.7.0/24", data_dir=tmp_path))
    [bridge] = conflist["plugins"]
    assert (bridge["type"], bridge["ipMasq"], bridge["ipam"]["dataDir"]) == ("bridge", False, str(tmp_path))


def test_a_pod_subnet_is_one_no_route_on_the_host_uses() -> None:
    routes = "default via 10.0.0.1 dev eth0\n10.88.5.0/24 dev kdaaa proto kernel scope link src 10.88.5.1\n"
    assert node.pod_subnet(routes, pick=lambda n: 0) == "10.88.8.0/22"  # 10.88.4.0/22 holds another node's
    taken = "".join(f"10.88.{4 * k}.0/22 dev kd{k}\n" for k in range(1, 64))
    with pytest.raises(node.NodeFailed, match="taken"):
        node.pod_subnet(taken)


# --- for real -----------------------------------------------------------------------------------


def _host_state() -> dict[str, set[str]]:
    """What a node leaves on the host, by kind: mounts (network namespaces' among them),
    interfaces, our cgroups, shims, files outside its directory."""
    mounts = {line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()}
    links = set(subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout.split("\n"))
    interfaces = {line.split(":")[1].strip().split("@")[0] for line in links if line.strip()}
    cgroups = {str(p) for p in Path("/sys/fs/cgroup").glob("*/k8s-dispatch-*")}  # every hierarchy, unified too
    shims = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if b"containerd-shim-runc-v2" in (proc / "cmdline").read_bytes():
                    shims.add(proc.name)
            except OSError:
                pass
    # the paths containerd, libcni and the kubelet do not let us move (made if missing)
    fixed = [Path("/run/containerd"), Path("/var/log/containers"), Path("/var/lib/cni")]
    files = {str(p) for top in fixed if top.exists() for p in (top, *top.rglob("*"))}
    return {"mounts": mounts, "interfaces": interfaces, "cgroups": cgroups, "shims": shims, "files": files}


def stop_serve(serve: subprocess.Popen[bytes], log: BinaryIO) -> int:
    """SIGTERM `realcluster serve` if it still runs; its exit code."""
    if serve.poll() is None:
        os.killpg(serve.pid, signal.SIGTERM)
    code = serve.wait(timeout=120)
    log.close()
    return code


def assert_nothing_left(before: dict[str, set[str]], kubeconfig: Path) -> None:
    """Nothing of what `_host_state` sees is left that was not there `before`, nor the kubeconfig."""
    deadline = time.monotonic() + 10  # the kernel frees a network namespace's interfaces asynchronously
    while True:
        after = _host_state()
        left = {kind: after[kind] - before[kind] for kind in before}
        if not any(left.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not any(left.values()), left
    assert not kubeconfig.exists()


def test_serve_runs_a_pod_in_a_real_container_and_sigterm_leaves_nothing_behind(tmp_path: Path) -> None:
    before = _host_state()
    kubeconfig = tmp_path / "kubeconfig"
    log = (tmp_path / "serve.log").open("wb")
    serve = subprocess.Popen(
        [sys.executable, "-m", "k8s_dispatch.lab.realcluster", "serve", "--node", "kubelet", "--kubeconfig", str(kubeconfig)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        wait_until(
            lambda: (serve.poll() is None and kubeconfig.exists()) or serve.poll() is not None,
            timeout=600, interval=0.5, what="realcluster serve --node kubelet listening",
        )  # fmt: skip
        assert serve.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
        api = config.new_client_from_config(config_file=str(kubeconfig))
        core = client.CoreV1Api(api)
        name = f"p-{uuid.uuid4().hex[:6]}"
        core.create_namespaced_pod("default", {
            "metadata": {"name": name},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "c", "image": "busybox:1.36", "command": ["sleep", "3600"]}]},
        })  # fmt: skip

        def running() -> bool:
            pod = core.read_namespaced_pod(name, "default")
            statuses = pod.status.container_statuses or []
            return bool(statuses and statuses[0].state.running)

        wait_until(running, timeout=120, interval=0.5, what="the Pod's container running")
        pod = core.read_namespaced_pod(name, "default")
        assert pod.status.container_statuses[0].container_id.startswith("containerd://")
        assert pod.status.pod_ip.startswith("10.88.")  # the CNI bridge's host-local range
        during = _host_state()
        made = {kind: during[kind] - before[kind] for kind in before}
        assert made["cgroups"] and made["shims"] and made["interfaces"] and made["mounts"], made
        api.close()
    finally:
        code = stop_serve(serve, log)
    assert code == 0, (tmp_path / "serve.log").read_text()[-4000:]
    assert_nothing_left(before, kubeconfig)
