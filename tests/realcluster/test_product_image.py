"""The product as its users run it: the OCI image tools/image.py assembles here (no Docker), imported
into the real nodes' containerd, and the Helm chart installed onto the first node. Worker, beat and
Flower run as Pods from that image; a dispatch scheduled from outside (the engine's side: this test)
completes exactly once; Flower, behind its login, lists our tasks; `kubectl drain` of that node
evicts them all, the Job's Pod of a running dispatch too (the stopping worker records that Pod's
disruption and lets it go: delivery/shutdown.py), and they come back on a second kubelet node, added
to the session's cluster for this test: there every dispatch ends once and no Job is left, the
drained node still cordoned. The control plane runs the Deployment, ReplicaSet and disruption
controllers the chart needs (lab/realcluster/controlplane.py's KUBELET_CONTROLLERS).

Each node's Pods are on a bridge of their own with no default route (lab/realcluster/node.py): of
this host they reach the bridges' addresses alone (their one route covers every node's subnet), not
127.0.0.1 where kube-apiserver, PostgreSQL and Redis listen. So a relay here listens on the first
node's bridge address for each of them, and the chart is given, as values, what a cluster gives
its Pods: the API server's address (`kubernetes.default.svc`, a name its certificate holds, through
hostAliases) and the services' URLs in its Secret.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import re
import secrets
import socket
import subprocess
import sys
import tarfile
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from sqlalchemy.engine import make_url

from k8s_dispatch import celeryconfig as names
from k8s_dispatch.lab.realcluster.binaries import build as build_tool
from k8s_dispatch.lab.realcluster.controlplane import NODE_NAME
from k8s_dispatch.lab.realcluster.node import Node
from k8s_dispatch.store import dispatches
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import EventType
from k8s_dispatch.workers import labels as job_labels

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "k8s-dispatch"
RELEASE = "k8s-dispatch"
API_NAME = "kubernetes.default.svc"  # in the API server's certificate (lab/realcluster/pki.py)
IP_FREEBIND = 15  # linux/in.h: bind to an address this host does not hold yet
TERMINAL = (EventType.WORKER_COMPLETED, EventType.WORKER_FAILED, EventType.WORKER_CANCELLED)


def image_tool() -> ModuleType:
    """tools/image.py, imported as the module it is when run."""
    spec = importlib.util.spec_from_file_location("image_tool", ROOT / "tools" / "image.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def layout(archive: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(manifest, config) of an image-layout tar."""
    with tarfile.open(archive) as tar:

        def blob(digest: str) -> Any:
            member = tar.extractfile("blobs/sha256/" + digest.removeprefix("sha256:"))
            assert member is not None
            return json.loads(member.read())

        index = json.loads(tar.extractfile("index.json").read())  # type: ignore[union-attr]
        manifest = blob(index["manifests"][0]["digest"])
        return manifest, blob(manifest["config"]["digest"])


@pytest.mark.timeout(900)
def test_the_image_is_reproducible_and_says_what_the_dockerfile_says(tmp_path: Path) -> None:
    tool = image_tool()
    wheel = tool.product_wheel(tmp_path)  # one wheel for both: the working tree may change meanwhile
    first = tool.build(tmp_path / "a", use_cache=False, wheel=wheel)
    second = tool.build(tmp_path / "b", use_cache=False, wheel=wheel)
    assert (first.name, first.digest) == (second.name, second.digest)
    assert first.path.read_bytes() == second.path.read_bytes()
    manifest, config = layout(first.path)
    assert len(manifest["layers"]) == 2  # Debian's base, the virtualenv
    dockerfile = (ROOT / "Dockerfile").read_text()
    cmd = json.loads(re.findall(r"^CMD (\[.*\])$", dockerfile, re.MULTILINE)[-1])
    assert config["config"]["Cmd"] == cmd
    assert config["config"]["User"] == "10001:10001"
    assert f"USER {config['config']['User']}" in dockerfile
    version = config["config"]["Labels"]["org.opencontainers.image.version"]
    assert first.name.endswith(":" + tool.image_tag(version))
    with tarfile.open(first.path) as tar:  # no entry carries the building host's users or times
        for layer in manifest["layers"]:
            blob = tar.extractfile("blobs/sha256/" + layer["digest"].removeprefix("sha256:"))
            with tarfile.open(fileobj=blob) as content:
                members = content.getmembers()
            assert [m.name for m in members] == sorted(m.name for m in members)
            assert {(m.uname, m.gname) for m in members} == {("", "")}
            assert {m.mtime for m in members} == {tool.source_date_epoch()}
            assert {(m.uid, m.gid) for m in members} <= {(0, 0), (10001, 10001)}


# --- the chart on the node ---------------------------------------------------------------------


class Relay:
    """TCP relays on `host` to ports on 127.0.0.1, in a thread of their own."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="relay", daemon=True)
        self.thread.start()
        self.servers: list[asyncio.Server] = []

    def to(self, port: int) -> int:
        """Relay `host`:P to 127.0.0.1:`port`; returns P."""

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                writer.close()
                return
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

        async def serve() -> asyncio.Server:
            # The bridge and its address come with the node's first Pod: bound before they exist.
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_IP, IP_FREEBIND, 1)
            sock.bind((self.host, 0))
            return await asyncio.start_server(handle, sock=sock)

        server = asyncio.run_coroutine_threadsafe(serve(), self.loop).result(timeout=10)
        self.servers.append(server)
        return int(server.sockets[0].getsockname()[1])

    def close(self) -> None:
        async def shut() -> None:
            for server in self.servers:
                server.close()
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shut(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()


@pytest.fixture
def relay(kubelet_cluster: Any) -> Iterator[Relay]:
    """Relays on the first node's bridge address, which every node's Pods reach."""
    r = Relay(kubelet_cluster.backend.kubelet_node.address)
    yield r
    r.close()


@pytest.fixture
def second_node(kubelet_cluster: Any) -> Iterator[Node]:
    """A second kubelet node in the session's cluster for this test alone (about 3 s to start):
    the other tests on the real node keep their one node."""
    plane = kubelet_cluster.backend
    node = plane.add_kubelet_node()
    try:
        yield node
    finally:
        plane.remove_kubelet_node(node)


def kubectl(cluster: Any, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["kubectl", "--kubeconfig", str(cluster.kubeconfig), *args], capture_output=True, text=True, timeout=timeout
    )


def pods(d: Any, component: str) -> list[dict[str, Any]]:
    return d.kube.list_pods(d.namespace, label_selector=f"app.kubernetes.io/component={component}")


def running(d: Any, component: str, node: str | None = None) -> list[dict[str, Any]]:
    """The component's Pods that run and are ready (none being deleted), on `node` if given."""
    return [
        p
        for p in pods(d, component)
        if p["status"].get("phase") == "Running"
        and node in (None, p["spec"].get("nodeName"))
        and not p["metadata"].get("deletionTimestamp")
        and all(c.get("ready") for c in p["status"].get("containerStatuses", []))
    ]


def ended_once(d: Any, dispatch_id: str) -> list[str]:
    """The types of the dispatch's events, after asserting it ended exactly once, completed."""
    with transaction(d.sessions) as session:
        story = [(e.type, e.payload) for e in dispatches.events_for(session, dispatch_id)]
    terminal = [(t, p) for t, p in story if t in {x.value for x in TERMINAL}]
    assert terminal == [(EventType.WORKER_COMPLETED, {"output": {"done": True}})], story
    return [t for t, _ in story]


def flower_get(pod: dict[str, Any], path: str, auth: str | None) -> tuple[int, bytes]:
    headers = {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()} if auth else {}
    request = urllib.request.Request(f"http://{pod['status']['podIP']}:5555{path}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


SLOW = {  # ends on the eviction's SIGTERM, so a drain mid-run is a disruption; else says done
    "worker": "shell", "image": "busybox:1.36", "command": ["sh", "-c"],
    "args": ["""trap 'exit 143' TERM; sleep 10 & wait $!; printf '{"done": true}' > /dev/termination-log"""],
    "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "32Mi"}},
    "activeDeadlineSeconds": 120, "runAsUser": 65534, "runAsGroup": 65534, "backoffLimit": 0,
}  # fmt: skip


def unschedulable(cluster: Any, node: str) -> bool:
    status, body = cluster.backend.get(f"/api/v1/nodes/{node}")
    assert status == 200, body
    return bool(json.loads(body)["spec"].get("unschedulable"))


@pytest.mark.timeout(900)
def test_the_chart_runs_on_the_node_from_the_image_flower_shows_the_work_and_a_drain_moves_it_losing_nothing(
    second_node: Node, deploy: Any, kubelet_cluster: Any, relay: Relay, tmp_path: Path
) -> None:
    built = image_tool().build(tmp_path / "image")  # cached: the test above built the same inputs
    first_node = kubelet_cluster.backend.kubelet_node
    for node in (first_node, second_node):
        imported = subprocess.run(
            [str(node.bins.ctr), "--address", str(node.socket), "--namespace", "k8s.io", "images", "import",
             str(built.path)], capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert imported.returncode == 0, imported.stderr
    # Everything starts on the first node, the one drained below: the second waits cordoned.
    cordoned = kubectl(kubelet_cluster, "cordon", second_node.name)
    assert cordoned.returncode == 0, cordoned.stderr
    d = deploy(kubelet_cluster, capabilities={"slow": SLOW}, sweep_interval_s="2", sweep_grace_s="1")

    # What a cluster would give the Pods: the services at an address they reach.
    pg, redis_url = make_url(d.settings.database_url), urlsplit(d.settings.redis_url)
    pod_pg = pg.set(host=relay.host, port=relay.to(pg.port or 5432)).render_as_string(hide_password=False)
    pod_redis = redis_url._replace(netloc=f"{relay.host}:{relay.to(redis_url.port or 6379)}").geturl()
    api_port = relay.to(int(urlsplit(kubelet_cluster.url).port or 443))
    flower_auth = f"admin:{secrets.token_urlsafe(12)}"
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "k8s-dispatch", "namespace": d.namespace},
              "stringData": {"database-url": pod_pg, "redis-url": pod_redis, "redis-password": "",
                             "flower-basic-auth": flower_auth}}  # fmt: skip
    (tmp_path / "secret.json").write_text(json.dumps(secret))
    made = kubectl(kubelet_cluster, "apply", "-f", str(tmp_path / "secret.json"))
    assert made.returncode == 0, made.stderr
    values = {
        "image": {"tag": built.name.rsplit(":", 1)[1], "pullPolicy": "Never"},
        "worker": {"replicas": 1},  # the drain's case: every worker on the node it drains
        # CPU shares follow requests: on a busy host 50m leaves beat and Flower too little to start
        # before their liveness probes give up
        "beat": {"resources": {"requests": {"cpu": "500m", "memory": "192Mi"}}},
        "flower": {"resources": {"requests": {"cpu": "500m", "memory": "192Mi"}}},
        "capabilities": {"inline": {"capabilities": {"slow": SLOW}}},
        "hostAliases": [{"ip": relay.host, "hostnames": [API_NAME]}],
        "extraEnv": [
            {"name": "KUBERNETES_SERVICE_HOST", "value": API_NAME},
            {"name": "KUBERNETES_SERVICE_PORT", "value": str(api_port)},
            {"name": "K8S_DISPATCH_KEY_PREFIX", "value": d.prefix},
            {"name": "K8S_DISPATCH_SWEEP_INTERVAL_S", "value": "2"},
            {"name": "K8S_DISPATCH_SWEEP_GRACE_S", "value": "1"},
        ],
    }
    (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
    helm = build_tool("helm") / "helm"
    installed = subprocess.run(
        [str(helm), "install", RELEASE, str(CHART), "--namespace", d.namespace, "--kubeconfig",
         str(kubelet_cluster.kubeconfig), "--values", str(tmp_path / "values.yaml"), "--wait", "--timeout", "240s"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert installed.returncode == 0, (
        installed.stderr + kubectl(kubelet_cluster, "-n", d.namespace, "get", "pods,events").stdout
    )
    manifest, _ = layout(built.path)
    ours = (built.digest, manifest["config"]["digest"])  # the CRI reports either
    for component in ("worker", "beat", "flower"):
        [pod] = running(d, component, NODE_NAME)
        [status] = pod["status"]["containerStatuses"]
        assert status["imageID"].endswith(ours), status["imageID"]  # our image, as built

    # A dispatch scheduled from outside completes exactly once.
    [first] = d.schedule_batch("slow", 1)
    d.wait_terminal([first], timeout_s=90)
    assert ended_once(d, first) == [EventType.WORKER_SCHEDULED, EventType.WORKER_COMPLETED]

    # Flower, behind its login, lists our tasks.
    [flower] = running(d, "flower")
    assert flower_get(flower, "/api/tasks", None)[0] == 401

    def listed() -> dict[str, Any]:
        status, body = flower_get(flower, "/api/tasks", flower_auth)
        tasks = json.loads(body) if status == 200 else {}
        return tasks if any(first in str(t.get("args")) for t in tasks.values()) else {}

    tasks = d.wait(listed, timeout_s=60, what="Flower listing the task of the first dispatch")
    assert {names.CREATE_JOBS_TASK, names.COMPLETE_BATCH_TASK} <= {t["name"] for t in tasks.values()}
    assert not {t["name"] for t in tasks.values()} & names.HOUSEKEEPING_TASKS  # the work only
    status, page = flower_get(flower, "/tasks", flower_auth)
    assert status == 200 and b"<html" in page.lower()

    # A drain mid-run evicts every Pod, the Job's too, and ends: the evicted worker, stopping, records
    # the Job Pod's disruption and lets it go. Worker, beat and Flower come back on the second node,
    # the Job runs again there, and nothing waits for the drained node's `uncordon`.
    [second] = d.schedule_batch("slow", 1)

    def job_pod_running() -> list[str]:
        return [
            p["metadata"]["name"]
            for p in d.kube.list_pods(d.namespace, label_selector=job_labels.selector())
            if any("running" in (s.get("state") or {}) for s in p["status"].get("containerStatuses") or [])
        ]

    [evicted] = d.wait(job_pod_running, timeout_s=60, what="the second dispatch's container running")
    [worker] = running(d, "worker")
    uncordoned = kubectl(kubelet_cluster, "uncordon", second_node.name)
    assert uncordoned.returncode == 0, uncordoned.stderr
    with (tmp_path / "worker.log").open("wb") as out:  # its log, to its last line
        follow = subprocess.Popen(
            ["kubectl", "--kubeconfig", str(kubelet_cluster.kubeconfig), "-n", d.namespace, "logs", "-f",
             f"pod/{worker['metadata']['name']}"], stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        drained = kubectl(kubelet_cluster, "drain", NODE_NAME, "--ignore-daemonsets", "--delete-emptydir-data",
                          "--timeout=200s", timeout=240)  # fmt: skip
        assert drained.returncode == 0, (
            drained.stdout + drained.stderr + kubectl(kubelet_cluster, "-n", d.namespace, "get", "pods,events").stdout
        )
        for component in ("worker", "beat", "flower"):
            assert f"pod/{RELEASE}-{component}-" in drained.stdout, drained.stdout
        assert f"pod/{evicted} evicted" in drained.stdout, drained.stdout
        [third] = d.schedule_batch("slow", 1)  # as the drain ends: whichever worker runs takes it
        for component in ("worker", "beat", "flower"):
            d.wait(lambda c=component: running(d, c, second_node.name), timeout_s=180,
                   what=f"the {component} running and ready on {second_node.name}")  # fmt: skip
        d.wait_terminal([second, third], timeout_s=240)
        assert ended_once(d, second) == [
            EventType.WORKER_SCHEDULED, EventType.WORKER_DISRUPTED, EventType.WORKER_COMPLETED
        ]  # fmt: skip
        assert ended_once(d, third) == [EventType.WORKER_SCHEDULED, EventType.WORKER_COMPLETED]
        d.wait_no_jobs(timeout_s=120)
        assert sorted(d.notifications()) == sorted([first, second, third])  # the fourth's is below
        # Every Pod of the release is on the second node; the drained one held nothing back.
        assert {p["spec"]["nodeName"] for c in ("worker", "beat", "flower") for p in pods(d, c)} == {second_node.name}
        assert unschedulable(kubelet_cluster, NODE_NAME)
        # Flower there, behind its login, hears the workers' events through the first node's relay:
        # a dispatch from now on is found by its id. Its `create_jobs` always runs; its end may be
        # recorded by a `complete_batch` or, with a sweep every 2 s, by the sweep (no task of its own).
        [moved] = running(d, "flower", second_node.name)

        def hears_a_worker() -> bool:  # its event receiver is connected: a worker's heartbeats reached it
            status, body = flower_get(moved, "/api/workers?status=1", flower_auth)
            return status == 200 and any(json.loads(body).values())

        d.wait(hears_a_worker, timeout_s=60, what="Flower on the second node hearing a worker's heartbeat")
        [fourth] = d.schedule_batch("slow", 1)
        d.wait_terminal([fourth], timeout_s=90)

        def creation_of_fourth() -> list[str]:
            status, body = flower_get(moved, f"/api/tasks?search={fourth}", flower_auth)
            tasks = json.loads(body) if status == 200 else {}
            return [t["name"] for t in tasks.values() if t.get("name") == names.CREATE_JOBS_TASK]

        d.wait(creation_of_fourth, timeout_s=60, what="Flower on the second node finding the fourth's create_jobs")
    finally:
        uncordoned = kubectl(kubelet_cluster, "uncordon", NODE_NAME)
        try:
            follow.wait(timeout=30)  # the stream ends with the container
        except subprocess.TimeoutExpired:
            follow.kill()
            follow.wait()
    assert uncordoned.returncode == 0, uncordoned.stderr
    # The evicted worker's last pass is what let the evicted Job Pod go.
    worker_log = (tmp_path / "worker.log").read_text(errors="replace")
    assert "last pass: 1 pod(s) of ours were being deleted: 1 disrupted" in worker_log, worker_log[-4000:]
    uninstalled = subprocess.run(
        [str(helm), "uninstall", RELEASE, "--namespace", d.namespace, "--kubeconfig", str(kubelet_cluster.kubeconfig),
         "--wait", "--timeout", "120s"], capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert uninstalled.returncode == 0, uninstalled.stderr
