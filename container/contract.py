"""The contract between a Job's manifest and the code in its container (pure): where the input is,
where the result goes and how large it may be. One definition, read by both sides: the manifest
builder (`workers.manifest`), the result reader (`workers.job_status`) and the runner."""

from __future__ import annotations

from k8s_dispatch.core.payloads import canonical_json

INPUT_ENV = "K8S_DISPATCH_INPUT"
TERMINATION_MESSAGE_PATH = "/dev/termination-log"
MAX_RESULT_BYTES = 4096  # the kubelet keeps at most 4 KiB of a container's termination message


def encode_input(value: object) -> str:
    """The input or result as the container sees it: the engine's canonical JSON
    (`core.payloads.canonical_json`), with `$` written as `\\u0024`, so the text never holds
    the `$(VAR)` syntax that Kubernetes expands in env values (any JSON parser reads it back
    as `$`).

    Raises:
        InputNotSerialisable: not JSON (sets, bytes, NaN, cycles, non-string keys...) or
            holding strings that are not valid Unicode (lone surrogates).
    """
    return canonical_json(value, what="value").replace("$", "\\u0024")
