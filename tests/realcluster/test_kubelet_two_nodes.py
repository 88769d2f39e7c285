"""Two kubelet nodes on one host (`realcluster serve --node kubelet --nodes 2`): each runs real
containers from its own containerd, the Pods of one reach the other node's bridge address (what lets
one relay serve every node's Pods), kube-apiserver reaches the second kubelet for `pods/log`, and
SIGTERM leaves nothing of either on the host. The chart's drain from one node to the other is
tests/realcluster/test_product_image.py's."""

from __future__ import annotations

import functools
import http.server
import ipaddress
import json
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

from kubernetes import client, config

from k8s_dispatch.lab.realcluster import node
from k8s_dispatch.lab.realcluster.controlplane import node_name
from k8s_dispatch.ops.processes import wait_until
from tests.realcluster.test_node import _host_state, assert_nothing_left, stop_serve


def test_a_pods_one_route_is_every_nodes_pod_network_and_no_default() -> None:
    conflist = json.loads(node.cni_conflist(network="n", bridge="kdabc", subnet="10.88.8.0/22", data_dir=Path("/d")))
    [bridge] = conflist["plugins"]
    assert bridge["ipam"]["routes"] == [{"dst": node.PODS_NETWORK}]
    network = ipaddress.IPv4Network(node.PODS_NETWORK)
    subnets = {node.pod_subnet("", pick=functools.partial(min, k)) for k in range(63)}  # every one a node may draw
    assert len(subnets) == 63 and all(ipaddress.IPv4Network(s).subnet_of(network) for s in subnets)
    assert node.gateway("10.88.8.0/22") == "10.88.8.1"


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"hello from the first node's bridge")

    def log_message(self, *args: Any) -> None:
        pass


def test_serve_runs_two_nodes_whose_pods_reach_each_other_and_sigterm_leaves_nothing_behind(tmp_path: Path) -> None:
    before = _host_state()
    kubeconfig = tmp_path / "kubeconfig"
    log = (tmp_path / "serve.log").open("wb")
    serve = subprocess.Popen(
        [sys.executable, "-m", "k8s_dispatch.lab.realcluster", "serve", "--node", "kubelet", "--nodes", "2",
         "--kubeconfig", str(kubeconfig)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    server: http.server.HTTPServer | None = None
    try:
        wait_until(
            lambda: (serve.poll() is None and kubeconfig.exists()) or serve.poll() is not None,
            timeout=600, interval=0.5, what="realcluster serve --nodes 2 listening",
        )  # fmt: skip
        assert serve.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
        api = config.new_client_from_config(config_file=str(kubeconfig))
        core = client.CoreV1Api(api)
        first, second = node_name(0), node_name(1)
        assert sorted(n.metadata.name for n in core.list_node().items) == [first, second]

        def pod(name: str, on: str, command: str) -> None:
            core.create_namespaced_pod("default", {
                "metadata": {"name": name},
                "spec": {"nodeName": on, "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                         "containers": [{"name": "c", "image": "busybox:1.36", "command": ["sh", "-c", command]}]},
            })  # fmt: skip

        def phase(name: str) -> str:
            read = core.read_namespaced_pod(name, "default")
            return str(read.status.phase) if read.status.pod_ip else ""

        sleeper = f"p-{uuid.uuid4().hex[:6]}"
        pod(sleeper, first, "sleep 3600")
        wait_until(lambda: phase(sleeper) == "Running", timeout=120, interval=0.5, what="a Pod on the first node")
        first_ip = core.read_namespaced_pod(sleeper, "default").status.pod_ip
        bridge = str(next(iter(ipaddress.ip_network(f"{first_ip}/22", strict=False).hosts())))  # the gateway
        server = http.server.HTTPServer((bridge, 0), _Hello)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        caller = f"p-{uuid.uuid4().hex[:6]}"
        # no `-T`: Debian's static busybox wget dies of a segmentation fault with it
        pod(caller, second, f"wget -qO- http://{bridge}:{server.server_address[1]}/")
        wait_until(lambda: phase(caller) in ("Succeeded", "Failed"), timeout=120, interval=0.5,
                   what="the second node's Pod calling the first node's bridge")  # fmt: skip
        called = core.read_namespaced_pod(caller, "default")
        said = core.read_namespaced_pod_log(caller, "default")  # pods/log: through the second kubelet's own port
        assert (called.spec.node_name, called.status.phase) == (second, "Succeeded"), (said, called.status)
        assert ipaddress.ip_address(called.status.pod_ip) not in ipaddress.ip_network(f"{first_ip}/22", strict=False)
        assert called.status.container_statuses[0].container_id.startswith("containerd://")
        assert said == "hello from the first node's bridge"
        during = _host_state()
        made = {kind: during[kind] - before[kind] for kind in before}
        assert len({i for i in made["interfaces"] if i.startswith("kd")}) == 2, made["interfaces"]  # a bridge each
        assert made["cgroups"] and made["shims"] and made["mounts"], made
        api.close()
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
        code = stop_serve(serve, log)
    assert code == 0, (tmp_path / "serve.log").read_text()[-4000:]
    assert_nothing_left(before, kubeconfig)
