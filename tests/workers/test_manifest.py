"""workers/manifest.py: the Job a dispatch becomes, and everything that cannot become one."""

from __future__ import annotations

import json
from dataclasses import replace
from decimal import Decimal
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from k8s_dispatch.container.contract import INPUT_ENV, encode_input
from k8s_dispatch.core.errors import (
    InputNotSerialisable,
    InvalidId,
    InvalidIdempotencyKey,
    InvalidManifest,
)
from k8s_dispatch.core.names import is_dns1123_label, is_label_value, is_qualified_name
from k8s_dispatch.workers import labels, manifest
from k8s_dispatch.workers.manifest import build_job, job_name, parse_quantity
from k8s_dispatch.workers.resolver import demo_resolver
from k8s_dispatch.workers.types import DispatchRef
from tests.workers import strategies as S

SPEC = demo_resolver().spec("demo.wordcount")
DEPLOYMENT = "prod-eu"
REF = DispatchRef(
    dispatch_id="0b8e2f1c-4f5a-4d0e-9a3b-2c1d0e9f8a7b",
    case_id="case-42",
    tenancy_id="acme corp",  # not a label value: hashed
    capability="demo.wordcount",
    worker_name="demo-text",
    idempotency_key="order-1001",
)


def assert_job_valid(job: dict[str, Any]) -> None:
    """The checks the API server makes on the names, labels and annotations we set."""
    metadata = job["metadata"]
    assert job["apiVersion"] == "batch/v1" and job["kind"] == "Job"
    assert is_dns1123_label(metadata["name"]), metadata["name"]
    assert is_dns1123_label(metadata["namespace"]), metadata["namespace"]
    template = job["spec"]["template"]
    for meta in (metadata, template["metadata"]):
        assert all(is_qualified_name(k) and is_label_value(v) for k, v in meta["labels"].items()), meta["labels"]
        assert all(is_qualified_name(k) and isinstance(v, str) for k, v in meta["annotations"].items())
        size = sum(len(k.encode()) + len(v.encode()) for k, v in meta["annotations"].items())
        assert size <= 256 * 1024
    assert template["metadata"]["labels"] == metadata["labels"]
    assert all(is_qualified_name(f) for f in metadata["finalizers"])
    # Ours on every Pod too (the Job controller copies the template's): the result outlives a delete.
    assert template["metadata"]["finalizers"] == [manifest.FINALIZER]
    assert template["spec"]["restartPolicy"] == "Never"
    (container,) = template["spec"]["containers"]
    assert is_dns1123_label(container["name"])
    names = [e["name"] for e in container["env"]]
    assert len(names) == len(set(names))
    assert all(isinstance(e["value"], str) for e in container["env"])
    for kind, amounts in container["resources"].items():
        assert kind in ("requests", "limits")
        assert all(isinstance(q, str) and parse_quantity(q) is not None for q in amounts.values())
    assert job["spec"]["backoffLimit"] >= 0
    assert job["spec"].get("activeDeadlineSeconds", 1) > 0


def input_of(job: dict[str, Any]) -> Any:
    (container,) = job["spec"]["template"]["spec"]["containers"]
    (text,) = [e["value"] for e in container["env"] if e["name"] == INPUT_ENV]
    assert "$" not in text  # no `$(VAR)` for Kubernetes to expand
    return json.loads(text)


def test_build_job_shape() -> None:
    spec = replace(
        SPEC,
        env=MappingProxyType({"LOG_LEVEL": "debug"}),
        labels=MappingProxyType({"team": "search"}),
        annotations=MappingProxyType({"example.com/owner": "me"}),
        active_deadline_seconds=30,
        backoff_limit=2,
    )
    job = build_job(REF, input={"text": "a b"}, spec=spec, namespace="jobs", attempt=1, deployment=DEPLOYMENT)
    assert_job_valid(job)
    our_labels, our_annotations = labels.encode(REF, deployment=DEPLOYMENT)
    assert our_labels[labels.DEPLOYMENT_LABEL] == DEPLOYMENT
    assert job["metadata"] == {
        "name": "kd-0b8e2f1c-4f5a-4d0e-9a3b-2c1d0e9f8a7b",
        "namespace": "jobs",
        "labels": {"team": "search", **our_labels},
        "annotations": {"example.com/owner": "me", **our_annotations, labels.ATTEMPT_KEY: "1"},
        "finalizers": ["k8s-dispatch.io/result-protection"],
    }
    assert job["spec"]["backoffLimit"] == 2
    assert job["spec"]["activeDeadlineSeconds"] == 30
    assert job["spec"]["template"]["metadata"] == {
        "labels": job["metadata"]["labels"],
        "annotations": job["metadata"]["annotations"],
        "finalizers": ["k8s-dispatch.io/result-protection"],
    }
    assert job["spec"]["template"]["spec"] == {
        "restartPolicy": "Never",
        "containers": [
            {
                "name": "worker",
                "image": SPEC.image,
                "command": ["python", "-m", "k8s_dispatch.container.runner"],
                "args": ["k8s_dispatch.demo.functions:wordcount"],
                "env": [
                    {"name": "LOG_LEVEL", "value": "debug"},
                    {"name": "K8S_DISPATCH_INPUT", "value": '{"text":"a b"}'},
                ],
                "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "128Mi"}},
                "terminationMessagePath": "/dev/termination-log",
                "terminationMessagePolicy": "FallbackToLogsOnError",
                "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
            }
        ],
        # The restricted Pod Security profile (tests/workers/test_job_security.py).
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "automountServiceAccountToken": False,
    }
    assert labels.decode(job["metadata"]["labels"], job["metadata"]["annotations"]) == REF
    assert labels.decode_attempt(job["metadata"]["annotations"]) == 1


def test_build_job_returns_fresh_dicts_each_time() -> None:
    first = build_job(REF, input={}, spec=SPEC, namespace="default", deployment=DEPLOYMENT)
    first["metadata"]["labels"]["x"] = "y"
    first["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"] = "1Gi"
    second = build_job(REF, input={}, spec=SPEC, namespace="default", deployment=DEPLOYMENT)
    assert "x" not in second["metadata"]["labels"]
    assert "x" not in second["spec"]["template"]["metadata"]["labels"]
    assert SPEC.resources["limits"]["memory"] == "128Mi"


def test_spec_namespace_wins_and_optional_fields_are_left_out() -> None:
    spec = replace(SPEC, namespace="batch", command=(), args=(), active_deadline_seconds=None)
    job = build_job(REF, input=None, spec=spec, namespace="default", deployment=DEPLOYMENT)
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert job["metadata"]["namespace"] == "batch"
    assert "command" not in container and "args" not in container
    assert "activeDeadlineSeconds" not in job["spec"]


def test_job_name_is_stable_and_a_dns_label() -> None:
    assert job_name(REF.dispatch_id) == job_name(REF.dispatch_id) == "kd-" + REF.dispatch_id
    assert len(job_name(REF.dispatch_id)) == 39 and is_dns1123_label(job_name(REF.dispatch_id))
    with pytest.raises(InvalidId):
        job_name("../etc")


def test_input_with_dollar_syntax_is_carried_verbatim() -> None:
    value = {"cmd": "echo $(HOME) $$ $x", "$(KEY)": ["$"]}
    job = build_job(REF, input=value, spec=SPEC, namespace="default", deployment=DEPLOYMENT)
    assert input_of(job) == value


@pytest.mark.parametrize(
    ("change", "error", "complaint"),
    [
        ({"dispatch_id": "not-a-uuid"}, InvalidId, "dispatch_id"),
        ({"case_id": ""}, InvalidId, "case_id"),
        ({"tenancy_id": "t" * 129}, InvalidId, "tenancy_id"),
        ({"tenancy_id": "a\nb"}, InvalidId, "tenancy_id"),
        ({"idempotency_key": "k" * 257}, InvalidIdempotencyKey, "idempotency_key"),
        ({"capability": "demo.sha256"}, InvalidManifest, "capability"),
        ({"worker_name": "demo-math"}, InvalidManifest, "worker"),
    ],
)
def test_build_job_refuses_bad_refs(change: dict[str, str], error: type[Exception], complaint: str) -> None:
    with pytest.raises(error, match=complaint):
        build_job(replace(REF, **change), input={}, spec=SPEC, namespace="default", deployment=DEPLOYMENT)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"image": ""}, "image"),
        ({"image": "busybox latest"}, "image"),
        ({"command": ("python", 3)}, "command"),
        ({"args": ("a\x00b",)}, "args"),
        ({"env": {"1BAD": "x"}}, "env"),
        ({"env": {"K8S_DISPATCH_INPUT": "{}"}}, "env"),
        ({"env": {"A": 1}}, "env"),
        ({"resources": {"requests": {"cpu": "lots"}}}, "resources"),
        ({"resources": {"requests": {"cpu": "-1"}}}, "resources"),
        ({"resources": {"requests": {"memory": "2Gi"}, "limits": {"memory": "1Gi"}}}, "resources"),
        ({"resources": {"wishes": {"cpu": "1"}}}, "resources"),
        ({"resources": {"limits": {"bad name!": "1"}}}, "resources"),
        ({"namespace": "Not_A_Label"}, "namespace"),
        ({"active_deadline_seconds": 0}, "activeDeadlineSeconds"),
        ({"active_deadline_seconds": True}, "activeDeadlineSeconds"),
        ({"backoff_limit": -1}, "backoffLimit"),
        ({"backoff_limit": 1.5}, "backoffLimit"),
        ({"labels": {"k8s-dispatch.io/case-id": "x"}}, "labels"),
        ({"labels": {"app.kubernetes.io/managed-by": "helm"}}, "labels"),
        ({"labels": {"batch.kubernetes.io/job-name": "x"}}, "labels"),
        ({"labels": {"job-name": "x"}}, "labels"),
        ({"labels": {"team": "a b"}}, "labels"),
        ({"labels": {"/team": "a"}}, "labels"),
        ({"annotations": {"k8s-dispatch.io/attempt": "9"}}, "annotations"),
        ({"annotations": {"bad key": "x"}}, "annotations"),
    ],
)
def test_build_job_refuses_bad_specs(change: dict[str, Any], field: str) -> None:
    spec = replace(SPEC, **change)
    with pytest.raises(InvalidManifest, match=f"{field}: "):
        build_job(REF, input={}, spec=spec, namespace="default", deployment=DEPLOYMENT)
    assert [f for f, _ in manifest.spec_problems(spec)] == [field]


@pytest.mark.parametrize(
    ("kwargs", "complaint"),
    [
        ({"namespace": "Default"}, "namespace"),
        ({"namespace": ""}, "namespace"),
        ({"namespace": "n" * 64}, "namespace"),
        ({"attempt": -1}, "attempt"),
        ({"attempt": True}, "attempt"),
        ({"deployment": ""}, "deployment"),
        ({"deployment": "two words"}, "deployment"),
        ({"deployment": "d" * 64}, "deployment"),
        ({"deployment": None}, "deployment"),
    ],
)
def test_build_job_refuses_bad_namespace_deployment_or_attempt(kwargs: dict[str, Any], complaint: str) -> None:
    args: dict[str, Any] = {"input": {}, "spec": SPEC, "namespace": "default", "deployment": DEPLOYMENT, **kwargs}
    with pytest.raises(InvalidManifest, match=complaint):
        build_job(REF, **args)


def test_build_job_refuses_annotations_over_the_api_limit() -> None:
    spec = replace(SPEC, annotations={"example.com/blob": "x" * (256 * 1024)})
    with pytest.raises(InvalidManifest, match="annotations are"):
        build_job(REF, input={}, spec=spec, namespace="default", deployment=DEPLOYMENT)


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ({"b": 1, "a": [True, None, 1.5]}, '{"a":[true,null,1.5],"b":1}'),
        ("héllo", '"héllo"'),
        ("$(X)", '"\\u0024(X)"'),
        ([], "[]"),
    ],
)
def test_encode_input_is_compact_sorted_utf8(value: object, text: str) -> None:
    assert encode_input(value) == text
    assert json.loads(text) == value


@pytest.mark.parametrize(
    "value",
    [float("nan"), float("inf"), {1, 2}, b"bytes", object(), "\ud800", {"a": {1: 1, "b": 2}}, 10**5000],
    ids=["nan", "inf", "set", "bytes", "object", "surrogate", "mixed-keys", "huge-int"],
)
def test_encode_input_refuses_what_is_not_json(value: object) -> None:
    with pytest.raises(InputNotSerialisable):
        encode_input(value)


def test_encode_input_refuses_cycles() -> None:
    loop: list[object] = []
    loop.append(loop)
    with pytest.raises(InputNotSerialisable):
        encode_input(loop)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("100m", Decimal("0.1")),
        ("2", Decimal(2)),
        ("1.5", Decimal("1.5")),
        (".5", Decimal("0.5")),
        ("64Mi", Decimal(64 * 2**20)),
        ("1Gi", Decimal(2**30)),
        ("1G", Decimal(10**9)),
        ("1e3", Decimal(1000)),
        ("1E-3", Decimal("0.001")),
        ("5k", Decimal(5000)),
        ("lots", None),
        ("-1", None),
        ("1mi", None),
        ("", None),
        ("1 Gi", None),
        ("1e99999999999", None),
    ],
)
def test_parse_quantity(text: str, value: Decimal | None) -> None:
    assert parse_quantity(text) == value


# --- properties ------------------------------------------------------------------------

_TYPED = (InvalidId, InvalidIdempotencyKey, InputNotSerialisable, InvalidManifest)


@given(ref=S.refs_any, value=S.inputs_any, data=st.data())
def test_build_job_is_valid_or_raises_a_typed_error(ref: DispatchRef, value: object, data: st.DataObject) -> None:
    spec = data.draw(S.capability_specs(name=ref.capability, worker_name=ref.worker_name))
    namespace = data.draw(S.namespaces_any)
    try:
        job = build_job(ref, input=value, spec=spec, namespace=namespace, deployment=DEPLOYMENT)
    except _TYPED as e:
        event(f"refused: {type(e).__name__}")
        return
    hashed = sum(1 for k in job["metadata"]["annotations"] if k in labels.FIELD_KEYS.values())
    event(f"built, {'some' if hashed else 'no'} labels hashed")
    assert_job_valid(job)
    assert labels.decode(job["metadata"]["labels"], job["metadata"]["annotations"]) == ref
    template = job["spec"]["template"]["metadata"]
    assert labels.decode(template["labels"], template["annotations"]) == ref
    assert input_of(job) == json.loads(json.dumps(value))


@given(ref=S.refs, value=S.json_values, data=st.data())
def test_valid_values_always_build(ref: DispatchRef, value: object, data: st.DataObject) -> None:
    spec = data.draw(S.capability_specs(name=ref.capability, worker_name=ref.worker_name, valid=True))
    job = build_job(ref, input=value, spec=spec, namespace=data.draw(S.namespaces), deployment=DEPLOYMENT)
    assert_job_valid(job)
    assert labels.decode(job["metadata"]["labels"], job["metadata"]["annotations"]) == ref
    assert input_of(job) == json.loads(json.dumps(value))
