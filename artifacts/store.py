"""The object store's operations we use, behind one small protocol with two implementations:
`S3Store` (boto3, any S3-compatible endpoint) and `DirectoryStore` (a local folder, the demo's:
no service to run, one machine only).

boto3 because it is the reference S3 client: SigV4 presigning, paginated listing, streaming
bodies, retries with backoff, and the standard credential chain (environment, shared files,
web identity) an operator already knows; with the types-boto3 stubs it is checked by mypy.

An S3 store is asked to hash what it keeps: each presigned PUT names SHA-256 as its checksum
algorithm in its signed query (no header the Pod must send), so a store that supports S3's
additional checksums computes the SHA-256 of the bytes it received and gives it back on a HEAD
(`stat`). Delivery then verifies a result without reading it back; a store that keeps no SHA-256
is read back in full instead (`artifacts.service.Artifacts.verify`).
"""

from __future__ import annotations

import base64
import binascii
import os
import tempfile
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from contextlib import closing
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from k8s_dispatch.artifacts.errors import ObjectStoreUnavailable, ResultObjectMissing

if TYPE_CHECKING:
    from types_boto3_s3 import S3Client

    from k8s_dispatch.core.settings import Settings

CHUNK_BYTES = 1 << 20
MAX_PRESIGN_S = 7 * 24 * 3600  # SigV4's longest-lived presigned URL
_MISSING = frozenset({"404", "NoSuchKey", "NotFound"})
_CHECKSUM_ALGORITHM = "x-amz-sdk-checksum-algorithm"


@dataclass(frozen=True)
class StoredObject:
    key: str
    size: int
    modified: datetime  # the store's clock


@dataclass(frozen=True)
class Stat:
    """An object's size, and the SHA-256 (hex) the store itself computed of its bytes when they
    were written (None: it keeps none for this object)."""

    size: int
    sha256: str | None = None


@dataclass(frozen=True)
class Opened:
    """An object being read: its size as the store gave it before any byte was read, and its
    bytes in chunks; whoever opened it closes it (`contextlib.closing`), read to the end or not."""

    size: int
    chunks: Iterator[bytes]
    close: Callable[[], None]


class ObjectStore(Protocol):
    def upload_url(self, key: str, expires_s: int) -> str: ...
    def read_url(self, key: str, expires_s: int) -> str: ...
    def size(self, key: str) -> int | None:
        """The object's size; None if there is none."""
        ...

    def stat(self, key: str) -> Stat | None:
        """The object's size and the SHA-256 the store computed (one request); None if there is
        none. Raises: ObjectStoreUnavailable."""
        ...

    def read(self, key: str) -> Iterator[bytes]:
        """The object's bytes in chunks. Raises: ResultObjectMissing, ObjectStoreUnavailable."""
        ...

    def open(self, key: str) -> Opened | None:
        """The object opened for reading, its size known before its bytes (one request); None if
        there is none. Raises: ObjectStoreUnavailable."""
        ...

    def put(self, key: str, data: bytes) -> None: ...
    def delete(self, key: str) -> None:
        """Idempotent: deleting what is not there succeeds."""
        ...

    def list(self, prefix: str) -> Iterator[StoredObject]: ...


class S3Store:
    def __init__(self, client: S3Client, bucket: str, *, server_checksums: bool = True) -> None:
        """`server_checksums`: presigned PUTs ask the store for a SHA-256 of what it keeps (module
        docstring); off for a store that refuses the request's checksum parameter."""
        self.client, self.bucket, self.server_checksums = client, bucket, server_checksums
        if server_checksums:
            client.meta.events.register("before-sign.s3.PutObject", _checksum_in_query)

    @classmethod
    def from_settings(cls, settings: Settings) -> S3Store:
        import boto3
        from botocore.config import Config

        access, secret = _credentials(settings)
        client = boto3.client(
            "s3",
            endpoint_url=settings.object_store_endpoint,
            region_name=settings.object_store_region,
            aws_access_key_id=access,
            aws_secret_access_key=secret,
            config=Config(
                signature_version="s3v4",
                s3={"addressing_style": settings.object_store_addressing_style.value},
                connect_timeout=10,
                read_timeout=60,
                retries={"max_attempts": 3, "mode": "standard"},
            ),
        )
        return cls(client, settings.object_store_bucket, server_checksums=settings.object_store_server_checksums)

    def upload_url(self, key: str, expires_s: int) -> str:
        params: dict[str, Any] = {"Bucket": self.bucket, "Key": key}
        if self.server_checksums:
            params["ChecksumAlgorithm"] = "SHA256"  # moved into the signed query (`_checksum_in_query`)
        return self.client.generate_presigned_url("put_object", Params=params, ExpiresIn=min(expires_s, MAX_PRESIGN_S))

    def read_url(self, key: str, expires_s: int) -> str:
        return self.client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": key}, ExpiresIn=min(expires_s, MAX_PRESIGN_S)
        )

    def size(self, key: str) -> int | None:
        stat = self.stat(key)
        return None if stat is None else stat.size

    def stat(self, key: str) -> Stat | None:
        with _translated(key, missing_ok=True):
            head = self.client.head_object(Bucket=self.bucket, Key=key, ChecksumMode="ENABLED")
            return Stat(head["ContentLength"], stored_sha256(head))
        return None  # the object is not there

    def read(self, key: str) -> Iterator[bytes]:
        return _read(self, key)

    def open(self, key: str) -> Opened | None:
        with _translated(key, missing_ok=True):
            response = self.client.get_object(Bucket=self.bucket, Key=key)
            body = response["Body"]
            return Opened(response["ContentLength"], _s3_chunks(key, body), body.close)
        return None  # the object is not there

    def put(self, key: str, data: bytes) -> None:
        with _translated(key):
            self.client.put_object(Bucket=self.bucket, Key=key, Body=data)

    def delete(self, key: str) -> None:
        with _translated(key):
            self.client.delete_object(Bucket=self.bucket, Key=key)

    def list(self, prefix: str) -> Iterator[StoredObject]:
        with _translated(prefix):
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                for item in page.get("Contents", []):
                    yield StoredObject(item["Key"], item["Size"], item["LastModified"])


class DirectoryStore:
    """Objects as files under `root/bucket/`; "presigned" URLs are file:// URLs, which only a
    process on this machine (the demo's exec-mode runner) can use."""

    def __init__(self, root: Path, bucket: str) -> None:
        self.base = root / bucket

    def _path(self, key: str) -> Path:
        path = (self.base / key).resolve()
        if self.base.resolve() not in path.parents:
            raise ValueError(f"key {key!r} leaves the store")
        return path

    def upload_url(self, key: str, expires_s: int) -> str:
        return self._path(key).as_uri()

    def read_url(self, key: str, expires_s: int) -> str:
        return self._path(key).as_uri()

    def size(self, key: str) -> int | None:
        stat = self.stat(key)
        return None if stat is None else stat.size

    def stat(self, key: str) -> Stat | None:
        """A file's size; no SHA-256 (a folder keeps none): verified by reading it."""
        try:
            return Stat(self._path(key).stat().st_size)
        except FileNotFoundError:
            return None

    def read(self, key: str) -> Iterator[bytes]:
        return _read(self, key)

    def open(self, key: str) -> Opened | None:
        try:
            f = self._path(key).open("rb")
        except FileNotFoundError:
            return None
        return Opened(os.fstat(f.fileno()).st_size, iter(lambda: f.read(CHUNK_BYTES), b""), f.close)

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".upload-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def list(self, prefix: str) -> Iterator[StoredObject]:
        if not self.base.is_dir():
            return
        for path in sorted(self.base.rglob("*")):
            key = path.relative_to(self.base).as_posix()
            if path.is_file() and key.startswith(prefix) and not path.name.startswith(".upload-"):
                stat = path.stat()
                yield StoredObject(key, stat.st_size, datetime.fromtimestamp(stat.st_mtime, UTC))


def stored_sha256(head: Mapping[str, Any]) -> str | None:
    """The SHA-256 (hex) of the whole object from a HEAD's answer (pure): None when the store kept
    none, or one of another kind (a multipart upload's checksum of its parts' checksums), or one
    that is not a SHA-256 at all."""
    value, kind = head.get("ChecksumSHA256"), head.get("ChecksumType", "FULL_OBJECT")
    if not isinstance(value, str) or kind != "FULL_OBJECT":
        return None
    try:
        digest = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None
    return digest.hex() if len(digest) == 32 else None


def _checksum_in_query(request: Any, signature_version: str, **_: Any) -> None:
    """botocore's `before-sign` hook: a presigned PUT's checksum algorithm goes into its query,
    signed with it, rather than a header the runner would have to send (a runner of an older
    release, not sending it, would be refused). A normal request is left as it is."""
    algorithm = request.headers.get(_CHECKSUM_ALGORITHM)
    if algorithm is None or not signature_version.endswith("-query"):
        return
    del request.headers[_CHECKSUM_ALGORITHM]
    request.url += ("&" if "?" in request.url else "?") + urllib.parse.urlencode({_CHECKSUM_ALGORITHM: algorithm})


def _read(store: ObjectStore, key: str) -> Iterator[bytes]:
    """`ObjectStore.read` by way of `open`, its body closed however the reading ends."""
    opened = store.open(key)
    if opened is None:
        raise ResultObjectMissing(f"object store: no object {key}")
    with closing(opened):
        yield from opened.chunks


def _s3_chunks(key: str, body: Any) -> Iterator[bytes]:
    with _translated(key):
        yield from body.iter_chunks(CHUNK_BYTES)


def open_store(settings: Settings) -> ObjectStore | None:
    """The store the settings describe; None without an endpoint."""
    endpoint = settings.object_store_endpoint
    if endpoint is None:
        return None
    if endpoint.startswith("file://"):
        return DirectoryStore(
            Path(urllib.parse.unquote(urllib.parse.urlsplit(endpoint).path)), settings.object_store_bucket
        )
    return S3Store.from_settings(settings)


def _credentials(settings: Settings) -> tuple[str | None, str | None]:
    if settings.object_store_access_key is not None and settings.object_store_secret_key is not None:
        return settings.object_store_access_key.get_secret_value(), settings.object_store_secret_key.get_secret_value()
    folder = settings.object_store_credentials_dir
    if folder is not None:  # a mounted Secret: read at start, as its files are then
        return (folder / "access-key").read_text().strip(), (folder / "secret-key").read_text().strip()
    return None, None  # boto3's own chain


class _translated:
    """Maps botocore's exceptions to ours: a missing object is `missing` (if allowed), anything
    else that is the store's fault or unreachable is ObjectStoreUnavailable."""

    def __init__(self, key: str, *, missing_ok: bool = False) -> None:
        self.key, self.missing_ok = key, missing_ok

    def __enter__(self) -> bool:
        return False

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: object) -> bool:
        if error is None:
            return False
        from botocore.exceptions import BotoCoreError, ClientError

        if isinstance(error, ClientError):
            code = str(error.response.get("Error", {}).get("Code", ""))
            if code in _MISSING:
                if self.missing_ok:
                    return True  # swallowed: the caller returns None
                raise ResultObjectMissing(f"object store: no object {self.key}") from error
            raise ObjectStoreUnavailable(f"object store: {self.key}: {code}: {error}") from error
        if isinstance(error, (BotoCoreError, OSError)):
            raise ObjectStoreUnavailable(f"object store unreachable: {self.key}: {error}") from error
        return False
