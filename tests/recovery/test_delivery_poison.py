"""Any bytes a container writes end in exactly one terminal event, and never hold up its batch.

Through the real completion path: localcluster in simulate mode writes each Job's termination
message from its `result-base64` annotation (the bytes, read as the kubelet reads its file),
`complete_jobs` delivers a batch that mixes those Jobs with good ones, against real PostgreSQL
and Redis. Before the fix a result such as `1e400` (JSON for infinity) or `"\\ud800"` (a lone
surrogate) passed the parser, then the store refused the whole batch: every Job in it stayed
undelivered for ever.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from forged_jobs import SIM
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from k8s_dispatch.core.settings import load_settings
from k8s_dispatch.delivery.complete import CompleteOutcome, complete_jobs, job_snapshot
from k8s_dispatch.delivery.create import CreateOutcome, create_jobs_for
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.demo.localcluster import LocalCluster
from k8s_dispatch.ops.processes import wait_until
from k8s_dispatch.store import dispatches, scheduling
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import DispatchState, EventType
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.job_status import RESULT_MISSING, RESULT_NOT_JSON, RESULT_TOO_LARGE, job_state
from k8s_dispatch.workers.manifest import FINALIZER, job_name
from k8s_dispatch.workers.resolver import CapabilityResolver
from tests.workers import strategies as S

MULTIBYTE = "é€😀"  # 2, 3 and 4 bytes in UTF-8
# The bytes of the issue, each with the reason it must end in (None: WORKER_COMPLETED).
SPECIAL: dict[bytes, str | None] = {
    b"1e400": RESULT_NOT_JSON,
    b"-1e400": RESULT_NOT_JSON,
    b"NaN": RESULT_NOT_JSON,
    b"Infinity": RESULT_NOT_JSON,
    b'{"x": -Infinity}': RESULT_NOT_JSON,
    b'"\\ud800"': RESULT_NOT_JSON,  # what JavaScript writes when it cuts a string mid-emoji
    b'{"k": [1, "\\udfff"]}': RESULT_NOT_JSON,
    b"[" * 10_000 + b"]" * 10_000: RESULT_NOT_JSON,  # the kubelet keeps 4 KiB of it: cut JSON
    b"[" * 500 + b"]" * 500: RESULT_NOT_JSON,  # whole, and deeper than the store keeps
    b"[" * 100 + b"]" * 100: None,  # as deep as the store keeps
    json.dumps(MULTIBYTE * 450, ensure_ascii=False).encode(): None,  # 4,052 bytes of multi-byte text
    json.dumps(MULTIBYTE * 460, ensure_ascii=False).encode(): RESULT_NOT_JSON,  # cut at 4 KiB mid-string
    b"\xff\xfe\x80 not utf-8": RESULT_NOT_JSON,
    b'"\xc3\x28"': None,  # invalid UTF-8 inside a string: the API server's JSON makes it U+FFFD
    b"": RESULT_MISSING,
    b" \n": RESULT_MISSING,
    b'"\\u0000"': None,
}
FAILURE_REASONS = {RESULT_NOT_JSON, RESULT_TOO_LARGE, RESULT_MISSING}

termination_bytes = st.one_of(
    st.sampled_from(sorted(SPECIAL)),
    st.binary(max_size=300),
    S.json_values.map(lambda v: json.dumps(v, ensure_ascii=False).encode()),
    st.text(max_size=200).map(str.encode),
    st.from_regex(rb"\A-?[0-9]{1,3}(\.[0-9]{1,3})?[eE][+-]?[0-9]{1,4}\Z"),
    st.from_regex(rb'\A"(\\u[dD][89abAB][0-9a-fA-F]{2})?(\\u[dD][c-fC-F][0-9a-fA-F]{2})?"\Z'),
)


def capability(**annotations: str) -> dict[str, Any]:
    return {"worker": "sim", "image": "sim:1", "annotations": {SIM + "duration-ms": "10", **annotations}}


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(mode="simulate") as c:
        yield c


@pytest.fixture(scope="module")
def base_rt(cluster, pg_url, redis_url, key_prefix) -> Iterator[Runtime]:
    settings_ = load_settings(
        {
            "K8S_DISPATCH_DATABASE_URL": pg_url,
            "K8S_DISPATCH_REDIS_URL": redis_url,
            "K8S_DISPATCH_KEY_PREFIX": f"{key_prefix}-poison",
            "K8S_DISPATCH_NAMESPACE": f"poison-{uuid.uuid4().hex[:8]}",
            "K8S_DISPATCH_KUBECONFIG": str(cluster.kubeconfig),
        }
    )
    rt = Runtime.from_settings(
        settings_,
        resolver=CapabilityResolver.from_mapping({"capabilities": {"sim.good": capability()}}, source="<test>"),
    )
    yield rt
    rt.close()


def with_results(base: Runtime, results: list[bytes]) -> Runtime:
    """The runtime with a capability per result, `sim.bytes-<i>`, whose container writes it."""
    capabilities = {"sim.good": capability()}
    for i, written in enumerate(results):
        capabilities[f"sim.bytes-{i}"] = capability(**{SIM + "result-base64": base64.b64encode(written).decode()})
    return dataclasses.replace(
        base, resolver=CapabilityResolver.from_mapping({"capabilities": capabilities}, source="<t>")
    )


def schedule(rt: Runtime, capability_name: str, input_: Any) -> str:
    case_id = f"case-{uuid.uuid4().hex[:8]}"
    with transaction(rt.sessions) as session:
        scheduling.create_case(session, case_id=case_id, tenancy_id="tenant-p")
        return scheduling.schedule(
            session, case_id=case_id, tenancy_id="tenant-p", capability=capability_name, input=input_,
            idempotency_key=f"key-{uuid.uuid4()}", router=rt.resolver, max_input_bytes=rt.settings.max_input_bytes,
        ).dispatch_id  # fmt: skip


def finished_snapshots(rt: Runtime, ids: list[str]) -> list[dict[str, Any]]:
    """The Jobs of `ids` as poll's LIST hands them off, in the order of `ids`, once all finished."""
    names = [job_name(d) for d in ids]

    def listed() -> dict[str, dict[str, Any]] | None:
        pages = rt.kube.iter_jobs(
            rt.settings.namespace, label_selector=job_labels.undelivered_selector(rt.settings.effective_deployment)
        )
        jobs = {j["metadata"]["name"]: j for page in pages for j in page if j["metadata"]["name"] in names}
        return jobs if len(jobs) == len(names) and all(job_state(j).terminal for j in jobs.values()) else None

    jobs = wait_until(listed, what=f"{len(names)} jobs finished", timeout=30.0)
    return [job_snapshot(jobs[name]) for name in names]


def terminal_events(rt: Runtime, dispatch_id: str) -> list[tuple[str, Any]]:
    with transaction(rt.sessions) as session:
        return [
            (e.type, e.payload)
            for e in dispatches.events_for(session, dispatch_id)
            if e.type != EventType.WORKER_SCHEDULED
        ]


def deliver_mixed_batch(base: Runtime, results: list[bytes]) -> tuple[Runtime, list[str], list[str]]:
    """Good Jobs around Jobs writing `results`, delivered as ONE batch; (runtime, goods, bads)."""
    rt = with_results(base, results)
    goods = [schedule(rt, "sim.good", {"good": i}) for i in range(2)]
    bads = [schedule(rt, f"sim.bytes-{i}", {"bad": i}) for i in range(len(results))]
    ids = [goods[0], *bads, goods[1]]
    assert set(create_jobs_for(rt, ids).values()) == {CreateOutcome.CREATED}
    done = complete_jobs(rt, rt.settings.namespace, finished_snapshots(rt, ids))
    assert done.error is None and done.outcomes == [CompleteOutcome.COMPLETED] * len(ids)
    return rt, goods, bads


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(results=st.lists(termination_bytes, min_size=1, max_size=4))
@example(results=list(SPECIAL))  # every one of the at once, in one batch
def test_any_bytes_a_container_writes_end_in_one_terminal_event_and_spare_the_batch(base_rt, results):
    rt, goods, bads = deliver_mixed_batch(base_rt, results)

    for i, dispatch_id in enumerate(goods):  # the good ones of the batch got their output
        assert terminal_events(rt, dispatch_id) == [
            (EventType.WORKER_COMPLETED, {"output": {"simulated": True, "input": {"good": i}}})
        ]
    for written, dispatch_id in zip(results, bads, strict=True):
        [(event_type, payload)] = terminal_events(rt, dispatch_id)  # exactly one
        if event_type == EventType.WORKER_COMPLETED:
            # What the API server shows of the bytes, as JSON, kept exactly.
            assert payload == {"output": json.loads(written[:4096].decode("utf-8", "replace"))}
        else:
            assert event_type == EventType.WORKER_FAILED
            assert payload["reason"] in FAILURE_REASONS
            assert isinstance(payload.get("message"), str) and payload["message"].strip()
        if written in SPECIAL:
            assert (None if event_type == EventType.WORKER_COMPLETED else payload["reason"]) == SPECIAL[written], (
                written[:40]
            )
    with transaction(rt.sessions) as session:
        rows = dispatches.dispatch_rows(session, goods + bads)  # every row readable back, from this deep stack
    assert {DispatchState(row.state) for row in rows.values()} <= {DispatchState.COMPLETED, DispatchState.FAILED}
    # Every Job released: none is left undelivered (with our finalizer).
    pages = rt.kube.iter_jobs(
        rt.settings.namespace, label_selector=job_labels.undelivered_selector(rt.settings.effective_deployment)
    )
    left = {j["metadata"]["name"] for page in pages for j in page if FINALIZER in j["metadata"].get("finalizers", [])}
    assert left.isdisjoint(job_name(d) for d in goods + bads)


def test_a_result_the_database_refuses_fails_its_own_dispatch_and_no_other(base_rt):
    """The defensive fallback: what the store's check did not foresee (here a trigger refuses
    one payload) fails that dispatch alone, as ResultNotJson; the rest of the batch is recorded."""
    mark = f"refuse-{uuid.uuid4().hex[:8]}"
    function = f"refuse_{mark.replace('-', '_')}"
    ddl = [
        f"CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        f"IF NEW.payload::text LIKE '%{mark}%' THEN RAISE EXCEPTION 'the test''s trigger refuses this row'; END IF; "
        f"RETURN NEW; END $$",
        f"CREATE TRIGGER {function} BEFORE INSERT ON case_events FOR EACH ROW EXECUTE FUNCTION {function}()",
    ]
    with base_rt.engine.begin() as connection:
        for statement in ddl:
            connection.execute(sa.text(statement))
    try:
        rt, goods, [refused] = deliver_mixed_batch(base_rt, [json.dumps({"mark": mark}).encode()])
    finally:
        with base_rt.engine.begin() as connection:
            connection.execute(sa.text(f"DROP TRIGGER {function} ON case_events"))
            connection.execute(sa.text(f"DROP FUNCTION {function}()"))
    assert [terminal_events(rt, d)[0][0] for d in goods] == [EventType.WORKER_COMPLETED] * 2
    [(event_type, payload)] = terminal_events(rt, refused)
    assert (event_type, payload["reason"]) == (EventType.WORKER_FAILED, RESULT_NOT_JSON)
    assert "the database refused the result" in payload["message"] and "trigger refuses this row" in payload["message"]
