"""The runner's side of a stored input, through its command line as a Pod runs it: the bytes are
checked against the reference before the function is called, and other bytes, a larger object or
a refused read end the run typed, with the reason first in the termination message."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k8s_dispatch.container.contract import (
    INPUT_MISMATCH,
    INPUT_REF_ENV,
    INPUT_UNREADABLE,
    INPUT_URL_ENV,
    InputDownload,
)

HERE = Path(__file__).parent


def _run(tmp_path: Path, stored: bytes | None, scheduled: bytes) -> tuple[int, str, str]:
    """Run `input_funcs:digest` on an input stored as `stored` (None: no object) whose reference
    names `scheduled`; the exit code, the termination message and stderr."""
    path = tmp_path / "input"
    if stored is not None:
        path.write_bytes(stored)
    download = InputDownload(
        key="p/d/input", size=len(scheduled), sha256=hashlib.sha256(scheduled).hexdigest(), url=path.as_uri()
    )
    message = tmp_path / "termination-log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("K8S_DISPATCH_")}
    env.update({
        INPUT_URL_ENV: download.url, INPUT_REF_ENV: download.reference(), "TERMINATION_MESSAGE_PATH": str(message),
        "PYTHONPATH": str(HERE),
    })  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "k8s_dispatch.container.runner", "input_funcs:digest"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    return done.returncode, message.read_text() if message.exists() else "", done.stderr


def test_the_scheduled_bytes_reach_the_function(tmp_path: Path) -> None:
    data = b'{"a":[1,2,3],"b":"\xc3\xa9"}'
    code, message, _ = _run(tmp_path, data, data)
    assert code == 0
    assert json.loads(message) == {"sha256": hashlib.sha256(data).hexdigest(), "keys": ["a", "b"]}


@pytest.mark.parametrize(
    ("stored", "reason"),
    [
        (b'{"a":[1,2,4],"b":"\xc3\xa9"}', INPUT_MISMATCH),  # same size, other bytes
        (b'{"a":[1,2,3],"b":"\xc3\xa9"} ', INPUT_MISMATCH),  # one byte more
        (b'{"a":[1,2]}', INPUT_MISMATCH),  # shorter
        (None, INPUT_UNREADABLE),  # no object at all
    ],
)
def test_other_bytes_end_the_run_typed_and_the_function_is_not_called(
    tmp_path: Path, stored: bytes | None, reason: str
) -> None:
    code, message, stderr = _run(tmp_path, stored, b'{"a":[1,2,3],"b":"\xc3\xa9"}')
    assert code == 2
    assert message.startswith(f"{reason}: "), message
    assert reason == INPUT_UNREADABLE or "the function was not called" in message
    assert "p/d/input" in stderr  # the log says it too
