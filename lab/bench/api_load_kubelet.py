"""api_load on a real node (issue 27): the same steady state of ours on the real control plane with
the node agent and then with kube-scheduler, the kubelet and containerd (`realcluster --node
kubelet`), each Job a real busybox container that sleeps its run time and writes its result.

Beside the Job counts of api_load (every request per finished Job, split by sender from the audit
log: ours, the Job controller and the other controllers, kube-scheduler, the node), how soon a Job's
container runs: from the engine's schedule call to the first instant the bench's watch on Pods
shows the container running (or already ended), against a raw `create_namespaced_job` of the same
container, one a second in a namespace of the bench's own, in the same run (its requests and those
it causes are left out of the split by sender). The SIG-scalability Pod startup SLO (create ->
running, p99 <= 5 s) is the yardstick of the raw figure.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, suppress
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config

from k8s_dispatch.lab.bench import api_load, services, workload
from k8s_dispatch.lab.bench.api_counts import CONTROLLERS, NODE, OURS, SCHEDULER, per_finished_job
from k8s_dispatch.lab.bench.api_steady import STEPS, Window, _percentile
from k8s_dispatch.lab.bench.results import BenchResult, Figure, Ratio
from k8s_dispatch.ops.processes import WaitTimeout, wait_until
from k8s_dispatch.workers.resolver import CapabilityResolver

KUBELET = services.KUBELET  # in `BenchContext.clusters`: this comparison runs
RAW_NAMESPACE = "bench-load-raw"
RAW_INTERVAL_S = 1.0  # one raw Job a second beside ours
RAW_JOB_S = 1  # how long a raw Job's container sleeps (its start is what is measured)
RAW_HEADROOM = 50  # the agent's exec processes beyond ours: the raw Jobs' (one a second, each a second)
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
STARTED_WAIT_S = 30.0  # after the window: how long the window's Jobs may take to show a container started
# where a result goes: the termination message, or the agent's file for it in exec mode
RESULT_FILE = '"${TERMINATION_MESSAGE_PATH:-/dev/termination-log}"'
BUSYBOX = "busybox:1.36"  # imported into the kubelet node's containerd (lab/realcluster/images.py)
# The agent and the kubelet, in that order: the same steady state on each.
NODES = ("agent", KUBELET)


def capability_config(job_s: float) -> dict[str, Any]:
    """api_load's load.k0..load.k60 as real containers: sleep job_s * k / STEPS, then a result."""
    return {
        "capabilities": {
            api_load.capability(k): {
                "worker": workload.WORKER, "image": BUSYBOX, "command": ["sh", "-c"],
                "args": [f"""sleep {job_s * k / STEPS:.3f}; printf '{{"k": {k}}}' > """ + RESULT_FILE],
                # no CPU request: 300 of them fit on a 2-core node
                "resources": {"requests": {"memory": "4Mi"}, "limits": {"memory": "32Mi"}},
                "activeDeadlineSeconds": 3600, "backoffLimit": 0,
                # runAsNonRoot (the restricted profile): busybox's own user is root, the kubelet refuses it
                "runAsUser": 65534, "runAsGroup": 65534,
            }
            for k in range(STEPS + 1)
        }
    }  # fmt: skip


def node_cluster(
    directory: Path, *, node: str, kube_api_qps: int, jobs: int
) -> AbstractContextManager[services.Cluster]:
    """The real control plane with `node` ("agent", in exec mode: the same script as a host process,
    or KUBELET), its audit log on, as services.cluster(kind=REAL) makes it. The agent runs every one
    of the `jobs` Jobs (and the raw ones) at once, as the kubelet does: its default of two processes
    per CPU would queue these sleeping containers behind each other."""
    return services.real_cluster(
        directory, kube_api_qps=kube_api_qps, mode="exec", node=node, max_running=jobs + RAW_HEADROOM
    )


@dataclass
class PodStarts:
    """A `api_load.Probe`: one raw watch on every Pod (the first instant each Job's Pod shows its
    container running or ended), and a thread creating a raw Job every RAW_INTERVAL_S."""

    image: str
    namespaces: frozenset[str] = frozenset({RAW_NAMESPACE})
    scheduled_at: dict[str, float] = field(default_factory=dict)  # our Job name -> the schedule call
    created_at: dict[str, float] = field(default_factory=dict)  # raw Job name -> its create call
    started_at: dict[str, float] = field(default_factory=dict)  # Job name -> its container first seen started
    error: BaseException | None = None

    def scheduled(self, job_names: Sequence[str], at: float) -> None:
        for name in job_names:
            self.scheduled_at[name] = at

    @contextmanager
    def open(self, cluster: services.Cluster) -> Iterator[None]:
        cluster.ensure_namespace(RAW_NAMESPACE)
        stopping = threading.Event()
        conns: list[http.client.HTTPConnection] = []
        threads = [
            threading.Thread(target=self._guard, args=(self._watch, cluster, stopping, conns), daemon=True),
            threading.Thread(target=self._guard, args=(self._create, cluster, stopping, conns), daemon=True),
        ]
        for t in threads:
            t.start()
        try:
            yield
        finally:
            stopping.set()
            for conn in conns:
                if conn.sock is not None:
                    with suppress(OSError):
                        conn.sock.shutdown(socket.SHUT_RDWR)
            for t in threads:
                t.join(timeout=30)

    def _guard(self, body: Any, *args: Any) -> None:
        try:
            body(*args)
        except Exception as e:
            if not args[1].is_set():
                self.error = e

    def _watch(
        self, cluster: services.Cluster, stopping: threading.Event, conns: list[http.client.HTTPConnection]
    ) -> None:
        rv = ""
        while not stopping.is_set():
            conn = cluster.connection(timeout=None)
            conns.append(conn)
            query = urllib.parse.urlencode({"watch": "true", "timeoutSeconds": "3600", "resourceVersion": rv})
            try:
                conn.request("GET", f"/api/v1/pods?{query}", headers=cluster.headers())
                response = conn.getresponse()
                if response.status != 200:
                    raise RuntimeError(f"watch on Pods answered {response.status}: {response.read()[:200]!r}")
                for line in response:
                    now, event = time.time(), json.loads(line)
                    pod = event["object"]
                    meta = pod.get("metadata") or {}
                    rv = meta.get("resourceVersion", rv)
                    job = (meta.get("labels") or {}).get(JOB_NAME_LABEL)
                    if job and job not in self.started_at and _container_started(pod):
                        self.started_at[job] = now
            except OSError:
                if stopping.is_set():
                    return
                raise
            finally:
                conn.close()

    def _create(
        self, cluster: services.Cluster, stopping: threading.Event, conns: list[http.client.HTTPConnection]
    ) -> None:
        api = config.new_client_from_config(config_file=str(cluster.kubeconfig))
        api.user_agent = f"{services.BENCH_USER_AGENT}-raw"  # the bench's, not ours, in the audit log
        batch = client.BatchV1Api(api)
        try:
            while not stopping.wait(RAW_INTERVAL_S):
                name = f"raw-{uuid.uuid4().hex[:12]}"
                self.created_at[name] = time.time()
                batch.create_namespaced_job(RAW_NAMESPACE, raw_job(name, self.image))  # type: ignore[arg-type]  # a dict body is sent as is
        finally:
            api.close()

    def startup_s(self, span: tuple[float, float]) -> tuple[list[float], list[float]]:
        """Seconds from request to container started, ours and raw, for the Jobs requested within
        `span` (waiting up to STARTED_WAIT_S for their containers; one never seen counts with the
        time waited, a lower bound)."""
        ours = {n: t for n, t in self.scheduled_at.items() if span[0] <= t <= span[1]}
        raw = {n: t for n, t in self.created_at.items() if span[0] <= t <= span[1]}
        with suppress(WaitTimeout):
            wait_until(lambda: set(ours) | set(raw) <= set(self.started_at), timeout=STARTED_WAIT_S, interval=0.5,
                       what="the window's containers started")  # fmt: skip
        now = time.time()
        return (
            [self.started_at.get(n, now) - t for n, t in ours.items()],
            [self.started_at.get(n, now) - t for n, t in raw.items()],
        )


def _container_started(pod: dict[str, Any]) -> bool:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return any({"running", "terminated"} & set((s.get("state") or {}).keys()) for s in statuses)


def raw_job(name: str, image: str) -> dict[str, Any]:
    """The raw Job: the same container as ours (busybox, a sleep and a result), no finalizer, gone 5 s
    after it ends."""
    return {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
        "spec": {
            "backoffLimit": 0, "ttlSecondsAfterFinished": 5,
            "template": {"spec": {"restartPolicy": "Never", "containers": [{
                "name": "worker", "image": image, "command": ["sh", "-c"],
                "args": [f"""sleep {RAW_JOB_S}; printf '{{"raw": true}}' > """ + RESULT_FILE],
                "resources": {"requests": {"memory": "4Mi"}, "limits": {"memory": "32Mi"}},
            }]}},
        },
    }  # fmt: skip


@dataclass
class NodeRun:
    node: str
    window: Window
    startup_ours_s: list[float]
    startup_raw_s: list[float]


def run_nodes(
    ctx: services.BenchContext, knobs: api_load.Knobs, n: int, *, nodes: Sequence[str] = NODES
) -> dict[str, NodeRun]:
    """The steady state of `n` Jobs on the agent's control plane, then on the kubelet's."""
    caps_config = capability_config(knobs.job_s)
    caps_file = ctx.work_dir / "api-load-kubelet-capabilities.yaml"
    caps_file.write_text(yaml.safe_dump(caps_config))
    caps = CapabilityResolver.from_mapping(caps_config, source=str(caps_file))
    runs = {}
    for node in nodes:
        probe = PodStarts(image=BUSYBOX)
        directory = ctx.work_dir / f"rc-{node}-load-{n}"
        window = api_load._ours(
            ctx, knobs, n, caps, caps_file, kind=services.REAL, probe=probe,
            cluster_cm=partial(node_cluster, directory, node=node, kube_api_qps=api_load.REAL_KUBE_API_QPS, jobs=n),
        )  # fmt: skip
        if probe.error is not None:
            raise RuntimeError(f"the Pod-start probe failed on the {node} node: {probe.error}") from probe.error
        ours, raw = probe.startup_s(window.span)
        runs[node] = NodeRun(node, window, ours, raw)
    return runs


def report(result: BenchResult, n: int, runs: dict[str, NodeRun], knobs: api_load.Knobs) -> None:
    """Per node: requests per finished Job by sender, completion and Pod-start percentiles; the
    kubelet's over the agent's as ratios."""
    figures: dict[str, dict[str, float]] = {}
    for node, run in runs.items():
        w, finished = run.window, len(run.window.finished)
        f = figures[node] = {
            "requests_per_job": w.per_job,
            **{f"requests_per_job_{g}": per_finished_job(w.sent_by(g), finished)
               for g in (OURS, CONTROLLERS, SCHEDULER, NODE)},
        }  # fmt: skip
        if w.latencies_s:
            f["completion_latency_p99_s"] = _percentile(w.latencies_s, 0.99)
        for who, values in (("ours", run.startup_ours_s), ("raw", run.startup_raw_s)):
            if values:
                f[f"startup_{who}_p50_s"] = _percentile(values, 0.5)
                f[f"startup_{who}_p99_s"] = _percentile(values, 0.99)
        for key, value in f.items():
            unit = "s" if key.endswith("_s") else "requests"
            result.figures.append(Figure(f"{key}_{node}_{n}", f"{key.replace('_', ' ')}, {node} node, {n:,} Jobs",
                                         unit, [value], ref="27"))  # fmt: skip
        result.params[f"{node}_{n}"] = {
            "window_s": round(w.seconds, 2), "jobs_finished": finished,
            "jobs_finished_expected": round(knobs.window_s * n / knobs.job_s),
            "jobs_in_flight_at_start_and_end": list(w.in_flight), "unrecorded": w.unrecorded,
            "jobs_without_a_bound_pod_at_start": w.pods_behind,
            "startup_samples_ours_raw": [len(run.startup_ours_s), len(run.startup_raw_s)],
            "requests_by_sender": {who: api_load._by_verb(c) for who, c in sorted(w.by_actor.items())
                                   if who != api_load.BENCH},
            "cpu_percent_of_a_core": api_load._cpu_percent(w),
        }  # fmt: skip
    if {"agent", KUBELET} <= set(figures):
        agent, kubelet = figures["agent"], figures[KUBELET]
        for key in sorted(k for k in set(agent) & set(kubelet) if agent[k] > 0):  # the agent has no scheduler
            result.ratios.append(Ratio(f"kubelet_vs_agent_{key}_{n}", f"{key.replace('_', ' ')}, kubelet / agent, "
                                       f"{n:,} Jobs", [kubelet[key] / agent[key]], ref="27"))  # fmt: skip
    result.notes.append(
        "kubelet vs agent: ours on the real control plane with the node agent (exec mode: the script as a host process) and with kube-scheduler, "
        "the kubelet and containerd (busybox containers: sleep, then a result); startup = the engine's schedule call "
        "(ours) or create_namespaced_job (raw, one a second, its namespace left out of the split by sender) -> the "
        "bench's Pod watch first shows the container running or ended"
    )


def run(ctx: services.BenchContext, size: Any) -> BenchResult:
    """`api_load` beside a real node alone: every N of the size's `kubelet_jobs`."""
    knobs = api_load.KNOBS[size.name]
    result = BenchResult(
        name="api_load_kubelet",
        title="API load per Job, completion and Pod start, ours on the node agent vs the kubelet",
        rounds=1,
        params={
            "concurrent_jobs": list(knobs.kubelet_jobs),
            "job_s": knobs.job_s,
            "window_s": knobs.window_s,
            "raw_interval_s": RAW_INTERVAL_S,
        },
    )
    for n in knobs.kubelet_jobs:
        report(result, n, run_nodes(ctx, knobs, n), knobs)
    return result
