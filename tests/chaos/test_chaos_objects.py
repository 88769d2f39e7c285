"""The chaos run's object-store part (pure, but for the store's restart): its work (stored
results, secret inputs, archived logs), its fault, and its verdict (orphans, archived logs, the
secret markers wherever they must not be)."""

from __future__ import annotations

import base64
import hashlib
import json
import os

import pytest

from k8s_dispatch.artifacts.keys import input_key, log_key, result_key
from k8s_dispatch.artifacts.reference import ResultReference, parse_reference
from k8s_dispatch.lab.chaos.checks import RowSnapshot, TerminalEvent, mismatch
from k8s_dispatch.lab.chaos.fault_plan import FaultKind, make_plan
from k8s_dispatch.lab.chaos.functions import secret_digest, stored_bytes
from k8s_dispatch.lab.chaos.objects import MarkerScan, ObjectVerdict, decoded_body, log_problem, orphans
from k8s_dispatch.lab.chaos.services import STORE_BUCKET, OwnObjectStore
from k8s_dispatch.lab.chaos.workload import (
    FIRST_ATTEMPT,
    STORED_BYTES,
    Kind,
    capabilities_config,
    expected,
    kind_of,
    stored_results,
    workload,
)
from k8s_dispatch.workers.resolver import CapabilityResolver

PREFIX = "chaos-t"
A, B, C = (f"0000000{i}-0000-4000-8000-000000000000" for i in range(3))


# --- the work ----------------------------------------------------------------------------------


def test_stored_results_and_secret_inputs_are_placed_by_the_seed_and_named_by_the_run():
    planned = workload(3, 300, tag="t", maps=4, stored=5, secrets=6)
    stored = [p for p in planned if p.kind is Kind.LARGE]
    secret = [p for p in planned if p.kind is Kind.SECRET]
    assert len(stored) == 5 and len(secret) == 6
    assert planned == workload(3, 300, tag="t", maps=4, stored=5, secrets=6)
    assert all(p.map is None for p in stored + secret)  # never a map's place
    assert {p.via_task for p in stored} == {p.via_task for p in secret} == {True, False}
    assert all(STORED_BYTES[0] <= p.input["size"] <= STORED_BYTES[1] for p in stored)
    assert all(p.secret and not p.dispatch_id for p in secret) and not any(p.secret for p in stored)
    assert len({p.capability for p in stored}) == 5  # a capability each: its message names its key
    other = workload(3, 300, tag="u", maps=4, stored=5, secrets=6)
    assert not {p.dispatch_id for p in stored} & {p.dispatch_id for p in other if p.kind is Kind.LARGE}
    assert not {p.input["token"] for p in secret} & {p.input["token"] for p in other if p.kind is Kind.SECRET}
    # The rest of the mix stays where it was without them.
    plain = workload(3, 300, tag="t", maps=4)
    assert [p.kind for p in plain if p.index not in {q.index for q in stored + secret}] == [
        p.kind for p in planned if p.kind not in (Kind.LARGE, Kind.SECRET)
    ]


@pytest.mark.parametrize("mode", ["simulate", "exec"])
def test_the_capability_file_stores_each_large_result_and_archives_each_planned_failure(mode):
    planned = workload(3, 200, tag="t", stored=3, secrets=2)
    stored = stored_results(planned, prefix=PREFIX)
    resolver = CapabilityResolver.from_mapping(capabilities_config(mode, stored=stored), source="<chaos>")
    assert {kind_of(name) for name in resolver.capabilities()} >= {Kind.LARGE, Kind.SECRET}
    for result, plan in zip(stored, [p for p in planned if p.stored], strict=True):
        spec = resolver.spec(result.capability)
        assert spec.results_in_object_store and spec.max_result_bytes >= STORED_BYTES[1]
        assert result.key == result_key(PREFIX, plan.dispatch_id, FIRST_ATTEMPT)
        data = stored_bytes(plan.input)  # what the exec runner uploads
        assert (result.size, result.sha256) == (len(data), hashlib.sha256(data).hexdigest())
        if mode == "simulate":  # the simulated message: the reference to the object the harness writes
            message = json.loads(spec.annotations["localcluster.k8s-dispatch.io/result"])
            assert parse_reference(message) == ResultReference(result.key, result.size, result.sha256)
    assert resolver.spec("chaos.fail").archives_log(failed=True)
    assert not resolver.spec("chaos.fail").archives_log(failed=False)


def test_a_stored_result_must_be_recorded_as_a_reference_to_its_bytes():
    (plan,) = [p for p in workload(3, 100, tag="t", stored=1) if p.stored]
    want = expected(Kind.LARGE, plan.input, mode="simulate")
    assert want == expected(Kind.LARGE, plan.input, mode="exec")
    assert want.stored is not None
    size, sha256 = want.stored
    good = ResultReference(result_key(PREFIX, A, 1), size, sha256).to_output()  # any attempt's key will do
    row = RowSnapshot("COMPLETED", output=good)
    assert mismatch(want, TerminalEvent("WORKER_COMPLETED", {"output": good}), row) is None
    for wrong in (ResultReference(good["k8s-dispatch.io/object"]["key"], size + 1, sha256).to_output(),
                  ResultReference(result_key(PREFIX, A, 0), size, "0" * 64).to_output(), {"simulated": True}):  # fmt: skip
        assert mismatch(want, TerminalEvent("WORKER_COMPLETED", {"output": wrong}), row) is not None


def test_a_secret_input_is_expected_back_only_as_a_digest_or_not_at_all():
    data = {"n": 1, "token": "sekret-x"}
    assert expected(Kind.SECRET, data, mode="simulate").output == {"simulated": True, "input": None}
    digest = expected(Kind.SECRET, data, mode="exec").output
    assert digest == secret_digest(data) and "sekret-x" not in json.dumps(digest)


# --- the fault ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(10))
def test_the_object_store_restart_is_planned_while_work_is_in_flight_and_leaves_the_rest_of_the_plan(seed):
    common = {"window_s": 100.0, "kills": 5, "targets": ["worker-1", "beat"], "redis_restarts": 1, "pg_restarts": 1}
    without = make_plan(seed, **common)
    with_it = make_plan(seed, objectstore_restarts=1, **common)
    (restart,) = [f for f in with_it.faults if f.kind is FaultKind.OBJECTSTORE_RESTART]
    assert 20.0 <= restart.at_s <= 80.0
    assert tuple(f for f in with_it.faults if f is not restart) == without.faults
    with pytest.raises(ValueError):
        make_plan(seed, objectstore_restarts=-1, **common)


# --- the verdict -------------------------------------------------------------------------------


def test_every_object_must_be_a_recorded_result_an_archived_log_or_an_input_of_a_dispatch_of_the_run():
    listed = [
        result_key(PREFIX, A, 0),  # A's recorded result
        result_key(PREFIX, A, 1),  # a losing attempt of A
        log_key(PREFIX, A, 0, "pod-a"),
        input_key(PREFIX, B),
        result_key(PREFIX, B, 0),  # B failed: its upload is recorded nowhere
        log_key(PREFIX, C, 0, "pod-c"),  # C is no dispatch of the run
        f"{PREFIX}/stray",
    ]
    found = orphans(PREFIX, listed, known={A, B}, recorded={A: result_key(PREFIX, A, 0)})
    assert found == [
        result_key(PREFIX, A, 1),
        result_key(PREFIX, B, 0),
        log_key(PREFIX, C, 0, "pod-c"),
        f"{PREFIX}/stray",
    ]


@pytest.mark.parametrize(
    "payload, fine",
    [
        ({"reason": "BackoffLimitExceeded", "detail": {"log_key": "k"}}, True),
        ({"reason": "BackoffLimitExceeded", "detail": {"log_key": "gone"}}, False),
        ({"reason": "BackoffLimitExceeded", "detail": {"log_key": None}}, False),
        ({"reason": "BackoffLimitExceeded", "detail": {}}, False),
        ({"reason": "BackoffLimitExceeded"}, False),
    ],
)
def test_a_planned_failure_must_name_an_archived_log_the_store_holds(payload, fine):
    assert (log_problem(payload, {"k"}) is None) is fine


def envelope(body: object) -> bytes:
    encoded = base64.b64encode(json.dumps(body).encode()).decode()
    return json.dumps({"body": encoded, "properties": {"body_encoding": "base64"}, "headers": {}}).encode()


def test_a_marker_is_found_in_plain_text_and_in_a_message_body_and_counted_once_per_place():
    scan = MarkerScan(["sekret-1", "sekret-2"])
    scan.scan("process log", "nothing here")
    scan.scan("process log", "... sekret-1 ... sekret-1", where="worker-1.log")
    scan.scan_message(envelope([["x", {"token": "sekret-2"}], {}, {}]), where="queue")
    scan.scan_message(json.dumps([json.loads(envelope({"id": "sekret-2"})), "", "jobs"]), where="unacked")
    scan.scan_message(envelope({"sealed_input": "gAAAAA..."}), where="queue")
    verdict = ObjectVerdict(secrets=2)
    scan.judge(verdict)
    assert verdict.secret_leaks == 2 and not verdict.ok
    assert verdict.scanned == {"celery message": 3, "process log": 2}
    assert verdict.problems == ["secret leak: sekret-1 in a process log: worker-1.log",
                                "secret leak: sekret-2 in a celery message: queue"]  # fmt: skip
    assert decoded_body("not json") == "" and decoded_body('{"body": "plain"}') == "plain"


def test_a_clean_verdict_passes_and_each_kind_of_damage_fails_it():
    assert ObjectVerdict(large=5, objects=9, logs_archived=3, secrets=6).ok
    for damage in ("large_bad", "orphan_objects", "logs_missing", "secret_leaks"):
        assert not ObjectVerdict(**{damage: 1}).ok, damage


# --- the store ---------------------------------------------------------------------------------


def test_own_object_store_restarts_on_its_data_and_takes_writes_again(tmp_path):
    store = OwnObjectStore(directory=tmp_path / "store", log_dir=tmp_path, env=dict(os.environ))
    try:
        store.start()
        client = store.client()
        data = os.urandom(1 << 20)
        client.put_object(Bucket=STORE_BUCKET, Key="a/b", Body=data)
        pid = store.proc.pid
        store.proc.kill(9)
        store.start()
        assert store.proc.pid != pid
        assert client.get_object(Bucket=STORE_BUCKET, Key="a/b")["Body"].read() == data
        client.close()
    finally:
        store.stop()
    assert not store.proc.alive
