"""container/runner.py, run as a real subprocess the way a Job's container runs it."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from k8s_dispatch import workers
from k8s_dispatch.container.contract import INPUT_ENV, MAX_RESULT_BYTES, encode_input
from k8s_dispatch.demo import functions as demo_functions
from k8s_dispatch.workers.job_status import parse_result
from k8s_dispatch.workers.manifest import build_job
from k8s_dispatch.workers.resolver import demo_resolver
from k8s_dispatch.workers.types import DispatchRef, new_dispatch_id

ROOT = Path(workers.__file__).resolve().parent.parent
TIMEOUT_S = 60


def run_runner(
    args: list[str], *, input_text: str | None, result_path: Path | None, module: str = "k8s_dispatch.container.runner"
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in (INPUT_ENV, "TERMINATION_MESSAGE_PATH")}
    env["PYTHONPATH"] = str(ROOT)
    if input_text is not None:
        env[INPUT_ENV] = input_text
    if result_path is not None:
        env["TERMINATION_MESSAGE_PATH"] = str(result_path)
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=ROOT,
    )


def test_the_old_runner_path_still_runs_and_says_it_moved(tmp_path: Path) -> None:
    """Capability files written for 0.1 name `k8s_dispatch.workers.runner`: it runs the same
    runner, with a deprecation line on stderr."""
    result_path = tmp_path / "termination-log"
    proc = run_runner(
        ["k8s_dispatch.demo.functions:wordcount"], input_text=encode_input({"text": "a b"}),
        result_path=result_path, module="k8s_dispatch.workers.runner",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(result_path.read_text(encoding="utf-8")) == {"lines": 0, "words": 2, "chars": 3}
    assert "deprecated" in proc.stderr and "k8s_dispatch.container.runner" in proc.stderr


@pytest.mark.parametrize(
    ("function", "value", "expected"),
    [
        ("wordcount", {"text": "one two\nthree\n"}, {"lines": 2, "words": 3, "chars": 14}),
        ("sha256", {"text": "héllo"}, {"sha256": hashlib.sha256("héllo".encode()).hexdigest(), "bytes": 6}),
        ("primes", {"limit": 100}, {"limit": 100, "count": 25, "largest": 97, "sum": 1060}),
        ("echo", {"cmd": "echo $(HOME) $$", "n": [1, 2.5, None]}, {"cmd": "echo $(HOME) $$", "n": [1, 2.5, None]}),
    ],
)
def test_runner_writes_the_result(tmp_path: Path, function: str, value: Any, expected: Any) -> None:
    result_path = tmp_path / "termination-log"
    proc = run_runner(
        [f"k8s_dispatch.demo.functions:{function}"], input_text=encode_input(value), result_path=result_path
    )
    assert proc.returncode == 0, proc.stderr
    text = result_path.read_text(encoding="utf-8")
    assert json.loads(text) == expected
    assert text == encode_input(expected)  # compact and sorted: the one serialisation
    assert parse_result(text, exit_ok=True).output == expected


def test_function_exception_writes_nothing_and_exits_1(tmp_path: Path) -> None:
    result_path = tmp_path / "termination-log"
    proc = run_runner(
        ["k8s_dispatch.demo.functions:primes"], input_text=encode_input({"limit": -5}), result_path=result_path
    )
    assert proc.returncode == 1
    assert not result_path.exists()
    assert "Traceback (most recent call last)" in proc.stderr
    assert "ValueError: limit must be between 0 and 1000000, not -5" in proc.stderr
    # What FallbackToLogsOnError makes of it is a ContainerFailed with the error at the end.
    detail = parse_result(proc.stderr, exit_ok=False).detail
    assert detail is not None and "no result written" in detail.splitlines()[-1]


@pytest.mark.parametrize(
    ("target", "value", "complaint"),
    [
        ("builtins:set", [1, 2], "the result of the function is not JSON"),
        ("builtins:float", "nan", "the result of the function is not JSON"),
        (
            "k8s_dispatch.demo.functions:echo",
            "x" * MAX_RESULT_BYTES,
            f"more than the {MAX_RESULT_BYTES} a termination message holds",
        ),
    ],
)
def test_results_that_cannot_be_delivered_exit_1(tmp_path: Path, target: str, value: Any, complaint: str) -> None:
    result_path = tmp_path / "termination-log"
    proc = run_runner([target], input_text=encode_input(value), result_path=result_path)
    assert proc.returncode == 1
    assert complaint in proc.stderr
    assert not result_path.exists()


def test_largest_result_that_fits(tmp_path: Path) -> None:
    value = "x" * (MAX_RESULT_BYTES - 2)  # plus two quotes: exactly the limit
    result_path = tmp_path / "termination-log"
    proc = run_runner(["k8s_dispatch.demo.functions:echo"], input_text=encode_input(value), result_path=result_path)
    assert proc.returncode == 0, proc.stderr
    assert len(result_path.read_bytes()) == MAX_RESULT_BYTES


@pytest.mark.parametrize(
    ("args", "input_text", "complaint"),
    [
        ([], "{}", "usage: python -m k8s_dispatch.container.runner MODULE:FUNCTION"),
        (["a:b", "c:d"], "{}", "usage:"),
        (["k8s_dispatch.demo.functions"], "{}", "is not MODULE:FUNCTION"),
        (["no_such_module_xyz:f"], "{}", "cannot load no_such_module_xyz:f: ModuleNotFoundError"),
        (
            ["k8s_dispatch.demo.functions:nope"],
            "{}",
            "cannot load k8s_dispatch.demo.functions:nope: AttributeError",
        ),
        (["k8s_dispatch.demo.functions:MAX_SLEEP_S"], "{}", "is not callable"),
        (["k8s_dispatch.demo.functions:echo"], None, f"{INPUT_ENV} is not set"),
        (["k8s_dispatch.demo.functions:echo"], "{not json", f"{INPUT_ENV} is not JSON"),
    ],
)
def test_usage_and_input_errors_exit_2(tmp_path: Path, args: list[str], input_text: str | None, complaint: str) -> None:
    result_path = tmp_path / "termination-log"
    proc = run_runner(args, input_text=input_text, result_path=result_path)
    assert proc.returncode == 2
    assert complaint in proc.stderr
    assert not result_path.exists()


def test_unwritable_termination_path_exits_1(tmp_path: Path) -> None:
    result_path = tmp_path / "no-such-dir" / "termination-log"
    proc = run_runner(["k8s_dispatch.demo.functions:echo"], input_text="1", result_path=result_path)
    assert proc.returncode == 1
    assert f"cannot write the result to {result_path}" in proc.stderr


def test_a_built_job_runs_as_its_container_would(tmp_path: Path) -> None:
    """The manifest's command, args and env, run as a local process (what exec mode does)."""
    resolver = demo_resolver(python=sys.executable)
    ref = DispatchRef(new_dispatch_id(), "case-1", "tenant one", "demo.wordcount", "demo-text", "key-1")
    text = "Dollars: $(HOME) and $$x\nsecond line"
    job = build_job(
        ref, input={"text": text}, spec=resolver.spec("demo.wordcount"), namespace="default", deployment="test"
    )
    (container,) = job["spec"]["template"]["spec"]["containers"]
    result_path = tmp_path / "termination-log"
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT), "TERMINATION_MESSAGE_PATH": str(result_path)}
    env.update({e["name"]: e["value"] for e in container["env"]})
    proc = subprocess.run(
        [*container["command"], *container["args"]],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    result = parse_result(result_path.read_text(encoding="utf-8"), exit_ok=True)
    assert result.ok and result.output == demo_functions.wordcount({"text": text})


@pytest.mark.parametrize(
    ("function", "value", "expected"),
    [
        (demo_functions.wordcount, {"text": ""}, {"lines": 0, "words": 0, "chars": 0}),
        (demo_functions.primes, {"limit": 0}, {"limit": 0, "count": 0, "largest": None, "sum": 0}),
        (demo_functions.primes, {"limit": 1}, {"limit": 1, "count": 0, "largest": None, "sum": 0}),
        (demo_functions.primes, {"limit": 2}, {"limit": 2, "count": 1, "largest": 2, "sum": 2}),
        (
            demo_functions.primes,
            {"limit": 1_000_000},
            {"limit": 1_000_000, "count": 78498, "largest": 999983, "sum": 37550402023},
        ),
        (demo_functions.sleep, {"seconds": 0}, {"slept": 0.0}),
    ],
)
def test_demo_functions(function: Any, value: Any, expected: Any) -> None:
    assert function(value) == expected


@pytest.mark.parametrize(
    ("function", "value"),
    [
        (demo_functions.wordcount, {"txt": "a"}),
        (demo_functions.wordcount, ["a"]),
        (demo_functions.sha256, {"text": 5}),
        (demo_functions.primes, {"limit": True}),
        (demo_functions.primes, {"limit": 1_000_001}),
        (demo_functions.sleep, {"seconds": -1}),
    ],
)
def test_demo_functions_refuse_bad_input(function: Any, value: Any) -> None:
    with pytest.raises(ValueError):
        function(value)


def test_demo_fail_raises_its_message() -> None:
    with pytest.raises(RuntimeError, match=r"^planned$"):
        demo_functions.fail({"message": "planned"})
