"""deploy/capabilities.example.yaml does real work: each capability's Job is built with the
real manifest code and its container's command, args and env are run as a local process
(as localcluster's exec mode does), and the termination message must parse as the result.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from deploy_files import DEPLOY
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k8s_dispatch.container.contract import INPUT_ENV, encode_input
from k8s_dispatch.workers.job_status import parse_result
from k8s_dispatch.workers.manifest import build_job
from k8s_dispatch.workers.resolver import CapabilityResolver
from k8s_dispatch.workers.types import (
    CapabilityName,
    CaseId,
    DispatchId,
    DispatchRef,
    IdempotencyKey,
    TenancyId,
    WorkerName,
)

# The images' interpreters, played by this machine's.
LOCAL = {"sh": shutil.which("sh"), "python": sys.executable}


@functools.cache
def _resolver() -> CapabilityResolver:
    # Loaded on first use, not at import: a broken file fails these tests, not the collection.
    return CapabilityResolver.from_file(DEPLOY / "capabilities.example.yaml")


ODD_INPUTS = [
    {"text": "hello"},
    [],
    "plain string",
    {"price": "$5 and $(HOME) and ${PATH}", "pct": "100%s %d", "quote": 'it\'s "quoted"\\n'},
    {"unicode": "zürich · 東京 · 🚀", "nested": {"a": [1, 2.5, None, True]}},
]


def _run(capability: str, value: Any, tmp_path: Path) -> tuple[Any, str]:
    """(the parsed result, the input text the container was given)."""
    spec = _resolver().spec(capability)
    ref = DispatchRef(
        dispatch_id=DispatchId(str(uuid.uuid4())),
        case_id=CaseId("case-1"),
        tenancy_id=TenancyId("tenant-a"),
        capability=CapabilityName(capability),
        worker_name=WorkerName(spec.worker_name),
        idempotency_key=IdempotencyKey(f"key-{uuid.uuid4()}"),
    )
    job = build_job(ref, input=value, spec=spec, namespace="k8s-dispatch", deployment="k8s-dispatch")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    argv = [*container["command"], *container.get("args", [])]
    argv[0] = LOCAL[argv[0]]
    message = tmp_path / f"termination-{uuid.uuid4().hex}"
    env = {var["name"]: var["value"] for var in container["env"]}
    env |= {"PATH": os.environ["PATH"], "TERMINATION_MESSAGE_PATH": str(message)}
    done = subprocess.run(argv, env=env, capture_output=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    result = parse_result(message.read_text(encoding="utf-8") if message.exists() else None, exit_ok=True)
    assert result.reason is None, (result.reason, result.detail)
    return result.output, env[INPUT_ENV]


@pytest.mark.parametrize("value", ODD_INPUTS)
def test_echo_returns_its_input(tmp_path: Path, value: Any) -> None:
    output, _ = _run("echo", value, tmp_path)
    assert output == {"echo": value}


@pytest.mark.parametrize("value", ODD_INPUTS)
def test_checksum_hashes_the_input_it_was_given(tmp_path: Path, value: Any) -> None:
    output, sent = _run("checksum", value, tmp_path)
    assert sent == encode_input(value)
    data = sent.encode("utf-8")
    assert output == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(st.characters(exclude_categories=("Cs",))),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=_JSON)
def test_echo_survives_any_json(tmp_path: Path, value: Any) -> None:
    # The shell only ever sees the input as one quoted argument to printf's %s.
    output, _ = _run("echo", value, tmp_path)
    assert output == {"echo": value}
