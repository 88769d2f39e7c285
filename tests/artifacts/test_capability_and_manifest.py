"""The edges: a capability's `results`/`maxResultBytes` checked when the config loads, a
manifest that carries an attempt's upload URL exactly when its capability stores results,
the reference parsed strictly, and keys of one layout."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from k8s_dispatch.artifacts import Artifacts, keys, result_upload, verify_for_delivery
from k8s_dispatch.artifacts.errors import InvalidResultReference
from k8s_dispatch.artifacts.reference import ResultReference, parse_reference
from k8s_dispatch.artifacts.service import upload_expiry_s
from k8s_dispatch.artifacts.store import MAX_PRESIGN_S, DirectoryStore
from k8s_dispatch.container import runner
from k8s_dispatch.container.contract import RESULT_KEY_ENV, RESULT_URL_ENV, ResultUpload
from k8s_dispatch.core.errors import ConfigError, InvalidManifest
from k8s_dispatch.core.settings import load_settings
from k8s_dispatch.store.models import EventType
from k8s_dispatch.workers.manifest import build_job
from k8s_dispatch.workers.resolver import CapabilityResolver
from k8s_dispatch.workers.types import CapabilityName, DispatchId, DispatchRef, WorkerName


def resolver(**fields: Any) -> CapabilityResolver:
    return CapabilityResolver.from_mapping({"capabilities": {"big": {"worker": "w", "image": "i", **fields}}})


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"results": "s3"}, "field 'results': 's3' is not one of terminationMessage, objectStore"),
        ({"results": "objectStore", "maxResultBytes": 0}, "field 'maxResultBytes': 0 is not a size in bytes"),
        ({"results": "objectStore", "maxResultBytes": "1Gi"}, "field 'maxResultBytes': must be an integer"),
        ({"maxResultBytes": 10}, "field 'maxResultBytes': applies to results: objectStore only"),
    ],
)
def test_a_bad_results_field_is_a_config_error_naming_it(fields: dict[str, Any], problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        resolver(**fields)


def test_stored_results_without_an_object_store_fail_at_start(tmp_path: Path) -> None:
    config = tmp_path / "caps.yaml"
    config.write_text("capabilities: {big: {worker: w, image: i, results: objectStore}}\n")
    with pytest.raises(ConfigError, match="no object store is configured"):
        CapabilityResolver.from_settings(load_settings({"K8S_DISPATCH_CAPABILITIES": str(config)}))
    with_store = load_settings(
        {"K8S_DISPATCH_CAPABILITIES": str(config), "K8S_DISPATCH_OBJECT_STORE_ENDPOINT": tmp_path.as_uri()}
    )
    assert CapabilityResolver.from_settings(with_store).spec("big").results_in_object_store


def _ref(dispatch_id: str) -> DispatchRef:
    return DispatchRef(
        dispatch_id=DispatchId(dispatch_id),
        case_id="case-1",
        tenancy_id="t",
        capability=CapabilityName("big"),
        worker_name=WorkerName("w"),
        idempotency_key="k",
    )


def test_the_manifest_carries_the_attempts_upload_url_only_for_stored_results(tmp_path: Path) -> None:
    spec = resolver(results="objectStore").spec("big")
    dispatch_id = str(uuid.uuid4())
    store = Artifacts(DirectoryStore(tmp_path, "b"), prefix="p")
    upload = result_upload(store, spec, dispatch_id=dispatch_id, attempt=3)
    assert upload is not None and upload.key == f"p/{dispatch_id}/3/result"
    job = build_job(
        _ref(dispatch_id), input={}, spec=spec, namespace="n", deployment="d", attempt=3, result_upload=upload
    )
    env = {e["name"]: e["value"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert (env[RESULT_URL_ENV], env[RESULT_KEY_ENV]) == (upload.url, upload.key)
    with pytest.raises(InvalidManifest, match="no upload URL"):
        build_job(_ref(dispatch_id), input={}, spec=spec, namespace="n", deployment="d")
    small = resolver().spec("big")
    assert result_upload(store, small, dispatch_id=dispatch_id, attempt=0) is None
    with pytest.raises(InvalidManifest, match="takes no upload URL"):
        build_job(_ref(dispatch_id), input={}, spec=small, namespace="n", deployment="d", result_upload=upload)
    with pytest.raises(ConfigError):
        result_upload(None, spec, dispatch_id=dispatch_id, attempt=0)
    with pytest.raises(ConfigError, match="reserved"):
        resolver(env={RESULT_URL_ENV: "x"})
    assert isinstance(upload, ResultUpload)


def test_an_upload_url_outlives_every_clock_of_its_capability() -> None:
    spec = resolver(results="objectStore", activeDeadlineSeconds=600, startTimeoutSeconds=300).spec("big")
    assert upload_expiry_s(spec, 60) == 960
    assert upload_expiry_s(resolver(results="objectStore", activeDeadlineSeconds=None).spec("big"), 60) == MAX_PRESIGN_S
    queued = resolver(results="objectStore", queue="q", queueTimeoutSeconds=100, activeDeadlineSeconds=600).spec("big")
    assert upload_expiry_s(queued, 0) == 600 + 600 + 100


@pytest.mark.parametrize(
    "output",
    [
        None,
        {"words": 3},
        {"k8s-dispatch.io/object": {"v": 1, "key": "k", "size": 1}},
        {"k8s-dispatch.io/object": {"v": 2, "key": "k", "size": 1, "sha256": "0" * 64}},
        {"k8s-dispatch.io/object": {"v": 1, "key": "", "size": 1, "sha256": "0" * 64}},
        {"k8s-dispatch.io/object": {"v": 1, "key": "k", "size": -1, "sha256": "0" * 64}},
        {"k8s-dispatch.io/object": {"v": 1, "key": "k", "size": True, "sha256": "0" * 64}},
        {"k8s-dispatch.io/object": {"v": 1, "key": "k", "size": 1, "sha256": "A" * 64}},
        {"k8s-dispatch.io/object": {"v": 1, "key": "k", "size": 1, "sha256": "0" * 64}, "extra": 1},
    ],
)
def test_a_malformed_reference_is_refused(output: object) -> None:
    with pytest.raises(InvalidResultReference):
        parse_reference(output)


def test_a_reference_reads_back_as_written() -> None:
    reference = ResultReference("p/k", 5, "a" * 64)
    assert parse_reference(reference.to_output()) == reference


def test_keys_have_one_spelling() -> None:
    dispatch_id = str(uuid.uuid4())
    assert keys.parse_key("p", keys.result_key("p", dispatch_id, 12)) == (dispatch_id, 12)
    for other in (f"p/{dispatch_id}/01/result", f"p/{dispatch_id}/1/log", "p/x/1/result", f"q/{dispatch_id}/1/result"):
        assert keys.parse_key("p", other) is None


def test_the_directory_store_takes_the_runners_upload_whole(tmp_path: Path) -> None:
    """The demo's store: the runner writes a file:// URL's file by a rename, so it appears whole."""
    spec = resolver(results="objectStore").spec("big")
    store = Artifacts.from_settings(
        load_settings({"K8S_DISPATCH_OBJECT_STORE_ENDPOINT": (tmp_path / "objects").as_uri()})
    )
    assert store is not None
    dispatch_id = str(uuid.uuid4())
    upload = result_upload(store, spec, dispatch_id=dispatch_id, attempt=0)
    assert upload is not None and upload.url.startswith("file://")
    message = tmp_path / "termination-log"
    env = {
        "K8S_DISPATCH_INPUT": '{"n": 3000}',
        RESULT_URL_ENV: upload.url,
        RESULT_KEY_ENV: upload.key,
        runner.TERMINATION_PATH_ENV: str(message),
    }
    assert runner.run("funcs:rows", env) == runner.EXIT_OK
    event, payload = verify_for_delivery(
        store, spec, dispatch_id=dispatch_id, attempt=0, output=json.loads(message.read_text())
    )
    assert event is EventType.WORKER_COMPLETED
    assert [item.key for item in store.store.list(store.prefix + "/")] == [upload.key]  # no temporary file left
    assert len(b"".join(store.read(parse_reference(payload["output"])))) > 4096
