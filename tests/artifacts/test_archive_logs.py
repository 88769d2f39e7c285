"""Logs kept after the Pod is gone (`archiveLogs`): the pure parts (the tail found through pods/log's
cuts, the keys, what a Pod says of itself, the config), then against a real SeaweedFS, PostgreSQL,
Redis and localcluster: a log is in the store before our finalizer leaves its Pod, `show --logs`
prints it once the Pod is gone, a store that is down holds the Pod (and loses no result) until a
later release, and the sweep keeps logs as the record of an ended dispatch. Then a log that cannot
be read (pods/log failed by a relay in front of localcluster): for now, it holds the Pod until the
API answers; for good (404), or still past the grace, the Pod is freed and the key the failure
names holds a note saying why."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from objectstore import ObjectStoreServer
from records import end, schedule
from sqlalchemy.orm import Session, sessionmaker
from store_relay import Listener

from k8s_dispatch.artifacts import Artifacts, keys, logs
from k8s_dispatch.artifacts.cleanup import clean
from k8s_dispatch.artifacts.errors import ObjectStoreUnavailable
from k8s_dispatch.core.errors import ConfigError, PodLogUnavailable
from k8s_dispatch.core.settings import load_settings
from k8s_dispatch.delivery.cleanup import release_pods
from k8s_dispatch.delivery.complete import CompleteOutcome, complete_job
from k8s_dispatch.delivery.create import CreateOutcome, create_job_for
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.demo.localcluster import LocalCluster, kubeconfig
from k8s_dispatch.demo.localcluster.node import log_slice
from k8s_dispatch.ops.processes import wait_until
from k8s_dispatch.ops.show import write_logs
from k8s_dispatch.store import dispatches, scheduling
from k8s_dispatch.store.db import make_sessionmaker, transaction
from k8s_dispatch.store.models import EventType, utcnow
from k8s_dispatch.workers import failure_detail
from k8s_dispatch.workers.job_status import job_state
from k8s_dispatch.workers.manifest import CONTAINER_NAME, FINALIZER, job_name
from k8s_dispatch.workers.resolver import CapabilityResolver

SIM = "localcluster.k8s-dispatch.io/"
LOG = "".join(f"step {i}: working\n" for i in range(3000)) + "giving up: no input\n"  # ~70 KB
SHORT = "hello from the container\n"


def _sim(*, fail: bool, log: str = LOG, duration_ms: int = 20, **fields: Any) -> dict[str, Any]:
    outcome = {SIM + "outcome": "fail", SIM + "exit-code": "2"} if fail else {}
    return {
        "worker": "sim",
        "image": "sim:1",
        "annotations": {SIM + "duration-ms": str(duration_ms), SIM + "log": log, **outcome},
        **fields,
    }


CAPABILITIES = {
    "capabilities": {
        "fails": _sim(fail=True),  # archiveLogs: onFailure, the default
        "succeeds": _sim(fail=False, log=SHORT),
        "always": _sim(fail=False, log=SHORT, archiveLogs="always"),
        "never": _sim(fail=True, log=SHORT, archiveLogs="never"),
        # runs past its Job's deadline: the Job controller deletes its Pod, the node kills it
        "overdue": _sim(fail=False, log=SHORT, duration_ms=120_000, activeDeadlineSeconds=2),
    }
}


# --- the pure parts ---------------------------------------------------------------------------


def _reader(log: bytes, calls: list[tuple[int, int]]) -> Any:
    def read(*, tail_lines: int, limit_bytes: int) -> bytes:  # pods/log's cuts, as localcluster makes them
        calls.append((tail_lines, limit_bytes))
        return log_slice(log, tail_lines=tail_lines, limit_bytes=limit_bytes)

    return read


def _body(archived: bytes) -> tuple[bool, bytes]:
    """(cut, the log's bytes) of what `read_tail` returned."""
    if archived.startswith(b"[k8s-dispatch: this log was longer than"):
        return True, archived.split(b"]\n", 1)[1]
    return False, archived


@pytest.mark.parametrize(
    ("log", "max_bytes", "cut", "kept", "reads"),
    [
        (b"", 1024, False, b"", 1),
        (b"a\n" * 512, 1024, False, b"a\n" * 512, 1),  # exactly the bound: whole, one read
        (b"no newline at the end", 1024, False, b"no newline at the end", 1),
        (b"".join(b"line %04d\n" % i for i in range(1000)), 1024, True, None, 2),  # the last lines
        (b"x" * 5000, 1024, True, b"x" * 1024, 2),  # one line longer than the bound: its start
        (b"short\n" * 10 + b"y" * 4000 + b"\n", 1024, True, b"y" * 1024, 5),  # halved down to 1 line
    ],
)
def test_a_log_is_whole_within_the_bound_else_its_last_lines_said_cut(
    log: bytes, max_bytes: int, cut: bool, kept: bytes | None, reads: int
) -> None:
    calls: list[tuple[int, int]] = []
    was_cut, body = _body(logs.read_tail(_reader(log, calls), max_bytes))
    assert was_cut is cut
    assert len(body) <= max_bytes
    if kept is not None:
        assert body == kept
    else:
        assert log.endswith(body) and body.startswith(b"line ") and len(body) > max_bytes // 2
    assert len(calls) == reads and calls[0] == (logs.ALL_LINES, max_bytes + 1)


@given(
    lines=st.lists(st.binary(max_size=300).map(lambda b: b.replace(b"\n", b"")), max_size=60),
    max_bytes=st.integers(1, 2000),
)
def test_read_tail_never_exceeds_its_bound_and_keeps_an_end_where_lines_allow(
    lines: list[bytes], max_bytes: int
) -> None:
    log = b"\n".join(lines)
    calls: list[tuple[int, int]] = []
    was_cut, body = _body(logs.read_tail(_reader(log, calls), max_bytes))
    assert len(body) <= max_bytes and len(calls) <= 1 + logs.TAIL_READS
    if not was_cut:
        assert body == log
    elif not log.endswith(body):  # only when the last lines asked for were too long: their start
        assert len(body) == max_bytes and body in log


def test_log_keys_sit_under_their_attempt_and_belong_to_their_dispatch() -> None:
    dispatch_id = str(uuid.uuid4())
    key = keys.log_key("p", dispatch_id, 2, "kd-x-abcde")
    assert key == f"p/{dispatch_id}/2/logs/kd-x-abcde"
    assert keys.parse_log_key("p", key) == (dispatch_id, 2, "kd-x-abcde")
    assert keys.dispatch_of("p", key) == dispatch_id
    assert keys.parse_key("p", key) is None  # never taken for a result
    for other in (f"p/{dispatch_id}/02/logs/x", f"p/{dispatch_id}/2/logs/", f"p/{dispatch_id}/2/log/x", "q/" + key):
        assert keys.parse_log_key("p", other) is None


def _pod(*, phase: str, state: dict[str, Any], annotations: dict[str, str] | None = None) -> dict[str, Any]:
    from k8s_dispatch.workers import labels
    from k8s_dispatch.workers import types as t

    ref = t.DispatchRef(
        dispatch_id=t.DispatchId(str(uuid.uuid4())), case_id=t.CaseId("c"), tenancy_id=t.TenancyId("t"),
        capability=t.CapabilityName("fails"), worker_name=t.WorkerName("w"), idempotency_key=t.IdempotencyKey("k"),
    )  # fmt: skip
    our_labels, our_annotations = labels.encode(ref)
    return {
        "metadata": {
            "name": "kd-x-abcde",
            "labels": our_labels,
            "annotations": {**our_annotations, labels.ATTEMPT_KEY: "1", **(annotations or {})},
        },
        "status": {"phase": phase, "containerStatuses": [{"name": CONTAINER_NAME, "state": state}]},
    }


def test_a_pod_says_whose_log_it_holds_and_how_it_ended() -> None:
    ended = {"terminated": {"exitCode": 2, "finishedAt": "2026-12-03T04:20:00Z"}}
    failed = failure_detail.pod_log(_pod(phase="Failed", state=ended))
    assert failed is not None and (failed.attempt, failed.started, failed.failed) == (1, True, True)
    assert failed.finished_at == datetime(2026, 12, 3, 4, 20, tzinfo=UTC)  # how long an unreadable log is waited for
    ok = failure_detail.pod_log(_pod(phase="Succeeded", state={"terminated": {"exitCode": 0}}))
    assert ok is not None and (ok.started, ok.failed) == (True, False)
    waiting = failure_detail.pod_log(_pod(phase="Pending", state={"waiting": {"reason": "ImagePullBackOff"}}))
    assert waiting is not None and not waiting.started  # no log to read: no request
    running = failure_detail.pod_log(_pod(phase="Running", state={"running": {"startedAt": "2026-12-03T04:19:00Z"}}))
    assert running is not None and running.started and running.finished_at is None
    assert failure_detail.pod_log({"metadata": {"name": "other", "labels": {"app": "x"}}}) is None
    garbled = _pod(phase="Failed", state={}, annotations={"k8s-dispatch.io/attempt": "one"})
    assert failure_detail.pod_log(garbled) is None


def test_the_note_for_a_log_given_up_on_is_one_bounded_line() -> None:
    assert logs.unreadable_note("kd-x-abcde", "NotFound: read the log\nof pod: 404") == (
        b"[k8s-dispatch: the log of pod kd-x-abcde could not be read: NotFound: read the log of pod: 404]\n"
    )
    long = logs.unreadable_note("p", "x" * 5000 + "\u00e9\ud800")
    assert long.count(b"\n") == 1 and len(long) < logs.MAX_WHY + 100 and long.endswith(b"...]\n")


def test_the_failure_detail_names_the_archived_log() -> None:
    detail = failure_detail.detail({}, None, log=b"boom\n", log_key="p/d/0/logs/kd-x-abcde")
    assert detail == {"log_tail": "boom\n", "log_key": "p/d/0/logs/kd-x-abcde"}
    assert "log_key" not in failure_detail.detail({}, None, log=b"boom\n")


def test_archive_logs_is_checked_when_the_config_loads(tmp_path: Path) -> None:
    def spec(**fields: Any) -> Any:
        config = {"capabilities": {"c": {"worker": "w", "image": "i", **fields}}}
        return CapabilityResolver.from_mapping(config).spec("c")

    assert spec().archive_logs == "onFailure"
    assert spec().archives_log(failed=True) and not spec().archives_log(failed=False)
    assert spec(archiveLogs="always").archives_log(failed=False)
    assert not spec(archiveLogs="never").archives_log(failed=True)
    with pytest.raises(ConfigError, match="field 'archiveLogs': 'sometimes' is not one of onFailure, always, never"):
        spec(archiveLogs="sometimes")
    config = tmp_path / "caps.yaml"
    config.write_text("capabilities: {c: {worker: w, image: i, archiveLogs: always}}\n")
    with pytest.raises(ConfigError, match=r"\['c'\] have archiveLogs: always, but no object store is configured"):
        CapabilityResolver.from_settings(load_settings({"K8S_DISPATCH_CAPABILITIES": str(config)}))
    config.write_text("capabilities: {c: {worker: w, image: i}}\n")  # onFailure, the default: a no-op
    assert CapabilityResolver.from_settings(load_settings({"K8S_DISPATCH_CAPABILITIES": str(config)}))
    assert load_settings({}).archive_log_max_bytes == 10 * 1024 * 1024


# --- against the real services ----------------------------------------------------------------


def _env(
    cluster: LocalCluster, store: ObjectStoreServer, prefix: str, pg_url: str, redis_url: str, key_prefix: str,
    caps: Path,
) -> dict[str, str]:  # fmt: skip
    return {
        "K8S_DISPATCH_DATABASE_URL": pg_url,
        "K8S_DISPATCH_REDIS_URL": redis_url,
        "K8S_DISPATCH_KEY_PREFIX": f"{key_prefix}-{prefix}",
        "K8S_DISPATCH_NAMESPACE": "default",
        "K8S_DISPATCH_KUBECONFIG": str(cluster.kubeconfig),
        "K8S_DISPATCH_CAPABILITIES": str(caps),
        "K8S_DISPATCH_ARCHIVE_LOG_MAX_BYTES": str(16 * 1024),  # LOG is longer: its tail is kept
        **store.env(prefix),
    }


@pytest.fixture
def env(
    sim_cluster: LocalCluster, object_store: ObjectStoreServer, unique_prefix: str, pg_url: str, redis_url: str,
    key_prefix: str, tmp_path: Path,
) -> dict[str, str]:  # fmt: skip
    caps = tmp_path / "capabilities.yaml"
    caps.write_text(yaml.safe_dump(CAPABILITIES))
    return _env(sim_cluster, object_store, unique_prefix, pg_url, redis_url, key_prefix, caps)


@pytest.fixture
def rt(env: dict[str, str]) -> Iterator[Runtime]:
    runtime = Runtime.from_settings(load_settings(env))
    yield runtime
    runtime.close()


def _run(rt: Runtime, capability: str) -> str:
    case_id = f"case-{uuid.uuid4().hex[:8]}"
    with transaction(rt.sessions) as session:
        scheduling.create_case(session, case_id=case_id, tenancy_id="t")
        dispatch_id = scheduling.schedule(
            session, case_id=case_id, tenancy_id="t", capability=capability, input={},
            idempotency_key=uuid.uuid4().hex, router=rt.resolver, max_input_bytes=rt.settings.max_input_bytes,
        ).dispatch_id  # fmt: skip
    assert create_job_for(rt, dispatch_id) is CreateOutcome.CREATED
    wait_until(
        lambda: job_state(rt.kube.get_job("default", job_name(dispatch_id))).terminal, what="its job ended", timeout=60
    )
    return dispatch_id


def _archived(rt: Runtime, dispatch_id: str) -> list[logs.ArchivedLog]:
    store = Artifacts.from_settings(rt.settings)
    assert store is not None
    return logs.archived_logs(store, dispatch_id)


def _pods(rt: Runtime, dispatch_id: str) -> list[dict[str, Any]]:
    return rt.kube.list_pods("default", label_selector=f"batch.kubernetes.io/job-name={job_name(dispatch_id)}")


def test_a_failed_pods_log_is_archived_before_its_release_and_shown_after_it_is_gone(
    rt: Runtime, env: dict[str, str]
) -> None:
    dispatch_id = _run(rt, "fails")
    (pod,) = _pods(rt, dispatch_id)
    assert complete_job(rt, "default", job_name(dispatch_id)) is CompleteOutcome.COMPLETED
    with transaction(rt.sessions) as session:
        event = dispatches.terminal_event(session, dispatch_id)
    assert event is not None and event.type == EventType.WORKER_FAILED

    (archived,) = _archived(rt, dispatch_id)
    assert archived.key == keys.log_key(rt.settings.object_store_prefix, dispatch_id, 0, pod["metadata"]["name"])
    assert event.payload["detail"]["log_key"] == archived.key  # the failure names its whole log
    wait_until(lambda: not _pods(rt, dispatch_id), what="the pod is gone", timeout=30)

    out = io.BytesIO()
    assert write_logs(rt.settings, dispatch_id, out) == 1
    header, body = out.getvalue().split(b"\n", 1)
    assert header == f"==> {archived.key} (attempt 0, pod {pod['metadata']['name']}) <==".encode()
    was_cut, kept = _body(body)
    assert was_cut and LOG.encode().endswith(kept) and kept.endswith(b"giving up: no input\n")
    assert len(kept) > 14 * 1024  # the last lines within 16 KiB, not a 2 KiB tail

    command = [sys.executable, "-m", "k8s_dispatch.cli", "show", dispatch_id, "--logs"]
    shown = subprocess.run(command, env={**os.environ, **env}, capture_output=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == out.getvalue()
    other = str(uuid.uuid4())
    none = subprocess.run([*command[:4], other, "--logs"], env={**os.environ, **env}, capture_output=True, timeout=60)
    assert none.returncode == 1 and b"no archived log for dispatch" in none.stderr


def test_only_the_pods_their_capability_names_are_archived(rt: Runtime) -> None:
    ran = {capability: _run(rt, capability) for capability in ("succeeds", "always", "never")}
    for dispatch_id in ran.values():
        assert complete_job(rt, "default", job_name(dispatch_id)) is CompleteOutcome.COMPLETED
    assert _archived(rt, ran["succeeds"]) == []  # onFailure: a success keeps no log
    assert _archived(rt, ran["never"]) == []
    (archived,) = _archived(rt, ran["always"])
    store = Artifacts.from_settings(rt.settings)
    assert store is not None
    assert b"".join(logs.read_log(store, archived)) == SHORT.encode()  # whole: no note


def test_a_store_that_is_down_holds_the_pod_and_a_later_release_archives_its_log(
    rt: Runtime, env: dict[str, str]
) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    down = Runtime.from_settings(load_settings({**env, "K8S_DISPATCH_OBJECT_STORE_ENDPOINT": closed}))
    try:
        dispatch_id = _run(rt, "fails")
        with pytest.raises(ObjectStoreUnavailable):
            complete_job(down, "default", job_name(dispatch_id))
    finally:
        down.close()
    with transaction(rt.sessions) as session:  # the result was recorded before any release
        event = dispatches.terminal_event(session, dispatch_id)
    assert event is not None and event.type == EventType.WORKER_FAILED
    (pod,) = _pods(rt, dispatch_id)
    assert FINALIZER in pod["metadata"]["finalizers"]  # held: its log is still to be kept
    store = Artifacts.from_settings(rt.settings)
    assert store is not None
    # The store is back; an upload, then a crash before the release ...
    assert logs.archive_logs(store, rt.kube, rt.resolver, "default", [failure_detail.pod_log(pod)]) == 1
    (first,) = _archived(rt, dispatch_id)
    uploaded = b"".join(logs.read_log(store, first))
    # ... and the release tried again uploads the same key before it frees the Pod.
    assert complete_job(rt, "default", job_name(dispatch_id)) is CompleteOutcome.ALREADY_TERMINAL
    (archived,) = _archived(rt, dispatch_id)
    assert (archived.key, archived.pod) == (first.key, pod["metadata"]["name"])
    assert b"".join(logs.read_log(store, archived)) == uploaded and uploaded.endswith(b"giving up: no input\n")
    wait_until(lambda: not _pods(rt, dispatch_id), what="the pod is freed and gone", timeout=30)


@pytest.fixture
def sessions(pg_url: str) -> Iterator[sessionmaker[Session]]:
    from k8s_dispatch.store.db import make_engine

    engine = make_engine(pg_url)
    yield make_sessionmaker(engine)
    engine.dispose()


def test_the_sweep_keeps_logs_as_the_record_of_an_ended_dispatch_until_their_retention(
    object_store: ObjectStoreServer, unique_prefix: str, sessions: sessionmaker[Session]
) -> None:
    built = Artifacts.from_settings(load_settings(object_store.env(unique_prefix)))
    assert built is not None
    store = replace(built, orphan_grace_s=0)
    failed, running = schedule(sessions), schedule(sessions)
    lost_attempt = keys.log_key(store.prefix, failed, 0, "kd-a-00000")
    last_attempt = keys.log_key(store.prefix, failed, 1, "kd-a-11111")
    in_flight = keys.log_key(store.prefix, running, 0, "kd-b-00000")
    stranger = keys.log_key(store.prefix, str(uuid.uuid4()), 0, "kd-c-00000")
    for key in (lost_attempt, last_attempt, in_flight, stranger):
        store.store.put(key, b"a log\n")
    end(sessions, failed, EventType.WORKER_FAILED, {"reason": "BackoffLimitExceeded"})

    report = clean(store, sessions)
    assert report.deleted_keys == [stranger]  # no dispatch owns it: by its own age
    assert clean(store, sessions, now=utcnow() + timedelta(days=400)).deleted_keys == []  # no retention: kept
    kept_a_day = replace(store, retention_days=1)
    assert clean(kept_a_day, sessions, now=utcnow() + timedelta(hours=23)).deleted_keys == []
    expired = clean(kept_a_day, sessions, now=utcnow() + timedelta(days=1, minutes=1))
    assert sorted(expired.deleted_keys) == sorted([lost_attempt, last_attempt])
    assert [item.key for item in store.store.list(store.prefix + "/")] == [in_flight]


# --- a log that cannot be read ----------------------------------------------------------------


class PodLogFaults(Listener):
    """A TCP relay in front of localcluster's plain-http listener that forwards every request
    unchanged but, while `fault` is set, pods/log GETs: those it answers itself, the way the API
    fails them when the Pod's kubelet cannot be reached ("500": kube-apiserver's InternalError
    from its proxy to the node) or no longer knows the Pod ("404"), or the way a load balancer
    drops them ("reset": the connection cut before forwarding). Requests come one at a time per connection (urllib3 does not pipeline), so
    a request's line starts a chunk from the client."""

    LOG_GET = re.compile(rb"GET /api/v1/namespaces/([^/ ]+)/pods/([^/ ]+)/log[? ]")

    def __init__(self, upstream_url: str) -> None:
        host, _, port = upstream_url.removeprefix("http://").partition(":")
        self._upstream = (host, int(port.rstrip("/")))
        self.fault: str | None = None
        self.failed = 0  # pods/log requests answered here
        super().__init__()

    def _serve(self, client: socket.socket) -> None:
        with client, socket.create_connection(self._upstream) as upstream:
            threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()
            while chunk := client.recv(65536):
                found = self.LOG_GET.match(chunk)
                if found is not None and self.fault is not None:
                    self.failed += 1
                    if self.fault == "reset":
                        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    else:
                        client.sendall(self._answer(self.fault, *(g.decode() for g in found.groups())))
                    return
                upstream.sendall(chunk)

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while chunk := source.recv(65536):
                sink.sendall(chunk)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    @staticmethod
    def _answer(fault: str, namespace: str, pod: str) -> bytes:
        if fault == "404":  # the kubelet no longer knows the Pod
            code, reason, phrase, message = 404, "NotFound", "Not Found", f'pod "{namespace}/{pod}" does not exist'
        else:
            url = f"https://127.0.0.1:10250/containerLogs/{namespace}/{pod}/{CONTAINER_NAME}"
            code, reason, phrase = 500, "InternalError", "Internal Server Error"
            message = f'Get "{url}": dial tcp 127.0.0.1:10250: connect: connection refused'
        body = json.dumps({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code,
        }).encode()  # fmt: skip
        head = (
            f"HTTP/1.1 {code} {phrase}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        return head.encode() + body


@pytest.fixture
def faults(sim_cluster: LocalCluster) -> Iterator[PodLogFaults]:
    relay = PodLogFaults(sim_cluster.url)
    yield relay
    relay.close()


@pytest.fixture
def relayed(env: dict[str, str], sim_cluster: LocalCluster, faults: PodLogFaults, tmp_path: Path) -> Iterator[Runtime]:
    """A runtime whose API requests go through `faults`."""
    config = kubeconfig.write(tmp_path / "relayed.kubeconfig", faults.url, sim_cluster.token)
    runtime = Runtime.from_settings(load_settings({**env, "K8S_DISPATCH_KUBECONFIG": str(config)}))
    yield runtime
    runtime.close()


def _failure(rt: Runtime, dispatch_id: str) -> dict[str, Any]:
    with transaction(rt.sessions) as session:
        event = dispatches.terminal_event(session, dispatch_id)
    assert event is not None and event.type == EventType.WORKER_FAILED
    detail: dict[str, Any] = event.payload["detail"]
    return detail


def _stored(rt: Runtime, key: str) -> bytes:
    store = Artifacts.from_settings(rt.settings)
    assert store is not None
    return b"".join(store.store.read(key))


def _finished_at(pod: dict[str, Any]) -> datetime:
    found = failure_detail.pod_log(pod)
    assert found is not None and found.finished_at is not None
    return found.finished_at


@pytest.mark.parametrize("fault", ["500", "reset"])
def test_a_log_that_cannot_be_read_for_now_holds_its_pod_until_the_api_answers(
    rt: Runtime, relayed: Runtime, faults: PodLogFaults, fault: str
) -> None:
    dispatch_id = _run(rt, "fails")
    faults.fault = fault
    with pytest.raises(PodLogUnavailable):
        complete_job(relayed, "default", job_name(dispatch_id))
    assert faults.failed >= 2  # the failure detail's tail, then the archive's read
    key = _failure(rt, dispatch_id)["log_key"]  # recorded before any release, naming the log
    (pod,) = _pods(rt, dispatch_id)
    assert FINALIZER in pod["metadata"]["finalizers"]  # held: its log is still to be kept
    assert key == keys.log_key(rt.settings.object_store_prefix, dispatch_id, 0, pod["metadata"]["name"])
    assert _archived(rt, dispatch_id) == []

    faults.fault = None  # the API answers again: the release tried again keeps the log, then frees
    assert complete_job(relayed, "default", job_name(dispatch_id)) is CompleteOutcome.ALREADY_TERMINAL
    (archived,) = _archived(rt, dispatch_id)
    assert archived.key == key and _stored(rt, key).endswith(b"giving up: no input\n")
    wait_until(lambda: not _pods(rt, dispatch_id), what="the pod is freed and gone", timeout=30)


def test_past_the_grace_an_unreadable_log_is_given_up_and_its_key_says_why(
    rt: Runtime, relayed: Runtime, faults: PodLogFaults
) -> None:
    """Two Pods whose logs cannot be read any more: one whose log a release stored before it
    crashed (the log stays), one never stored (a note). Within the grace both stay held."""
    stored, unread = _run(rt, "fails"), _run(rt, "fails")
    (kept_pod,) = _pods(rt, stored)
    (pod,) = _pods(rt, unread)
    store = Artifacts.from_settings(rt.settings)
    assert store is not None
    assert logs.archive_logs(store, rt.kube, rt.resolver, "default", [failure_detail.pod_log(kept_pod)]) == 1
    (kept,) = _archived(rt, stored)
    name = pod["metadata"]["name"]
    key = keys.log_key(rt.settings.object_store_prefix, unread, 0, name)
    ended = max(_finished_at(pod), _finished_at(kept_pod))
    faults.fault = "500"
    within = ended + timedelta(seconds=logs.UNREADABLE_GRACE_S - 5)
    with pytest.raises(PodLogUnavailable):
        release_pods(relayed, "default", [kept_pod, pod], now=within)
    assert _archived(rt, unread) == []

    past = ended + timedelta(seconds=logs.UNREADABLE_GRACE_S + 5)
    assert release_pods(relayed, "default", [kept_pod, pod], now=past) == 2  # freed
    assert _stored(rt, kept.key).endswith(b"giving up: no input\n")  # never replaced by a note
    note = _stored(rt, key)
    assert note.startswith(f"[k8s-dispatch: the log of pod {name} could not be read: ApiUnavailable: ".encode())
    assert note.endswith(b" s after it ended)]\n") and note.count(b"\n") == 1
    assert b"500 InternalError" in note and b"connection refused" in note
    for dispatch_id in (stored, unread):
        (freed,) = _pods(rt, dispatch_id)
        assert FINALIZER not in (freed["metadata"].get("finalizers") or [])


def test_a_log_never_to_be_read_again_leaves_a_note_at_the_key_its_failure_names(
    rt: Runtime, relayed: Runtime, faults: PodLogFaults
) -> None:
    """A Job past its activeDeadlineSeconds: the Job controller deletes its Pod, the node kills it
    and, on a real kubelet, forgets it, while our finalizer keeps the Pod: pods/log answers 404.
    The failure names the log's key all the same, and the key holds a note saying why."""
    dispatch_id = _run(rt, "overdue")
    (pod,) = _pods(rt, dispatch_id)
    name = pod["metadata"]["name"]
    faults.fault = "404"
    assert complete_job(relayed, "default", job_name(dispatch_id)) is CompleteOutcome.COMPLETED  # not held
    detail = _failure(rt, dispatch_id)
    assert detail["job_reason"] == "DeadlineExceeded"
    (archived,) = _archived(rt, dispatch_id)
    assert archived.key == detail["log_key"]
    note = _stored(rt, archived.key)
    assert note.startswith(f"[k8s-dispatch: the log of pod {name} could not be read: NotFound: ".encode())
    assert note.endswith(b"]\n") and note.count(b"\n") == 1
    wait_until(lambda: not _pods(rt, dispatch_id), what="the pod is freed and gone", timeout=30)
