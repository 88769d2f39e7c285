"""How the lab starts its own SeaweedFS (`weed mini`: master, volume, filer and S3 gateway in one
process, on loopback only): the S3 identity file and the command line, shared by the tests' store,
the chaos run's and the artifacts bench's, so the three start and stop the same server."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path

PORTS = 10  # how many free ports `mini_argv` takes
ACTIONS = ["Admin", "Read", "List", "Tagging", "Write"]


def s3_config(name: str, access_key: str, secret_key: str) -> str:
    """The S3 gateway's identities file (`-s3.config`): one identity with every action."""
    credentials = [{"accessKey": access_key, "secretKey": secret_key}]
    return json.dumps({"identities": [{"name": name, "credentials": credentials, "actions": ACTIONS}]})


def mini_argv(weed: Path, directory: Path, ports: Sequence[int], bucket: str, *, volume_size_mb: int = 64) -> list[str]:
    """`weed mini` keeping its data, logs, sockets and `s3.json` under `directory`, on `ports`
    (PORTS free ports; the S3 gateway's is `ports[6]`), with `bucket` made at start."""
    if len(ports) != PORTS:
        raise ValueError(f"weed mini takes {PORTS} ports, got {len(ports)}")
    d, p = directory, ports
    return [
        str(weed), f"-logdir={d}", "mini", f"-dir={d}/data", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        f"-master.port={p[0]}", f"-master.port.grpc={p[1]}", "-master.telemetry=false",
        f"-master.volumeSizeLimitMB={volume_size_mb}", f"-volume.port={p[2]}", f"-volume.port.grpc={p[3]}",
        f"-filer.port={p[4]}", f"-filer.port.grpc={p[5]}", f"-filer.localSocket={d}/filer.sock",
        f"-s3.port={p[6]}", f"-s3.port.grpc={p[7]}", f"-s3.config={d}/s3.json",
        "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.localSocket={d}/s3.sock",
        "-webdav=false", "-admin.ui=false", f"-admin.port={p[8]}", f"-admin.port.grpc={p[9]}",
        "-admin.port.legacy=0", f"-bucket={bucket}",
    ]  # fmt: skip


def start(argv: Sequence[str], directory: Path) -> subprocess.Popen[bytes]:
    """`argv` (from `mini_argv`) run in `directory`, its output in `directory`/weed.log."""
    with (directory / "weed.log").open("wb") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=directory)


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if it has not exited within 10 s."""
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
