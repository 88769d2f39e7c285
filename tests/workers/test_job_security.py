"""The restricted Pod Security profile on every Job `build_job` makes, each default switched off
per capability only with a reason, and the capability file's security fields checked when loaded
(a ConfigError naming the file, capability and field). The real admission controller's verdict is
tests/deploy/test_pod_security.py."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from k8s_dispatch.core.errors import ConfigError, InvalidManifest
from k8s_dispatch.workers.capability import CapabilitySpec
from k8s_dispatch.workers.manifest import SECURITY_DEFAULTS, SECURITY_OVERRIDES_ANNOTATION, build_job
from k8s_dispatch.workers.resolver import CapabilityResolver
from k8s_dispatch.workers.types import DispatchRef

RESTRICTED_POD = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
RESTRICTED_CONTAINER = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def _resolver(**fields: Any) -> CapabilityResolver:
    config = {"worker": "w", "image": "busybox:1.36", **fields}
    return CapabilityResolver.from_mapping({"capabilities": {"cap": config}}, source="caps.yaml")


def _job(spec: CapabilitySpec) -> dict[str, Any]:
    ref = DispatchRef(str(uuid.uuid4()), str(uuid.uuid4()), "acme", "cap", "w", "key-1")
    return build_job(ref, input={}, spec=spec, namespace="jobs", deployment="d")


def _pod(job: dict[str, Any]) -> dict[str, Any]:
    return job["spec"]["template"]["spec"]


def test_by_default_a_job_meets_the_restricted_profile() -> None:
    job = _job(_resolver().spec("cap"))
    pod = _pod(job)
    assert pod["securityContext"] == RESTRICTED_POD
    assert pod["containers"][0]["securityContext"] == RESTRICTED_CONTAINER
    assert pod["automountServiceAccountToken"] is False
    assert SECURITY_OVERRIDES_ANNOTATION not in job["metadata"]["annotations"]


def test_a_non_root_uid_and_gid_are_set_when_given() -> None:
    pod = _pod(_job(_resolver(runAsUser=65534, runAsGroup=65534).spec("cap")))
    assert pod["securityContext"] == {**RESTRICTED_POD, "runAsUser": 65534, "runAsGroup": 65534}


# (override, where the default was, the key that must then be absent)
OVERRIDES = [
    ("runAsNonRoot", "pod", "runAsNonRoot"),
    ("seccompProfile", "pod", "seccompProfile"),
    ("allowPrivilegeEscalation", "container", "allowPrivilegeEscalation"),
    ("capabilities", "container", "capabilities"),
    ("automountServiceAccountToken", "spec", "automountServiceAccountToken"),
]


@pytest.mark.parametrize(("override", "where", "key"), OVERRIDES)
def test_each_default_is_switched_off_alone_and_its_reason_recorded(override: str, where: str, key: str) -> None:
    job = _job(_resolver(securityOverrides={override: "the vendor image needs it"}).spec("cap"))
    pod = _pod(job)
    places = {
        "pod": pod.get("securityContext", {}),
        "container": pod["containers"][0].get("securityContext", {}),
        "spec": pod,
    }
    assert key not in places[where]
    # Everything else stays as restricted wants it.
    kept = {**RESTRICTED_POD, **RESTRICTED_CONTAINER, "automountServiceAccountToken": False}
    del kept[key]
    for name, value in kept.items():
        found = [place[name] for place in places.values() if name in place]
        assert found == [value], name
    reasons = json.loads(job["metadata"]["annotations"][SECURITY_OVERRIDES_ANNOTATION])
    assert reasons == {override: "the vendor image needs it"}
    assert job["spec"]["template"]["metadata"]["annotations"][SECURITY_OVERRIDES_ANNOTATION]


def test_every_default_has_a_test_row() -> None:
    assert sorted(o for o, _, _ in OVERRIDES) == sorted(SECURITY_DEFAULTS)


@pytest.mark.parametrize(
    ("fields", "field", "words"),
    [
        ({"securityOverrides": {"privileged": "because"}}, "securityOverrides", "'privileged' is not one of"),
        ({"securityOverrides": {"runAsNonRoot": ""}}, "securityOverrides", "needs a reason"),
        ({"securityOverrides": {"runAsNonRoot": "   "}}, "securityOverrides", "needs a reason"),
        ({"securityOverrides": {"runAsNonRoot": True}}, "securityOverrides", "mapping of strings to strings"),
        ({"securityOverrides": ["runAsNonRoot"]}, "securityOverrides", "mapping of strings to strings"),
        ({"runAsUser": 0}, "runAsUser", "0 is root, which runAsNonRoot forbids"),
        ({"runAsUser": -1}, "runAsUser", "not a non-negative integer"),
        ({"runAsUser": "1000"}, "runAsUser", "must be an integer"),
        ({"runAsGroup": True}, "runAsGroup", "must be an integer"),
    ],
)
def test_bad_security_fields_are_a_config_error_naming_the_field(
    fields: dict[str, Any], field: str, words: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        _resolver(**fields)
    message = str(caught.value)
    assert f"caps.yaml: capability 'cap': field '{field}':" in message
    assert words in message


def test_root_is_allowed_only_with_runasnonroot_overridden() -> None:
    spec = _resolver(runAsUser=0, securityOverrides={"runAsNonRoot": "legacy image writes to /root"}).spec("cap")
    assert _pod(_job(spec))["securityContext"] == {"runAsUser": 0, "seccompProfile": {"type": "RuntimeDefault"}}


def test_a_hand_built_spec_cannot_slip_past_build_job() -> None:
    spec = CapabilitySpec(name="cap", worker_name="w", image="busybox", security_overrides={"seccompProfile": ""})
    with pytest.raises(InvalidManifest, match="securityOverrides"):
        _job(spec)
