"""A real S3-compatible object store for the tests: SeaweedFS's `weed mini` (master, volume
server, filer and S3 gateway in one process) on free ports, data in a temporary folder.

`weed` is built from its Go module by `tools/build.sh seaweedfs` (cached outside the repository).
Importing this module (conftest does, as the session starts) starts that build in the
background, so a cold build (about 11 CPU-minutes) overlaps the tests that need no store; the
fixture waits for it. With the tool cached the script only hashes its inputs and prints the path.
"""

from __future__ import annotations

import atexit
import os
import secrets
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from k8s_dispatch.lab import seaweedfs
from k8s_dispatch.ops.processes import free_ports

BUILD_SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "build.sh"
READY_DEADLINE_S = 60.0
BUILD_DEADLINE_S = 1800.0
BUCKET = "results"

_build_log = tempfile.NamedTemporaryFile(prefix="weed-build-", suffix=".log", delete=False)  # noqa: SIM115
_build = subprocess.Popen(
    ["bash", str(BUILD_SCRIPT), "seaweedfs"], stdout=subprocess.PIPE, stderr=_build_log, text=True
)
atexit.register(os.unlink, _build_log.name)  # its tail is in the failure message if it failed


def weed_binary() -> Path:
    """The built `weed`, waiting for the background build. Fails the test if it failed."""
    if "stdout" not in _build_out:
        out, _ = _build.communicate(timeout=BUILD_DEADLINE_S)
        _build_out["stdout"] = out or ""
    lines = _build_out["stdout"].strip().splitlines()
    if _build.returncode != 0 or not lines:
        tail = Path(_build_log.name).read_text(errors="replace")[-2000:]
        pytest.fail(f"tools/build.sh seaweedfs failed (exit {_build.returncode}):\n{tail}", pytrace=False)
    return Path(lines[-1]) / "weed"


_build_out: dict[str, str] = {}


@dataclass
class ObjectStoreServer:
    endpoint: str
    access_key: str
    secret_key: str
    bucket: str
    directory: Path
    process: subprocess.Popen[bytes]

    def env(self, prefix: str) -> dict[str, str]:
        """K8S_DISPATCH_* settings for this store, results under `prefix`."""
        return {
            "K8S_DISPATCH_OBJECT_STORE_ENDPOINT": self.endpoint,
            "K8S_DISPATCH_OBJECT_STORE_BUCKET": self.bucket,
            "K8S_DISPATCH_OBJECT_STORE_PREFIX": prefix,
            "K8S_DISPATCH_OBJECT_STORE_ACCESS_KEY": self.access_key,
            "K8S_DISPATCH_OBJECT_STORE_SECRET_KEY": self.secret_key,
        }


def _wait_ready(server: ObjectStoreServer, log: Path) -> None:
    """Until a signed PUT of a probe object succeeds (the gateway answers /healthz before the
    filer and a volume can take writes), within READY_DEADLINE_S."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    client = boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}, connect_timeout=2, read_timeout=5, retries={"max_attempts": 1}),
    )
    deadline = time.monotonic() + READY_DEADLINE_S
    last = ""
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            pytest.fail(f"weed exited {server.process.returncode}: {log.read_text(errors='replace')[-2000:]}")
        try:
            client.put_object(Bucket=server.bucket, Key=".probe", Body=b"ok")
            client.delete_object(Bucket=server.bucket, Key=".probe")
            return
        except (BotoCoreError, ClientError) as e:
            last = str(e)
        time.sleep(0.05)  # a poll interval under a deadline, not a synchronisation
    pytest.fail(f"SeaweedFS not ready in {READY_DEADLINE_S} s: {last}; log {log}", pytrace=False)


@pytest.fixture(scope="session")
def object_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ObjectStoreServer]:
    """One SeaweedFS for the session; use a prefix of your own (`unique_prefix`)."""
    weed = weed_binary()
    d = tmp_path_factory.mktemp("seaweedfs")
    (d / "data").mkdir()
    ak, sk = "dispatch", secrets.token_hex(16)
    (d / "s3.json").write_text(seaweedfs.s3_config("dispatch", ak, sk))
    p = free_ports(seaweedfs.PORTS)
    cmd = seaweedfs.mini_argv(weed, d, p, BUCKET)
    log = d / "weed.log"
    process = seaweedfs.start(cmd, d)
    server = ObjectStoreServer(f"http://127.0.0.1:{p[6]}", ak, sk, BUCKET, d, process)
    try:
        _wait_ready(server, log)
        yield server
    finally:
        seaweedfs.stop(process)


@pytest.fixture
def unique_prefix() -> str:
    """A key prefix no other test (or session sharing the store) uses."""
    return f"t-{os.getpid()}-{secrets.token_hex(4)}"
