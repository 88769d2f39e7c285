"""Secret inputs on both clusters in exec mode (localcluster, and the real control plane: kube-apiserver
stores the Secret, kube-controller-manager's garbage collector deletes it with its Job, our node
agent runs the Pod), with PostgreSQL, Redis and real Celery workers: the value is in no Job, Pod,
event row, Celery message, `show`/`status` output or worker log; at rest it is a Fernet token; the
Job's Secret holds it, owned by the Job, made again by the retry that adopts a Job whose Secret is
missing and for a re-created Job; the function gets it through the Pod's env (`secretKeyRef`,
resolved by the node); without a key it is refused at schedule with nothing written."""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import hashlib
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from clusters import LOCAL, REAL, ClusterHandle, local_handle, real_handle
from cryptography.fernet import Fernet
from kubernetes import client
from pydantic import SecretStr

from k8s_dispatch.container.contract import INPUT_ENV, SECRET_INPUT_KEY, secret_name
from k8s_dispatch.core.errors import SecretInputKeyMissing
from k8s_dispatch.core.payloads import canonical_json
from k8s_dispatch.core.settings import load_settings
from k8s_dispatch.delivery.create import CreateOutcome, Rerun, create_job_for, create_jobs_for
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.ops.processes import wait_until
from k8s_dispatch.store import dispatches, scheduling
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import CaseEvent, Dispatch, EventType
from k8s_dispatch.store.secret_inputs import unseal
from k8s_dispatch.tasks.scheduling import schedule_in_session, send_schedule_until_recorded
from k8s_dispatch.workers.manifest import job_name
from k8s_dispatch.workers.resolver import CapabilityResolver

OLD_KEY, KEY = Fernet.generate_key().decode(), Fernet.generate_key().decode()
RUNNER = {  # the runner as a real process: it reads K8S_DISPATCH_INPUT from the env the node resolved
    "worker": "secrets",
    "image": "k8s-dispatch:latest",
    "command": [sys.executable, "-m", "k8s_dispatch.container.runner"],
    "args": ["input_funcs:digest"],
    "env": {"PYTHONPATH": str(Path(__file__).parent)},
    "activeDeadlineSeconds": 120,
}
CAPABILITIES = {"capabilities": {"sec": RUNNER}}


@pytest.fixture(scope="module", params=[LOCAL, REAL])
def exec_cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    """Each cluster in exec mode: the container's command runs as a real process."""
    if request.param == LOCAL:
        from k8s_dispatch.demo.localcluster import LocalCluster

        with LocalCluster(mode="exec", max_running=2, tls=False) as cluster:
            yield local_handle(cluster)
    else:
        from k8s_dispatch.lab.realcluster.controlplane import ControlPlane

        plane = ControlPlane(directory=tmp_path_factory.mktemp("secrets-real"), mode="exec")
        plane.start()
        try:
            yield real_handle(plane)
        finally:
            plane.stop()


def _secret() -> dict[str, Any]:
    """A value no test data elsewhere could hold by chance."""
    return {"password": f"pw-{uuid.uuid4().hex}", "token": f"tk-{uuid.uuid4().hex}"}


def _needles(value: dict[str, Any]) -> list[str]:
    return [value["password"], value["token"]]


def _assert_absent(value: dict[str, Any], haystack: str, where: str) -> None:
    for needle in _needles(value):
        assert needle not in haystack, f"the secret input is in {where}"


def _runtime(cluster: ClusterHandle, env: dict[str, str], tmp_path: Path) -> Runtime:
    caps = tmp_path / "capabilities.yaml"
    caps.write_text(yaml.safe_dump(CAPABILITIES))
    return Runtime.from_settings(
        load_settings(
            {
                **env,
                "K8S_DISPATCH_NAMESPACE": "default",
                "K8S_DISPATCH_KUBECONFIG": str(cluster.kubeconfig),
                "K8S_DISPATCH_CAPABILITIES": str(caps),
            }
        )
    )


@pytest.fixture
def base_env(pg_url: str, redis_url: str, key_prefix: str) -> dict[str, str]:
    return {
        "K8S_DISPATCH_DATABASE_URL": pg_url,
        "K8S_DISPATCH_REDIS_URL": redis_url,
        "K8S_DISPATCH_KEY_PREFIX": f"{key_prefix}-{uuid.uuid4().hex[:6]}",
    }


@pytest.fixture
def rt(exec_cluster: ClusterHandle, base_env: dict[str, str], tmp_path: Path) -> Iterator[Runtime]:
    runtime = _runtime(exec_cluster, {**base_env, "K8S_DISPATCH_INPUT_KEY": f"{KEY},{OLD_KEY}"}, tmp_path)
    yield runtime
    runtime.close()


def _schedule(rt: Runtime, value: Any, *, input_key: SecretStr | None) -> str:
    case_id = f"case-{uuid.uuid4().hex[:8]}"
    with transaction(rt.sessions) as session:
        scheduling.create_case(session, case_id=case_id, tenancy_id="t")
        return scheduling.schedule(
            session, case_id=case_id, tenancy_id="t", capability="sec", input=value, secret=True,
            idempotency_key=uuid.uuid4().hex, router=rt.resolver, max_input_bytes=rt.settings.max_input_bytes,
            input_key=input_key,
        ).dispatch_id  # fmt: skip


def _counts(rt: Runtime) -> tuple[int, int]:
    with transaction(rt.sessions) as session:
        return session.query(Dispatch).count(), session.query(CaseEvent).count()


def _read_secret(cluster: ClusterHandle, name: str) -> dict[str, Any] | None:
    with cluster.api_client() as api:
        try:
            secret = client.CoreV1Api(api).read_namespaced_secret(name, "default")
        except client.ApiException as e:
            if e.status == 404:
                return None
            raise
        return api.sanitize_for_serialization(secret)  # type: ignore[no-any-return]


def _delete_job_now(cluster: ClusterHandle, name: str) -> None:
    """A person deleting the Job (our finalizer removed first, so it goes at once)."""
    with cluster.api_client() as api:
        batch = client.BatchV1Api(api)
        batch.patch_namespaced_job(name, "default", {"metadata": {"finalizers": None}})
        batch.delete_namespaced_job(name, "default", propagation_policy="Background")


def test_a_secret_input_without_a_key_is_refused_and_nothing_is_written(rt: Runtime) -> None:
    before = _counts(rt)
    with pytest.raises(SecretInputKeyMissing):
        _schedule(rt, _secret(), input_key=None)
    assert _counts(rt) == before
    with pytest.raises(SecretInputKeyMissing):  # the task path: refused before anything is sent
        send_schedule_until_recorded(
            rt.sessions, case_id="c", tenancy_id="t", capability="sec", input=_secret(), idempotency_key="k",
            secret=True, input_key=None, timeout_s=0.1,
        )  # fmt: skip


def test_the_secret_is_sealed_at_rest_kept_out_of_the_job_and_given_to_it_through_its_own_secret(
    rt: Runtime, exec_cluster: ClusterHandle
) -> None:
    value = _secret()
    dispatch_id = _schedule(rt, value, input_key=rt.settings.input_key)
    with transaction(rt.sessions) as session:
        row = session.get(Dispatch, dispatch_id)
        assert row is not None and row.input is None and row.secret_input is not None
        _assert_absent(value, row.secret_input, "the row's token")
        assert json.loads(unseal(row.secret_input, rt.settings.input_key)) == value
        [scheduled] = dispatches.events_for(session, dispatch_id)
        assert scheduled.payload["input"] is None and scheduled.payload["secret"] is True

    assert create_job_for(rt, dispatch_id) is CreateOutcome.CREATED
    name = job_name(dispatch_id)
    job = rt.kube.get_job("default", name)
    _assert_absent(value, json.dumps(job), "the Job")
    [env] = [e for e in job["spec"]["template"]["spec"]["containers"][0]["env"] if e["name"] == INPUT_ENV]
    assert env == {
        "name": INPUT_ENV,
        "valueFrom": {"secretKeyRef": {"name": secret_name(name), "key": SECRET_INPUT_KEY, "optional": False}},
    }
    secret = _read_secret(exec_cluster, secret_name(name))
    assert secret is not None
    [owner] = secret["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("Job", name, job["metadata"]["uid"])
    assert json.loads(base64.b64decode(secret["data"][SECRET_INPUT_KEY])) == value
    # The function gets it: the node resolves the container's secretKeyRef (the Pod may have been
    # made before the Secret: it then waited for it), the runner reads it from its env.
    pod = _terminated_pod(rt, dispatch_id)
    _assert_absent(value, json.dumps(pod), "the Pod")
    [status] = pod["status"]["containerStatuses"]
    assert status["state"]["terminated"]["exitCode"] == 0, status
    assert json.loads(status["state"]["terminated"]["message"]) == {
        "sha256": hashlib.sha256(canonical_json(value).encode()).hexdigest(),
        "keys": sorted(value),
    }

    # A create that stopped between the Job and its Secret: the retry adopts the Job, makes the Secret.
    with exec_cluster.api_client() as api:
        client.CoreV1Api(api).delete_namespaced_secret(secret_name(name), "default")
    wait_until(lambda: _read_secret(exec_cluster, secret_name(name)) is None, what="the Secret deleted", timeout=30.0)
    assert create_job_for(rt, dispatch_id) is CreateOutcome.ADOPTED
    again = _read_secret(exec_cluster, secret_name(name))
    assert again is not None and json.loads(base64.b64decode(again["data"][SECRET_INPUT_KEY])) == value

    # The Job deleted: the garbage collector deletes its Secret.
    _delete_job_now(exec_cluster, name)
    wait_until(lambda: _read_secret(exec_cluster, secret_name(name)) is None, what="the Secret collected", timeout=60.0)

    # Its Job re-created (a lost Job's re-run): the new Job gets the secret again, from the row.
    with transaction(rt.sessions) as session:
        counted = dispatches.get_dispatches(session, [dispatch_id])[dispatch_id].attempts
    wait_until(lambda: _job_gone(rt, name), what="the Job gone", timeout=60.0)
    assert create_jobs_for(rt, [dispatch_id], reruns={dispatch_id: Rerun(counted=counted, attempt=counted)}) == {
        dispatch_id: CreateOutcome.CREATED
    }
    new_job = rt.kube.get_job("default", name)
    assert new_job["metadata"]["uid"] != job["metadata"]["uid"]
    remade = _read_secret(exec_cluster, secret_name(name))
    assert remade is not None
    assert remade["metadata"]["ownerReferences"][0]["uid"] == new_job["metadata"]["uid"]
    assert json.loads(base64.b64decode(remade["data"][SECRET_INPUT_KEY])) == value
    _delete_job_now(exec_cluster, name)


def _job_gone(rt: Runtime, name: str) -> bool:
    from k8s_dispatch.core.errors import NotFound

    try:
        rt.kube.get_job("default", name)
    except NotFound:
        return True
    return False


def _terminated_pod(rt: Runtime, dispatch_id: str) -> dict[str, Any]:
    def terminated() -> dict[str, Any] | None:
        for pod in rt.kube.list_pods("default", label_selector=f"job-name={job_name(dispatch_id)}"):
            for status in (pod.get("status") or {}).get("containerStatuses") or []:
                if "terminated" in (status.get("state") or {}):
                    return pod
        return None

    pod: dict[str, Any] = wait_until(terminated, what="the Job's container ended", timeout=90.0)
    return pod


def test_through_celery_the_secret_is_in_no_message_event_output_or_log_and_the_job_runs(
    deploy: Any, exec_cluster: ClusterHandle
) -> None:
    d = deploy(exec_cluster, capabilities=CAPABILITIES["capabilities"], input_key=KEY, sweep_grace_s="1")
    by_task, by_engine = _secret(), _secret()
    case_id = d.new_case("t")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # The task path, sent before any worker runs: its message waits in Redis, read there.
        sent = pool.submit(
            send_schedule_until_recorded, d.sessions, case_id=case_id, tenancy_id="t", capability="sec",
            input=by_task, idempotency_key=f"k-{uuid.uuid4().hex}", secret=True, input_key=d.settings.input_key,
            via=d.producer, timeout_s=120.0,
        )  # fmt: skip
        wait_until(
            lambda: "k8s-dispatch.schedule" in _redis_dump(d), what="the schedule message in Redis", timeout=30.0
        )
        with transaction(d.sessions) as session:  # the engine's path
            engine_id = schedule_in_session(
                session, case_id=case_id, tenancy_id="t", capability="sec", input=by_engine,
                idempotency_key=f"k-{uuid.uuid4().hex}", secret=True, input_key=d.settings.input_key,
                router=CapabilityResolver.from_settings(d.settings), max_input_bytes=d.settings.max_input_bytes,
                via=d.producer,
            ).dispatch_id  # fmt: skip
        messages = _redis_dump(d)
        for value in (by_task, by_engine):
            _assert_absent(value, messages, "a Celery message in Redis")
        d.start_worker("w1")
        d.start_beat()
        task_id = sent.result(timeout=120)

    ids = [task_id, engine_id]
    pods = d.wait(lambda: _pods_of(d, ids), timeout_s=60, what="both Pods")
    jobs = [d.kube.get_job(d.namespace, job_name(i)) for i in ids]
    events = d.wait_terminal(ids, timeout_s=120)
    assert [kind for i in ids for kind, _ in events[i]] == [EventType.WORKER_COMPLETED] * 2, events
    d.wait(lambda: not _secrets_left(exec_cluster, d.namespace, ids), timeout_s=60, what="the Secrets collected")

    with transaction(d.sessions) as session:
        rows = [json.dumps(e.payload) for i in ids for e in dispatches.events_for(session, i)]
    shown = [_cli(d, "show", i) for i in ids] + [_cli(d, "show", "--json", i) for i in ids] + [_cli(d, "status")]
    everything = {
        "a Job": json.dumps(jobs),
        "a Pod": json.dumps(pods),
        "an event row": "\n".join(rows),
        "show or status": "\n".join(shown),
        "a Celery message in Redis": _redis_dump(d),
        "a worker or beat log": "\n".join(p.log() for p in d.procs),
    }
    for value in (by_task, by_engine):
        for where, text in everything.items():
            _assert_absent(value, text, where)
    assert "(secret: kept encrypted, never shown)" in shown[2]  # show --json: the event says so


def _pods_of(d: Any, ids: list[str]) -> list[dict[str, Any]] | None:
    pods = [p for i in ids for p in d.kube.list_pods(d.namespace, label_selector=f"job-name={job_name(i)}")]
    return pods if len(pods) >= len(ids) else None


def _secrets_left(cluster: ClusterHandle, namespace: str, ids: list[str]) -> list[str]:
    with cluster.api_client() as api:
        names = {s.metadata.name for s in client.CoreV1Api(api).list_namespaced_secret(namespace).items}
    return [i for i in ids if secret_name(job_name(i)) in names]


def _redis_dump(d: Any) -> str:
    """Every value under the deployment's Redis prefix (queues, unacked messages, results),
    message bodies decoded from base64 where they are."""
    out = []
    for key in d.redis.scan_iter(f"{d.prefix}*"):
        kind = d.redis.type(key)
        if kind == b"list":
            values = d.redis.lrange(key, 0, -1)
        elif kind == b"hash":
            values = list(d.redis.hgetall(key).values())
        elif kind == b"string":
            values = [d.redis.get(key)]
        elif kind == b"zset":
            values = d.redis.zrange(key, 0, -1)
        else:
            values = list(d.redis.smembers(key)) if kind == b"set" else []
        for raw in values:
            text = raw.decode("utf-8", "replace")
            out.append(text)
            with contextlib.suppress(ValueError, KeyError, TypeError):  # not a kombu envelope
                out.append(base64.b64decode(json.loads(text)["body"]).decode("utf-8", "replace"))
    return "\n".join(out)


def _cli(d: Any, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "k8s_dispatch.cli", *args], env=d.env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr
