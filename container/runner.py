"""The worker-side runner a Job's container runs: `python -m k8s_dispatch.container.runner MODULE:FUNCTION`.

Reads the input JSON from `K8S_DISPATCH_INPUT`, calls `FUNCTION(input)` and writes its JSON
result (at most 4 KiB) to `TERMINATION_MESSAGE_PATH` (default /dev/termination-log), exit 0.
On any failure it writes nothing there and exits non-zero with the reason on stderr, which
`terminationMessagePolicy: FallbackToLogsOnError` then shows as the termination message.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from k8s_dispatch.container.contract import INPUT_ENV, MAX_RESULT_BYTES, TERMINATION_MESSAGE_PATH, encode_input
from k8s_dispatch.core.errors import InputNotSerialisable

TERMINATION_PATH_ENV = "TERMINATION_MESSAGE_PATH"
USAGE = "usage: python -m k8s_dispatch.container.runner MODULE:FUNCTION"

EXIT_OK = 0
EXIT_FAILED = 1  # the function raised, or its result cannot be written
EXIT_USAGE = 2  # bad arguments, missing/invalid input, or the function cannot be loaded


class RunnerError(Exception):
    """A failure the runner reports in one line, with its exit code."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def load_function(target: str) -> Callable[[Any], Any]:
    """`"package.module:name"` (or `module:Class.method`) -> the callable.

    Raises:
        RunnerError: malformed target, import failure or not callable.
    """
    module_name, colon, attr_path = target.partition(":")
    if not colon or not module_name or not attr_path:
        raise RunnerError(f"{target!r} is not MODULE:FUNCTION\n{USAGE}", EXIT_USAGE)
    try:
        obj: object = importlib.import_module(module_name)
        for attr in attr_path.split("."):
            obj = getattr(obj, attr)
    except (ImportError, AttributeError) as e:
        raise RunnerError(f"cannot load {target}: {type(e).__name__}: {e}", EXIT_USAGE) from e
    if not callable(obj):
        raise RunnerError(f"{target} is not callable", EXIT_USAGE)
    return obj


def read_input(environ: Mapping[str, str]) -> Any:
    """Raises: RunnerError: the variable is missing or not JSON."""
    text = environ.get(INPUT_ENV)
    if text is None:
        raise RunnerError(f"{INPUT_ENV} is not set", EXIT_USAGE)
    try:
        return json.loads(text)
    except ValueError as e:
        raise RunnerError(f"{INPUT_ENV} is not JSON: {e}", EXIT_USAGE) from e


def encode_result(result: Any) -> str:
    """Raises: RunnerError: not JSON, or more than MAX_RESULT_BYTES once encoded."""
    try:
        text = encode_input(result)
    except InputNotSerialisable as e:
        raise RunnerError(f"the result of the function is not JSON: {e}", EXIT_FAILED) from e
    size = len(text.encode("utf-8"))
    if size > MAX_RESULT_BYTES:
        raise RunnerError(
            f"the result is {size} bytes of JSON, more than the {MAX_RESULT_BYTES} a termination message holds",
            EXIT_FAILED,
        )
    return text


def run(target: str, environ: Mapping[str, str]) -> int:
    """Run one function as described in the module docstring; returns the exit code."""
    try:
        function = load_function(target)
        value = read_input(environ)
    except RunnerError as e:
        print(f"k8s_dispatch.container.runner: {e}", file=sys.stderr)
        if e.__cause__ is not None:
            traceback.print_exception(e.__cause__, file=sys.stderr)
        return e.exit_code
    try:
        result = function(value)
    except Exception:
        traceback.print_exc()
        print(f"k8s_dispatch.container.runner: {target} raised; no result written", file=sys.stderr)
        return EXIT_FAILED
    try:
        text = encode_result(result)
    except RunnerError as e:
        print(f"k8s_dispatch.container.runner: {e}", file=sys.stderr)
        return e.exit_code
    path = environ.get(TERMINATION_PATH_ENV) or TERMINATION_MESSAGE_PATH
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        print(f"k8s_dispatch.container.runner: cannot write the result to {path}: {e}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print(USAGE, file=sys.stderr)
        return EXIT_USAGE
    return run(args[0], os.environ)


if __name__ == "__main__":
    sys.exit(main())
