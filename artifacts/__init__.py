"""Results larger than a termination message, in an S3-compatible object store.

Each attempt of a dispatch's Job writes its result to a key of its own through a presigned PUT
URL (the Pod holds no credentials); its termination message is only a reference (key, size,
SHA-256). Delivery verifies the object against the reference before it records anything, the
engine reads it through `k8s_dispatch.api`, and whatever is not a dispatch's recorded result is
deleted once the dispatch has ended (`cleanup`).
"""

from __future__ import annotations

from k8s_dispatch.artifacts.service import Artifacts, for_settings, result_upload, verify_for_delivery

__all__ = ["Artifacts", "for_settings", "result_upload", "verify_for_delivery"]
