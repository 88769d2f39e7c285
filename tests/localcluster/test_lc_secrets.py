"""Secrets on both clusters (localcluster and the real control plane, `sim`): the API as kube-apiserver
serves it (stringData merged into data and not kept, type Opaque by default, base64 and config
keys checked, type and an immutable Secret's data unchangeable, watch events), the garbage
collector deleting a Secret with its Job, or at once when written after its Job left; and the node
(localcluster's own in both modes, our node agent on the real control plane) holding a container
whose Secret or key is missing (CreateContainerConfigError, the kubelet's words) until it exists.
The node agent's side in both modes on both servers is in test_lc_node.py."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from conftest import Api, job_manifest, raw_request, wait_for
from kubernetes import client, watch

SIM = "localcluster.k8s-dispatch.io/"


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _secret(name: str, **fields: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, **fields}


def _create_error(api: Api, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    code, _, raw = raw_request(api.cluster, "POST", f"/api/v1/namespaces/{api.namespace}/secrets", body)
    return code, json.loads(raw)


def _read(api: Api, name: str) -> Any:
    return api.core.read_namespaced_secret(name, api.namespace)


def test_string_data_is_merged_into_data_and_the_type_defaults_to_opaque(sim: Api) -> None:
    made = sim.core.create_namespaced_secret(
        sim.namespace, _secret("s", data={"a": _b64("one"), "b": _b64("old")}, stringData={"b": "two", "c": "three"})
    )
    assert made.type == "Opaque" and made.string_data is None
    assert made.data == {"a": _b64("one"), "b": _b64("two"), "c": _b64("three")}
    assert _read(sim, "s").data == made.data
    listed = sim.core.list_namespaced_secret(sim.namespace, field_selector="type=Opaque").items
    assert [s.metadata.name for s in listed] == ["s"]

    patched = sim.core.patch_namespaced_secret("s", sim.namespace, {"stringData": {"a": "uno"}})
    assert patched.data["a"] == _b64("uno") and patched.string_data is None
    patched.data = {"only": _b64("x")}
    replaced = sim.core.replace_namespaced_secret("s", sim.namespace, patched)
    assert replaced.data == {"only": _b64("x")} and replaced.type == "Opaque"


def test_values_must_be_base64_and_keys_config_keys(sim: Api) -> None:
    code, status = _create_error(sim, _secret("bad", data={"k": "YWJ"}))
    assert (code, status["reason"]) == (400, "BadRequest")
    assert (
        status["message"] == 'Secret in version "v1" cannot be handled as a Secret: illegal base64 data at input byte 0'
    )
    code, status = _create_error(sim, _secret("bad", data={"k": "YW!j"}))
    assert status["message"].endswith("illegal base64 data at input byte 2")

    code, status = _create_error(sim, _secret("bad", stringData={"a key": "v"}))
    assert (code, status["reason"]) == (422, "Invalid")
    [cause] = status["details"]["causes"]
    assert cause["field"] == "data[a key]" and "a valid config key must consist of alphanumeric" in cause["message"]

    code, status = _create_error(sim, _secret("Bad_Name", stringData={"k": "v"}))
    assert code == 422 and status["details"]["causes"][0]["field"] == "metadata.name"

    code, status = _create_error(sim, _secret("tls", type="kubernetes.io/tls", stringData={"tls.crt": "c"}))
    assert code == 422
    assert [(c["field"], c["reason"]) for c in status["details"]["causes"]] == [("data[tls.key]", "FieldValueRequired")]


def test_the_type_and_an_immutable_secrets_data_cannot_change(sim: Api) -> None:
    sim.core.create_namespaced_secret(sim.namespace, _secret("frozen", immutable=True, stringData={"k": "v"}))
    with pytest.raises(client.ApiException) as e:
        sim.core.patch_namespaced_secret("frozen", sim.namespace, {"stringData": {"k": "w"}})
    assert e.value.status == 422
    causes = json.loads(e.value.body)["details"]["causes"]
    assert [(c["field"], c["message"]) for c in causes] == [
        ("data", "Forbidden: field is immutable when `immutable` is set")
    ]
    with pytest.raises(client.ApiException) as e:
        sim.core.patch_namespaced_secret("frozen", sim.namespace, {"type": "kubernetes.io/basic-auth"})
    assert e.value.status == 422
    fields = [c["field"] for c in json.loads(e.value.body)["details"]["causes"]]
    assert fields == ["type", "data[username]", "data[password]"]
    sim.core.patch_namespaced_secret("frozen", sim.namespace, {"metadata": {"labels": {"l": "v"}}})  # metadata may
    assert _read(sim, "frozen").metadata.labels == {"l": "v"}


def test_a_watch_sees_a_secret_made_changed_and_deleted(sim: Api) -> None:
    made = sim.core.create_namespaced_secret(sim.namespace, _secret("w", stringData={"k": "1"}))
    events = watch.Watch().stream(
        sim.core.list_namespaced_secret,
        sim.namespace,
        field_selector="metadata.name=w",
        resource_version=made.metadata.resource_version,
        timeout_seconds=30,
    )
    sim.core.patch_namespaced_secret("w", sim.namespace, {"stringData": {"k": "2"}})
    sim.core.delete_namespaced_secret("w", sim.namespace)
    seen = []
    for event in events:
        seen.append((event["type"], event["object"].data))
        if event["type"] == "DELETED":
            break
    assert seen == [("MODIFIED", {"k": _b64("2")}), ("DELETED", {"k": _b64("2")})]
    assert sim.gone(lambda: _read(sim, "w"))


def _owned_by(job: Any) -> list[dict[str, Any]]:
    return [{"apiVersion": "batch/v1", "kind": "Job", "name": job.metadata.name, "uid": job.metadata.uid}]


def test_the_garbage_collector_deletes_a_secret_with_its_job_or_at_once_if_its_job_has_gone(sim: Api) -> None:
    hold = {SIM + "outcome": "hang"}
    job = sim.create_job(job_manifest("owner", annotations=hold))
    owned = _secret("owned", stringData={"k": "v"})
    owned["metadata"]["ownerReferences"] = _owned_by(job)
    sim.core.create_namespaced_secret(sim.namespace, owned)
    kept = sim.core.create_namespaced_secret(sim.namespace, _secret("kept", stringData={"k": "v"}))
    sim.batch.delete_namespaced_job("owner", sim.namespace, propagation_policy="Background")
    wait_for(lambda: sim.gone(lambda: _read(sim, "owned")), timeout=30, what="the owned Secret collected")
    assert _read(sim, "kept").metadata.uid == kept.metadata.uid

    # Written after its Job left (a create step that lost the race with a deletion): collected too.
    wait_for(lambda: sim.gone(lambda: sim.job("owner")), timeout=30, what="the Job gone")
    late = _secret("late", stringData={"k": "v"})
    late["metadata"]["ownerReferences"] = _owned_by(job)
    sim.core.create_namespaced_secret(sim.namespace, late)
    wait_for(lambda: sim.gone(lambda: _read(sim, "late")), timeout=30, what="the late Secret collected")


def _reads_secret(name: str, *, key: str = "k", optional: bool | None = None) -> list[dict[str, Any]]:
    ref: dict[str, Any] = {"name": name, "key": key}
    if optional is not None:
        ref["optional"] = optional
    return [{"name": "VALUE", "valueFrom": {"secretKeyRef": ref}}, {"name": "SHOWN", "value": "<$(VALUE)>"}]


def _waiting(api: Api, job: str) -> tuple[str, str] | None:
    for pod in api.pods_of(job):
        for status in pod.status.container_statuses or []:
            if status.state and status.state.waiting and status.state.waiting.reason == "CreateContainerConfigError":
                return status.state.waiting.reason, status.state.waiting.message
    return None


def _report_env() -> list[str]:
    """Exec mode: the container writes what it got as its result."""
    script = "import os\nopen(os.environ['TERMINATION_MESSAGE_PATH'], 'w').write(os.environ.get('SHOWN', 'unset'))\n"
    return ["python", "-c", script]


def _waits_for_its_secret_and_its_key_then_starts(api: Api) -> Any:
    """The Pod of a Job whose env reads a Secret made after it, without the key at first."""
    api.create_job(job_manifest("reader", command=_report_env(), env=_reads_secret("later")))
    expected = ("CreateContainerConfigError", 'secret "later" not found')
    assert wait_for(lambda: _waiting(api, "reader"), timeout=30, what="the container held back") == expected
    [pod] = api.pods_of("reader")
    assert pod.status.phase == "Pending" and pod.spec.node_name

    api.core.create_namespaced_secret(api.namespace, _secret("later", stringData={"other": "x"}))
    message = f"couldn't find key k in Secret {api.namespace}/later"
    wait_for(lambda: _waiting(api, "reader") == ("CreateContainerConfigError", message), timeout=30, what="the key")

    api.core.patch_namespaced_secret("later", api.namespace, {"stringData": {"k": "$(HOME) s3cr3t"}})
    assert api.wait_job("reader", "Complete", timeout=30).status.succeeded == 1
    [pod] = api.pods_of("reader")
    return pod


def test_a_container_waits_for_its_secret_and_its_key_then_starts(sim: Api) -> None:
    _waits_for_its_secret_and_its_key_then_starts(sim)


def test_in_exec_mode_the_process_gets_the_secrets_value_as_it_is(ex: Api) -> None:
    """Not expanded itself; a later variable that names it expands to it."""
    pod = _waits_for_its_secret_and_its_key_then_starts(ex)
    assert pod.status.container_statuses[0].state.terminated.message == "<$(HOME) s3cr3t>"


def test_an_optional_secret_that_is_missing_leaves_the_variable_unset(ex: Api) -> None:
    env = _reads_secret("absent", optional=True)
    ex.create_job(job_manifest("optional", command=_report_env(), env=env))
    ex.wait_job("optional", "Complete", timeout=30)
    [pod] = ex.pods_of("optional")
    assert pod.status.container_statuses[0].state.terminated.message == "<$(VALUE)>"  # VALUE unset: not expanded


def test_a_deleted_namespace_takes_its_secrets_with_it(sim: Api) -> None:
    namespace = sim.cluster.ensure_namespace(f"{sim.namespace}-gone")
    sim.core.create_namespaced_secret(namespace, _secret("inside", stringData={"k": "v"}))
    sim.core.delete_namespace(namespace)
    wait_for(
        lambda: sim.gone(lambda: sim.core.read_namespaced_secret("inside", namespace)),
        timeout=60,
        what="the namespace's Secret deleted",
    )


def test_a_container_reading_a_config_map_waits_for_it_too(sim: Api) -> None:
    env = [{"name": "SETTING", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "mode"}}}]
    sim.create_job(job_manifest("configured", env=env))
    expected = ("CreateContainerConfigError", 'configmap "settings" not found')
    assert wait_for(lambda: _waiting(sim, "configured"), timeout=30, what="the container held back") == expected
    made = sim.core.create_namespaced_config_map(
        sim.namespace, {"metadata": {"name": "settings"}, "data": {"mode": "fast"}, "binaryData": {"raw": _b64("x")}}
    )
    assert made.data == {"mode": "fast"} and made.binary_data == {"raw": _b64("x")}
    assert sim.wait_job("configured", "Complete", timeout=30).status.succeeded == 1
