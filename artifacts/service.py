"""The object store as the other layers use it: an attempt's upload location for the create
path, the verification the completion path runs before it records, reads and deletes for the
engine (`k8s_dispatch.api`)."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from k8s_dispatch.artifacts import keys
from k8s_dispatch.artifacts.errors import (
    InvalidResultReference,
    ObjectStoreUnavailable,
    ResultObjectMismatch,
    ResultObjectMissing,
    ResultTooLarge,
)
from k8s_dispatch.artifacts.reference import ResultReference, parse_reference
from k8s_dispatch.artifacts.store import MAX_PRESIGN_S, ObjectStore, open_store
from k8s_dispatch.container.contract import ResultUpload
from k8s_dispatch.core.errors import ConfigError, Permanent
from k8s_dispatch.store.models import EventType

if TYPE_CHECKING:
    from k8s_dispatch.core.settings import Settings

__all__ = ["Artifacts", "ObjectStoreUnavailable", "for_settings", "result_upload", "verify_for_delivery"]


class CapabilitySpec(Protocol):
    """What this package reads of a capability (`workers.capability.CapabilitySpec` has it):
    artifacts and workers are sibling layers, neither imports the other."""

    @property
    def name(self) -> str: ...
    @property
    def results_in_object_store(self) -> bool: ...
    @property
    def max_result_bytes(self) -> int: ...
    @property
    def active_deadline_seconds(self) -> int | None: ...
    @property
    def start_timeout_seconds(self) -> int: ...
    @property
    def queue(self) -> str | None: ...
    @property
    def queue_timeout_seconds(self) -> int | None: ...


@dataclass(frozen=True)
class Artifacts:
    """A configured object store and the settings that shape its use."""

    store: ObjectStore
    prefix: str
    url_slack_s: int = 600
    read_url_s: int = 300
    retention_days: int = 0
    orphan_grace_s: float = 3600.0
    log_max_bytes: int = 10 * 1024 * 1024  # the most of a container's log `archiveLogs` keeps

    @classmethod
    def from_settings(cls, settings: Settings) -> Artifacts | None:
        store = open_store(settings)
        if store is None:
            return None
        return cls(
            store=store,
            prefix=settings.object_store_prefix,
            url_slack_s=settings.object_store_url_slack_s,
            read_url_s=settings.object_store_read_url_s,
            retention_days=settings.object_store_retention_days,
            orphan_grace_s=settings.object_store_orphan_grace_s,
            log_max_bytes=settings.archive_log_max_bytes,
        )

    def key(self, dispatch_id: str, attempt: int) -> str:
        return keys.result_key(self.prefix, dispatch_id, attempt)

    def verify(self, reference: ResultReference, *, expected_key: str, max_bytes: int) -> ResultReference:
        """`reference`, once the store holds exactly its bytes under `expected_key`.

        One HEAD: the object's size, and the SHA-256 the store computed of the bytes it kept
        (`store.Stat`), compared with the reference's. A store that keeps no SHA-256 is read back
        instead: one GET, its size checked before a byte is read, then the whole object streamed
        through SHA-256. Either way what is recorded was hashed by the store or by us, not taken
        on the Pod's word.

        Raises:
            InvalidResultReference: the reference names another key than its attempt's.
            ResultTooLarge: the reference or the object is larger than `max_bytes`.
            ResultObjectMissing: no such object (an upload that never finished).
            ResultObjectMismatch: the object's size or SHA-256 differs.
            ObjectStoreUnavailable: the store cannot say (try again later).
        """
        if reference.key != expected_key:
            raise InvalidResultReference(f"the reference names {reference.key!r}, not this attempt's {expected_key!r}")
        if reference.size > max_bytes:
            raise ResultTooLarge(f"the result is {reference.size} bytes, more than maxResultBytes {max_bytes}")
        stat = self.store.stat(expected_key)
        if stat is None:
            raise ResultObjectMissing(f"no object {expected_key} in the store (the upload did not finish)")
        if stat.size != reference.size:
            raise ResultObjectMismatch(
                f"object {expected_key} is {stat.size} bytes, its reference says {reference.size}"
            )
        read, digest = (stat.size, stat.sha256) if stat.sha256 is not None else self._read_back(expected_key, reference)
        if read != reference.size or digest != reference.sha256:
            raise ResultObjectMismatch(
                f"object {expected_key} ({read} bytes, SHA-256 {digest}) is not the one its "
                f"reference names ({reference.size} bytes, SHA-256 {reference.sha256})"
            )
        return reference

    def _read_back(self, key: str, reference: ResultReference) -> tuple[int, str]:
        """(bytes read, their SHA-256) of the object, read whole (a size other than the
        reference's is refused before a byte is read)."""
        opened = self.store.open(key)
        if opened is None:
            raise ResultObjectMissing(f"no object {key} in the store (the upload did not finish)")
        digest = hashlib.sha256()
        read = 0
        with closing(opened):
            if opened.size != reference.size:
                raise ResultObjectMismatch(f"object {key} is {opened.size} bytes, its reference says {reference.size}")
            for chunk in opened.chunks:
                digest.update(chunk)
                read += len(chunk)
        return read, digest.hexdigest()

    def read(self, reference: ResultReference) -> Iterator[bytes]:
        """The result's bytes, streamed. Raises: ResultObjectMissing, ObjectStoreUnavailable."""
        return self.store.read(reference.key)

    def read_url(self, reference: ResultReference, expires_s: int | None = None) -> str:
        return self.store.read_url(reference.key, expires_s or self.read_url_s)

    def delete(self, reference: ResultReference) -> None:
        self.store.delete(reference.key)


_CACHE: dict[int, tuple[Settings, Artifacts | None]] = {}
_BUILDING = threading.Lock()  # releases run in threads, and boto3 builds clients unsafely in parallel


def for_settings(settings: Settings) -> Artifacts | None:
    """The process's `Artifacts` for these settings (built once per settings object); None
    without an object store."""
    cached = _CACHE.get(id(settings))
    if cached is None or cached[0] is not settings:
        with _BUILDING:
            cached = _CACHE.get(id(settings))
            if cached is None or cached[0] is not settings:
                cached = (settings, Artifacts.from_settings(settings))
                _CACHE[id(settings)] = cached
    return cached[1]


def upload_expiry_s(spec: CapabilitySpec, slack_s: int) -> int:
    """How long an attempt's upload URL must live: longer than the Job can run before its
    container exits (queue, start and run clocks of the capability) plus `slack_s`; SigV4's
    seven days at most (a capability without a deadline gets those)."""
    if spec.active_deadline_seconds is None:
        return MAX_PRESIGN_S
    total = spec.active_deadline_seconds + spec.start_timeout_seconds + slack_s
    if spec.queue is not None:  # the deadline counts from the Job's admission
        total += spec.queue_timeout_seconds if spec.queue_timeout_seconds is not None else MAX_PRESIGN_S
    return min(total, MAX_PRESIGN_S)


def result_upload(
    artifacts: Artifacts | None, spec: CapabilitySpec, *, dispatch_id: str, attempt: int
) -> ResultUpload | None:
    """What `workers.manifest.build_job(..., result_upload=...)` takes for this attempt: its key
    and a presigned PUT URL; None for a capability whose results are termination messages.
    Signing is local (no request to the store).

    Raises:
        ConfigError: the capability's results go to an object store and none is configured.
    """
    if not spec.results_in_object_store:
        return None
    if artifacts is None:
        raise ConfigError(f"capability {spec.name!r} has results: objectStore, but no object store is configured")
    key = artifacts.key(dispatch_id, attempt)
    return ResultUpload(key=key, url=artifacts.store.upload_url(key, upload_expiry_s(spec, artifacts.url_slack_s)))


def verify_for_delivery(
    artifacts: Artifacts | None,
    spec: CapabilitySpec,
    *,
    dispatch_id: str,
    attempt: int,
    output: Any,
) -> tuple[EventType, dict[str, Any]]:
    """The terminal event to record for a succeeded Job whose capability stores its results:
    WORKER_COMPLETED with the verified reference as output, or WORKER_FAILED with the reason
    (InvalidResultReference, ResultTooLarge, ResultObjectMissing, ResultObjectMismatch) and a
    message. `output` is the termination message's JSON (`Completion.output`); `attempt` the
    Job's attempt annotation. Reads the store, writes nothing anywhere.

    Raises:
        ObjectStoreUnavailable: the store cannot be asked now: record nothing, try again later.
    """
    try:
        if artifacts is None:
            raise ConfigError(f"capability {spec.name!r} has results: objectStore, but no object store is configured")
        reference = parse_reference(output)
        verified = artifacts.verify(
            reference, expected_key=artifacts.key(dispatch_id, attempt), max_bytes=spec.max_result_bytes
        )
    except Permanent as e:
        return EventType.WORKER_FAILED, {"reason": e.reason, "message": str(e)}
    return EventType.WORKER_COMPLETED, {"output": verified.to_output()}
