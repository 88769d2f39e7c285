"""Inputs too large for a Job's env, in the object store: the create step writes the input's
canonical JSON under its dispatch's input key (the same bytes for every attempt, so a re-created
Job's PUT rewrites what is there) and hands the Job a presigned GET URL of its own attempt, with
the key, size and SHA-256 the runner checks before it calls the function. The Pod holds no
credentials and can read this one key, until the URL expires; the database keeps the input, so
an object lost or tampered with is written again by the next attempt's create."""

from __future__ import annotations

import hashlib

from k8s_dispatch.artifacts import keys
from k8s_dispatch.artifacts.service import Artifacts, CapabilitySpec, upload_expiry_s
from k8s_dispatch.container.contract import InputDownload
from k8s_dispatch.core.errors import InputTooLarge


def input_download(
    artifacts: Artifacts | None, spec: CapabilitySpec, *, dispatch_id: str, text: str, max_inline_bytes: int
) -> InputDownload | None:
    """For an input whose JSON `text` is larger than `max_inline_bytes`: the object written and
    its InputDownload (what `workers.manifest.build_job(..., input_download=...)` takes); None for
    an input that fits the env (nothing is written).

    Raises:
        InputTooLarge: the input does not fit the env and no object store is configured.
        ObjectStoreUnavailable: the store did not take it (the create is tried again).
    """
    data = text.encode("utf-8")
    if len(data) <= max_inline_bytes:
        return None
    if artifacts is None:
        raise InputTooLarge(
            f"input is {len(data)} bytes as JSON, over the limit of {max_inline_bytes} a Job's env carries, "
            "and no object store is configured"
        )
    key = keys.input_key(artifacts.prefix, dispatch_id)
    artifacts.store.put(key, data)
    url = artifacts.store.read_url(key, upload_expiry_s(spec, artifacts.url_slack_s))
    return InputDownload(key=key, size=len(data), sha256=hashlib.sha256(data).hexdigest(), url=url)
