"""Results in a real object store (SeaweedFS): the runner's upload through a presigned URL,
verification before anything is recorded, reads, deletes, and the store that cannot be reached."""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
from funcs import random_bytes
from objectstore import ObjectStoreServer
from store_relay import StoreRelay

from k8s_dispatch.artifacts import Artifacts, result_upload, verify_for_delivery
from k8s_dispatch.artifacts.errors import ObjectStoreUnavailable, ResultObjectMissing
from k8s_dispatch.artifacts.reference import ResultReference, parse_reference
from k8s_dispatch.artifacts.store import stored_sha256
from k8s_dispatch.container import runner
from k8s_dispatch.container.contract import RESULT_KEY_ENV, RESULT_URL_ENV, ResultUpload
from k8s_dispatch.core.settings import load_settings
from k8s_dispatch.store.models import EventType
from k8s_dispatch.workers.capability import CapabilitySpec
from k8s_dispatch.workers.resolver import CapabilityResolver

MIB = 1 << 20


def spec(max_result_bytes: int = 64 * MIB) -> CapabilitySpec:
    return CapabilityResolver.from_mapping(
        {
            "capabilities": {
                "big": {
                    "worker": "w",
                    "image": "i",
                    "results": "objectStore",
                    "maxResultBytes": max_result_bytes,
                    "activeDeadlineSeconds": 60,
                }
            }
        }
    ).spec("big")


@pytest.fixture
def artifacts(object_store: ObjectStoreServer, unique_prefix: str) -> Artifacts:
    built = Artifacts.from_settings(load_settings(object_store.env(unique_prefix)))
    assert built is not None
    return built


def run_runner(tmp_path: Path, upload: ResultUpload, target: str, value: Any) -> tuple[int, str]:
    """The runner as a Job's container runs it, with the env the manifest gives it."""
    message = tmp_path / "termination-log"
    env = {
        "K8S_DISPATCH_INPUT": json.dumps(value),
        RESULT_URL_ENV: upload.url,
        RESULT_KEY_ENV: upload.key,
        runner.TERMINATION_PATH_ENV: str(message),
    }
    code = runner.run(target, env)
    return code, message.read_text() if message.exists() else ""


def test_a_result_uploaded_by_the_runner_is_verified_read_and_deleted(artifacts: Artifacts, tmp_path: Path) -> None:
    dispatch_id = str(uuid.uuid4())
    upload = result_upload(artifacts, spec(), dispatch_id=dispatch_id, attempt=0)
    assert upload is not None and upload.key == f"{artifacts.prefix}/{dispatch_id}/0/result"
    assert "X-Amz-Signature=" in upload.url  # the Pod gets a URL, never the credentials
    data = random_bytes({"seed": 1, "size": 3 * MIB + 17})

    code, message = run_runner(tmp_path, upload, "funcs:random_bytes", {"seed": 1, "size": len(data)})

    assert code == runner.EXIT_OK
    assert len(message.encode()) < 4096
    event, payload = verify_for_delivery(
        artifacts, spec(), dispatch_id=dispatch_id, attempt=0, output=json.loads(message)
    )
    assert event is EventType.WORKER_COMPLETED, payload
    reference = parse_reference(payload["output"])
    assert reference == ResultReference(upload.key, len(data), hashlib.sha256(data).hexdigest())
    assert b"".join(artifacts.read(reference)) == data
    with urllib.request.urlopen(artifacts.read_url(reference, 60), timeout=30) as response:
        assert response.read() == data  # the engine's short-lived URL, no credentials
    artifacts.delete(reference)
    assert artifacts.store.size(reference.key) is None
    with pytest.raises(ResultObjectMissing):
        b"".join(artifacts.read(reference))
    artifacts.delete(reference)  # deleting twice is not an error


def test_a_json_result_larger_than_a_termination_message(artifacts: Artifacts, tmp_path: Path) -> None:
    dispatch_id = str(uuid.uuid4())
    upload = result_upload(artifacts, spec(), dispatch_id=dispatch_id, attempt=2)
    assert upload is not None
    code, message = run_runner(tmp_path, upload, "funcs:rows", {"n": 5000})
    assert code == runner.EXIT_OK
    event, payload = verify_for_delivery(
        artifacts, spec(), dispatch_id=dispatch_id, attempt=2, output=json.loads(message)
    )
    assert event is EventType.WORKER_COMPLETED
    text = b"".join(artifacts.read(parse_reference(payload["output"])))
    assert json.loads(text)[4999] == {"i": 4999, "square": 4999 * 4999}
    assert len(text) > 4096


def test_a_file_the_function_wrote_is_streamed_as_the_result(artifacts: Artifacts, tmp_path: Path) -> None:
    dispatch_id = str(uuid.uuid4())
    upload = result_upload(artifacts, spec(), dispatch_id=dispatch_id, attempt=0)
    assert upload is not None
    value = {"seed": 3, "size": 2 * MIB + 5}
    code, message = run_runner(tmp_path, upload, "funcs:file_of", value)
    assert code == runner.EXIT_OK
    event, payload = verify_for_delivery(
        artifacts, spec(), dispatch_id=dispatch_id, attempt=0, output=json.loads(message)
    )
    assert event is EventType.WORKER_COMPLETED
    assert b"".join(artifacts.read(parse_reference(payload["output"]))) == random_bytes(value)


def _uploaded(artifacts: Artifacts, dispatch_id: str, data: bytes, attempt: int = 0) -> ResultReference:
    upload = result_upload(artifacts, spec(), dispatch_id=dispatch_id, attempt=attempt)
    assert upload is not None
    runner.upload(upload.url, data)
    return ResultReference(upload.key, len(data), hashlib.sha256(data).hexdigest())


@pytest.fixture(params=[True, False], ids=["store-hashes", "read-back"])
def checked(request: pytest.FixtureRequest, object_store: ObjectStoreServer, unique_prefix: str) -> Any:
    """Artifacts behind a relay that sees each request: with the store's own SHA-256 asked for
    (the default), or without (`object_store_server_checksums` off: results are read back)."""
    relay = StoreRelay(object_store.endpoint)
    env = object_store.env(unique_prefix) | {
        "K8S_DISPATCH_OBJECT_STORE_ENDPOINT": relay.endpoint,
        "K8S_DISPATCH_OBJECT_STORE_SERVER_CHECKSUMS": str(request.param).lower(),
    }
    built = Artifacts.from_settings(load_settings(env))
    assert built is not None
    yield built, relay, request.param
    relay.close()


def test_delivery_verifies_by_the_stores_own_sha256_or_else_reads_the_object_back(checked: Any) -> None:
    artifacts, relay, store_hashes = checked
    dispatch_id = str(uuid.uuid4())
    data = random_bytes({"seed": 4, "size": 2 * MIB + 3})
    reference = _uploaded(artifacts, dispatch_id, data)
    stat = artifacts.store.stat(reference.key)
    assert stat is not None and stat.size == len(data)
    assert stat.sha256 == (hashlib.sha256(data).hexdigest() if store_hashes else None)
    gets = len(relay.seen("GET"))

    event, payload = verify_for_delivery(
        artifacts, spec(), dispatch_id=dispatch_id, attempt=0, output=reference.to_output()
    )

    assert event is EventType.WORKER_COMPLETED, payload
    assert len(relay.seen("GET")) - gets == (0 if store_hashes else 1)  # read back only when the store hashed nothing


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda r: ResultReference(r.key, r.size + 1, r.sha256), "ResultObjectMismatch"),
        (lambda r: ResultReference(r.key, r.size, hashlib.sha256(b"other").hexdigest()), "ResultObjectMismatch"),
        (lambda r: ResultReference(r.key.replace("/0/", "/1/"), r.size, r.sha256), "InvalidResultReference"),
        (lambda r: ResultReference(r.key, 65 * MIB, r.sha256), "ResultTooLarge"),
    ],
    ids=["size", "sha256", "another-attempts-key", "too-large"],
)
def test_a_reference_that_does_not_match_its_object_fails_typed(checked: Any, change: Any, reason: str) -> None:
    artifacts = checked[0]
    dispatch_id = str(uuid.uuid4())
    reference = change(_uploaded(artifacts, dispatch_id, b"x" * 1000))
    event, payload = verify_for_delivery(
        artifacts, spec(), dispatch_id=dispatch_id, attempt=0, output=ResultReference.to_output(reference)
    )
    assert event is EventType.WORKER_FAILED
    assert payload["reason"] == reason
    assert "output" not in payload  # never a recorded reference to bytes that are not those


def test_a_missing_object_and_a_malformed_reference_fail_typed(artifacts: Artifacts) -> None:
    dispatch_id = str(uuid.uuid4())
    never = ResultReference(artifacts.key(dispatch_id, 0), 10, hashlib.sha256(b"0123456789").hexdigest())
    event, payload = verify_for_delivery(
        artifacts, spec(), dispatch_id=dispatch_id, attempt=0, output=never.to_output()
    )
    assert (event, payload["reason"]) == (EventType.WORKER_FAILED, "ResultObjectMissing")
    event, payload = verify_for_delivery(artifacts, spec(), dispatch_id=dispatch_id, attempt=0, output={"n": 1})
    assert (event, payload["reason"]) == (EventType.WORKER_FAILED, "InvalidResultReference")


def test_an_upload_url_stripped_of_its_checksum_or_changing_it_is_refused(artifacts: Artifacts) -> None:
    """The checksum the store is asked for is in the URL's signed query: a Pod cannot drop it (so
    that the store keeps no SHA-256 and delivery must read back) or ask for another."""
    upload = result_upload(artifacts, spec(), dispatch_id=str(uuid.uuid4()), attempt=0)
    assert upload is not None and "x-amz-sdk-checksum-algorithm=SHA256" in upload.url
    stripped = upload.url.replace("x-amz-sdk-checksum-algorithm=SHA256&", "")
    for url in (stripped, upload.url.replace("=SHA256", "=CRC32")):
        request = urllib.request.Request(url, data=b"payload", method="PUT")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        refused.value.close()
        assert refused.value.code in (400, 403)
    assert artifacts.store.size(upload.key) is None


@pytest.mark.parametrize("change", ["grew", "shrank"])
def test_a_result_file_that_changes_while_it_is_sent_ends_the_run_and_stores_nothing(
    object_store: ObjectStoreServer, unique_prefix: str, tmp_path: Path, change: str
) -> None:
    """The runner announces the file's size and takes the SHA-256 as it sends: a file changed in
    between must end the run, never store bytes its reference does not describe. A relay holds the
    PUT (its Content-Length announced), the file changes, the relay drops the PUT: the runner's
    try again reads the changed file."""
    relay = StoreRelay(object_store.endpoint)
    try:
        env = object_store.env(unique_prefix) | {"K8S_DISPATCH_OBJECT_STORE_ENDPOINT": relay.endpoint}
        artifacts = Artifacts.from_settings(load_settings(env))
        assert artifacts is not None
        upload = result_upload(artifacts, spec(), dispatch_id=str(uuid.uuid4()), attempt=0)
        assert upload is not None
        result = tmp_path / "result.bin"
        result.write_bytes(random_bytes({"seed": 5, "size": 4 * MIB}))
        relay.hold("PUT", 1)
        outcome: dict[str, Any] = {}

        def send() -> None:
            try:
                outcome["sent"] = runner.upload(upload.url, result)
            except runner.RunnerError as e:
                outcome["error"] = e

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        assert relay.holding.wait(60), "the runner's PUT never reached the relay"
        if change == "grew":
            with result.open("ab") as f:
                f.write(b"more")
        else:
            with result.open("r+b") as f:
                f.truncate(MIB)
        relay.release()
        sender.join(120)
        assert not sender.is_alive()
        assert "sent" not in outcome, outcome
        assert "the result changed while it was uploaded" in str(outcome["error"])
        assert outcome["error"].exit_code == runner.EXIT_FAILED
        assert artifacts.store.size(upload.key) is None
    finally:
        relay.close()


def test_a_url_for_one_key_writes_no_other(artifacts: Artifacts) -> None:
    upload = result_upload(artifacts, spec(), dispatch_id=str(uuid.uuid4()), attempt=0)
    assert upload is not None
    forged = upload.url.replace("/0/result", "/1/result")
    with pytest.raises(runner.RunnerError, match="HTTP 403"):
        runner.upload(forged, b"data")


def test_an_unreachable_store_is_transient_and_records_nothing(object_store: ObjectStoreServer) -> None:
    env = object_store.env("down") | {"K8S_DISPATCH_OBJECT_STORE_ENDPOINT": "http://127.0.0.1:9"}
    artifacts = Artifacts.from_settings(load_settings(env))
    assert artifacts is not None
    dispatch_id = str(uuid.uuid4())
    reference = ResultReference(artifacts.key(dispatch_id, 0), 1, hashlib.sha256(b"x").hexdigest())
    with pytest.raises(ObjectStoreUnavailable):
        verify_for_delivery(artifacts, spec(), dispatch_id=dispatch_id, attempt=0, output=reference.to_output())


@pytest.mark.parametrize(
    ("head", "expected"),
    [
        ({"ChecksumSHA256": base64.b64encode(bytes(range(32))).decode()}, bytes(range(32)).hex()),
        ({"ChecksumSHA256": base64.b64encode(bytes(32)).decode(), "ChecksumType": "FULL_OBJECT"}, bytes(32).hex()),
        ({"ChecksumSHA256": base64.b64encode(bytes(32)).decode(), "ChecksumType": "COMPOSITE"}, None),
        ({"ChecksumSHA256": base64.b64encode(bytes(20)).decode()}, None),
        ({"ChecksumSHA256": "not base64!"}, None),
        ({"ChecksumCRC32": "AAAAAA=="}, None),
        ({}, None),
    ],
    ids=["sha256", "full-object", "composite", "short", "not-base64", "crc32-only", "none"],
)
def test_only_a_whole_objects_sha256_from_the_store_is_taken(head: dict[str, str], expected: str | None) -> None:
    assert stored_sha256(head) == expected
