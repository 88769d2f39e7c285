"""The fault proxy in front of kube-apiserver (the chaos run's API faults on the real control plane):
through it requests, errors and watches arrive as kube-apiserver sent them, and each injected fault
is what the proxy says it is: a Status answer, a cut before forwarding (nothing written), or a cut
after forwarding (the write happened, the answer is lost)."""

from __future__ import annotations

import base64
import http.client
import json
import secrets
import threading
import types
from collections.abc import Iterator
from dataclasses import replace

import pytest
from clusters import ClusterHandle
from kubernetes import client, watch

from k8s_dispatch.lab.realcluster import faultproxy
from k8s_dispatch.lab.realcluster.controlplane import User, kubeconfig_text
from k8s_dispatch.ops.processes import free_port, wait_for_log


@pytest.fixture(scope="module")
def proxied(real_cluster: ClusterHandle, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    """The real control plane as seen through a fault proxy (faults off until a test sets them)."""
    directory = tmp_path_factory.mktemp("faultproxy")
    token = secrets.token_urlsafe(16)
    (directory / "token").write_text(token)
    port = free_port()
    proc = faultproxy.process(real_cluster.backend, port=port, token_file=directory / "token", log_dir=directory)
    proc.start()
    try:
        wait_for_log(proc, faultproxy.LISTENING, timeout=60)
        url = f"https://127.0.0.1:{port}"
        kubeconfig = directory / "kubeconfig"
        ca_data = base64.b64encode(real_cluster.ca_file.read_bytes()).decode()  # it signed the proxy's cert too
        kubeconfig.write_text(kubeconfig_text(url, ca_data, User("admin", real_cluster.token)))
        handle = replace(real_cluster, url=url, kubeconfig=kubeconfig, _namespaces=set())
        handle.control_token = token  # type: ignore[attr-defined]
        yield handle
    finally:
        proc.stop()


def set_faults(handle: ClusterHandle, **settings: object) -> dict:
    return faultproxy.call(handle.url, token=handle.control_token, ca_file=handle.ca_file, settings=settings)  # type: ignore[attr-defined]


@pytest.fixture
def faults_off(proxied: ClusterHandle) -> Iterator[ClusterHandle]:
    set_faults(proxied, rate=0.0, latency_ms=0, kinds=[k.value for k in faultproxy.Fault])
    yield proxied
    set_faults(proxied, rate=0.0, latency_ms=0, kinds=[k.value for k in faultproxy.Fault])


def config_map(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": {"k": "v"}}


def test_requests_errors_and_watches_pass_through_as_sent(
    faults_off: ClusterHandle, real_cluster: ClusterHandle
) -> None:
    ns = real_cluster.ensure_namespace("faultproxy-pass")
    with faults_off.api_client() as api:
        core = client.CoreV1Api(api)
        core.create_namespaced_config_map(ns, config_map("through"))
        assert core.read_namespaced_config_map("through", ns).data == {"k": "v"}
        with pytest.raises(client.ApiException) as missing:
            core.read_namespaced_config_map("absent", ns)
        assert missing.value.status == 404 and json.loads(missing.value.body)["reason"] == "NotFound"

        listed = core.list_namespaced_config_map(ns)
        seen: list[str] = []
        done = threading.Event()

        def watch_through_proxy() -> None:
            w = watch.Watch()
            for event in w.stream(
                core.list_namespaced_config_map,
                ns,
                resource_version=listed.metadata.resource_version,
                timeout_seconds=20,
            ):
                seen.append(f"{event['type']} {event['object'].metadata.name}")
                if event["object"].metadata.name == "later":
                    w.stop()
            done.set()

        watcher = threading.Thread(target=watch_through_proxy, daemon=True)
        watcher.start()
        with real_cluster.api_client() as direct:  # written behind the proxy's back
            client.CoreV1Api(direct).create_namespaced_config_map(ns, config_map("later"))
        assert done.wait(30), "the watch through the proxy never saw the event"
        assert seen == ["ADDED later"]
    report = set_faults(faults_off)
    assert (report["injected"], report["ready"], report["unready_cuts"]) == (0, True, 0)


@pytest.mark.parametrize(("kind", "code", "reason"), [
    ("500", 500, "InternalError"), ("503", 503, "ServiceUnavailable"), ("429", 429, "TooManyRequests"),
])  # fmt: skip
def test_a_status_fault_answers_as_kube_apiserver_would(faults_off: ClusterHandle, real_cluster: ClusterHandle,
                                                        kind: str, code: int, reason: str) -> None:  # fmt: skip
    ns = real_cluster.ensure_namespace("faultproxy-status")
    before = set_faults(faults_off)["by_kind"].get(kind, 0)
    set_faults(faults_off, rate=1.0, kinds=[kind])
    status, headers, body = faults_off.raw("POST", f"/api/v1/namespaces/{ns}/configmaps", config_map(f"never-{kind}"))
    set_faults(faults_off, rate=0.0)
    answer = json.loads(body)
    assert (status, answer["kind"], answer["code"], answer["reason"]) == (code, "Status", code, reason)
    assert headers.get("retry-after") == ("1" if code in (503, 429) else None)
    assert real_cluster.raw("GET", f"/api/v1/namespaces/{ns}/configmaps/never-{kind}")[0] == 404, "nothing forwarded"
    assert set_faults(faults_off)["by_kind"][kind] == before + 1


@pytest.mark.parametrize(("kind", "written"), [("reset", False), ("lost_response", True)])
def test_a_cut_connection_before_or_after_forwarding(faults_off: ClusterHandle, real_cluster: ClusterHandle,
                                                     kind: str, written: bool) -> None:  # fmt: skip
    ns = real_cluster.ensure_namespace("faultproxy-cut")
    name = f"cut-{kind.replace('_', '-')}"
    set_faults(faults_off, rate=1.0, kinds=[kind])
    try:
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            faults_off.raw("POST", f"/api/v1/namespaces/{ns}/configmaps", config_map(name))
    finally:
        set_faults(faults_off, rate=0.0)
    status, _, _ = real_cluster.raw("GET", f"/api/v1/namespaces/{ns}/configmaps/{name}")
    assert status == (200 if written else 404)
    # The official client sees the cut as a connection error, not as an answer.
    set_faults(faults_off, rate=1.0, kinds=[kind])
    try:
        with faults_off.api_client() as api, pytest.raises(Exception) as raised:
            client.CoreV1Api(api).read_namespaced_config_map(name, ns, _request_timeout=10)
    finally:
        set_faults(faults_off, rate=0.0)
    assert not isinstance(raised.value, client.ApiException), raised.value


def test_the_control_endpoint_wants_its_token_and_valid_settings(faults_off: ClusterHandle) -> None:
    with pytest.raises(OSError) as refused:
        faultproxy.call(faults_off.url, token="wrong", ca_file=faults_off.ca_file)
    assert getattr(refused.value, "code", None) == 401
    for bad in ({"rate": 1.5}, {"latency_ms": -1}, {"kinds": ["teapot"]}, {"kinds": []}):
        with pytest.raises(OSError) as invalid:
            set_faults(faults_off, **bad)
        assert getattr(invalid.value, "code", None) == 400, bad
    assert set_faults(faults_off)["rate"] == 0.0


def test_nothing_is_forwarded_while_kube_apiserver_is_not_ready(real_cluster: ClusterHandle, tmp_path) -> None:
    """The readiness gate, as a load balancer's: a proxy whose /readyz checks fail (here: refused,
    its token is not one kube-apiserver knows) cuts every connection and forwards nothing."""
    (tmp_path / "token").write_text("control")
    port = free_port()
    plane = real_cluster.backend
    unknown = types.SimpleNamespace(directory=plane.directory, url=plane.url, token="not-a-token")
    proc = faultproxy.process(unknown, port=port, token_file=tmp_path / "token", log_dir=tmp_path)
    proc.start()
    try:
        wait_for_log(proc, faultproxy.LISTENING, timeout=60)
        ns = real_cluster.ensure_namespace("faultproxy-gate")
        gated = replace(real_cluster, url=f"https://127.0.0.1:{port}", _namespaces=set())
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            gated.raw("POST", f"/api/v1/namespaces/{ns}/configmaps", config_map("gated"))
        report = faultproxy.call(gated.url, token="control", ca_file=real_cluster.ca_file)
    finally:
        proc.stop()
    assert (report["ready"], report["unready_cuts"], report["injected"]) == (False, 1, 0)
    assert real_cluster.raw("GET", f"/api/v1/namespaces/{ns}/configmaps/gated")[0] == 404


def test_a_client_that_leaves_a_watch_does_not_close_the_gate(
    faults_off: ClusterHandle, real_cluster: ClusterHandle
) -> None:
    """A worker closes its watch at the end of each slice: the proxy's next write to it fails, which
    says nothing of kube-apiserver. Requests that follow are forwarded, never cut as if it were not
    ready (which cut every request of a chaos run until the next readiness check)."""
    ns = real_cluster.ensure_namespace("faultproxy-leave")
    with faults_off.api_client() as api, real_cluster.api_client() as direct:
        core, behind = client.CoreV1Api(api), client.CoreV1Api(direct)
        for round_ in range(3):
            stream = core.list_namespaced_config_map(ns, watch=True, timeout_seconds=60, _preload_content=False)
            behind.create_namespaced_config_map(ns, config_map(f"seen-{round_}"))
            assert stream.read(1)  # the watch is open and answering
            stream.close()  # the client leaves; the next events written to it fail in the proxy
            for i in range(3):
                behind.create_namespaced_config_map(ns, config_map(f"after-{round_}-{i}"))
            for _ in range(20):  # requests through the proxy meanwhile: every one forwarded
                assert core.read_namespaced_config_map(f"seen-{round_}", ns).data == {"k": "v"}
    report = set_faults(faults_off)
    assert (report["ready"], report["unready_cuts"]) == (True, 0)
