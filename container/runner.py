"""The worker-side runner a Job's container runs: `python -m k8s_dispatch.container.runner MODULE:FUNCTION`.

Reads the input JSON from `K8S_DISPATCH_INPUT`, calls `FUNCTION(input)` and writes its JSON
result (at most 4 KiB) to `TERMINATION_MESSAGE_PATH` (default /dev/termination-log), exit 0.
On any failure it writes nothing there and exits non-zero with the reason on stderr, which
`terminationMessagePolicy: FallbackToLogsOnError` then shows as the termination message.

With `K8S_DISPATCH_RESULT_URL` set (a capability whose results go to the object store), the
result (bytes as they are, a `pathlib.Path` the function wrote as that file's bytes, anything
else as canonical JSON; of any size) is PUT to that URL, read once and hashed as it is sent; the
termination message is then only the reference (key, size, SHA-256) that delivery verifies the
object against (the store's own SHA-256 of what it kept, or a read back: bytes damaged on the way
end in a failure, never in a record). The standard library only: the Pod needs neither boto3 nor
credentials.

With `K8S_DISPATCH_INPUT_URL` set (an input larger than the env carries), the input is read from
that URL and checked against `K8S_DISPATCH_INPUT_REF` (size and SHA-256) before the function is
called: bytes that are not the ones scheduled end the run with `InputObjectMismatch` as the first
word of the termination message, never a run on them. A map's Pod with `K8S_DISPATCH_ITEMS_URL`
set reads only its own item of the map's packed object (`container.packing`): its entry, then
its record, with ranged GETs, checked against the Merkle root in `K8S_DISPATCH_ITEMS_REF`, the
same two reasons for a failure. A secret input arrives in
`K8S_DISPATCH_INPUT` from the Job's own Secret, as any input; the runner never prints an input.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import json
import os
import sys
import tempfile
import traceback
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from k8s_dispatch.container import packing
from k8s_dispatch.container.contract import (
    INPUT_ENV,
    INPUT_MISMATCH,
    INPUT_REF_ENV,
    INPUT_UNREADABLE,
    INPUT_URL_ENV,
    ITEMS_FIELD,
    ITEMS_REF_ENV,
    ITEMS_URL_ENV,
    MAX_RESULT_BYTES,
    REFERENCE_FIELD,
    RESULT_KEY_ENV,
    RESULT_URL_ENV,
    TERMINATION_MESSAGE_PATH,
    encode_input,
    result_reference,
)
from k8s_dispatch.core.errors import InputNotSerialisable
from k8s_dispatch.core.payloads import canonical_json

TERMINATION_PATH_ENV = "TERMINATION_MESSAGE_PATH"
USAGE = "usage: python -m k8s_dispatch.container.runner MODULE:FUNCTION"

EXIT_OK = 0
EXIT_FAILED = 1  # the function raised, or its result cannot be written
EXIT_USAGE = 2  # bad arguments, missing/invalid input, or the function cannot be loaded


class RunnerError(Exception):
    """A failure the runner reports in one line, with its exit code; one with a `reason` is also
    the termination message (`REASON: message`), so delivery shows it whatever the log holds."""

    def __init__(self, message: str, exit_code: int, *, reason: str | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.reason = reason


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


# A map's Pod (an Indexed Job's, `workers.indexed`): its items' inputs as one JSON array, and the
# index the Job controller gave this Pod; the function is called with its own item's input only.
ITEMS_ENV = "K8S_DISPATCH_ITEMS"
INDEX_ENV = "JOB_COMPLETION_INDEX"


def read_input(environ: Mapping[str, str]) -> Any:
    """Raises: RunnerError: the variable is missing or not JSON (a map's: no item at the index)."""
    if ITEMS_URL_ENV in environ:  # a map's inputs in the object store: this Pod's item only
        try:
            index = int(environ.get(INDEX_ENV, ""))
        except ValueError as e:
            raise RunnerError(f"{INDEX_ENV} is not valid: {e}", EXIT_USAGE) from e
        data = download_item(environ[ITEMS_URL_ENV], environ.get(ITEMS_REF_ENV, ""), index)
        try:
            return json.loads(data.decode("utf-8"))
        except ValueError as e:
            raise RunnerError(f"the stored item {index} is not JSON: {e}", EXIT_USAGE) from e
    if ITEMS_ENV in environ:
        return _read_item(environ)
    url = environ.get(INPUT_URL_ENV)
    if url:  # an input larger than the env carries: checked against its reference first
        data = download_input(url, environ.get(INPUT_REF_ENV, ""))
        try:
            return json.loads(data.decode("utf-8"))
        except ValueError as e:
            raise RunnerError(f"the stored input is not JSON: {e}", EXIT_USAGE) from e
    text = environ.get(INPUT_ENV)
    if text is None:
        raise RunnerError(f"{INPUT_ENV} is not set", EXIT_USAGE)
    try:
        return json.loads(text)
    except ValueError as e:
        # json's message quotes no input, only where it failed: a secret input stays unprinted.
        raise RunnerError(f"{INPUT_ENV} is not JSON: {e}", EXIT_USAGE) from e


def _input_reference(text: str) -> tuple[str, int, str]:
    """(key, size, sha256) of `K8S_DISPATCH_INPUT_REF`. Raises: RunnerError."""
    try:
        body = json.loads(text)[REFERENCE_FIELD]
        key, size, sha256 = body["key"], body["size"], body["sha256"]
    except (ValueError, TypeError, KeyError) as e:
        raise RunnerError(f"{INPUT_REF_ENV} is not an object reference: {e!r}", EXIT_USAGE) from e
    if not isinstance(key, str) or isinstance(size, bool) or not isinstance(size, int) or not isinstance(sha256, str):
        raise RunnerError(f"{INPUT_REF_ENV} is not an object reference", EXIT_USAGE)
    return key, size, sha256


def download_input(url: str, reference: str) -> bytes:
    """The stored input's bytes, once their size and SHA-256 are the reference's. At most one
    byte past the size the reference names is read: a larger object is refused, not loaded.

    Raises:
        RunnerError: reason InputObjectMismatch (other bytes), InputObjectUnreadable (the store
            refused the read, or stayed unreachable).
    """
    key, size, sha256 = _input_reference(reference)
    data = _get(url, key, size + 1)
    digest = hashlib.sha256(data[: size + 1]).hexdigest()
    if len(data) != size or digest != sha256:
        read = f"more than {size}" if len(data) > size else str(len(data))
        raise RunnerError(
            f"the input object {key} ({read} bytes, SHA-256 {digest}) is not the one its reference names "
            f"({size} bytes, SHA-256 {sha256}); the function was not called",
            EXIT_USAGE,
            reason=INPUT_MISMATCH,
        )
    return data


def _get(url: str, key: str, limit: int, *, first: int | None = None) -> bytes:
    """At most `limit` bytes of the object at `url`, from its byte `first` with a ranged GET
    (None: from its start, no Range). Fewer when the object ends sooner (a range it does not
    reach, HTTP 416: none). A reset, a timeout or a 5xx is tried again, a 4xx is not.

    Raises:
        RunnerError: reason InputObjectUnreadable (refused, or unreachable UPLOAD_ATTEMPTS times).
    """
    parts = urllib.parse.urlsplit(url)
    if first is not None and parts.scheme == "file":  # the demo's directory store: urllib ranges no file
        try:
            with open(urllib.parse.unquote(parts.path), "rb") as f:
                f.seek(first)
                return f.read(limit)
        except OSError as e:
            raise RunnerError(f"cannot read the input {key}: {e}", EXIT_USAGE, reason=INPUT_UNREADABLE) from e
    headers = {} if first is None else {"Range": f"bytes={first}-{first + limit - 1}"}
    last = ""
    for _ in range(UPLOAD_ATTEMPTS):
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=UPLOAD_TIMEOUT_S) as r:
                if first is None or r.status == 206:
                    data: bytes = r.read(limit)
                else:  # a store that ignores Range sends the whole object: its start is skipped here
                    data = r.read(first + limit)[first:]
            return data
        except urllib.error.HTTPError as e:
            with e:  # its socket closed here, not by the garbage collector
                text = e.read()[:500].decode("utf-8", "replace")
            if e.code == 416:  # the object ends before the range starts
                return b""
            if e.code < 500:
                raise RunnerError(
                    f"the object store refused the input {key}: HTTP {e.code}: {text}",
                    EXIT_USAGE,
                    reason=INPUT_UNREADABLE,
                ) from e
            last = f"HTTP {e.code}: {text}"
        except OSError as e:  # URLError, a reset, a timeout
            last = f"{type(e).__name__}: {e}"
    raise RunnerError(
        f"cannot read the input {key} ({UPLOAD_ATTEMPTS} tries): {last}", EXIT_USAGE, reason=INPUT_UNREADABLE
    )


def _items_reference(text: str) -> tuple[str, int, int, str]:
    """(key, items, size, root) of `K8S_DISPATCH_ITEMS_REF`. Raises: RunnerError."""
    try:
        body = json.loads(text)[ITEMS_FIELD]
        version, key, count, size, root = body["v"], body["key"], body["items"], body["size"], body["root"]
    except (ValueError, TypeError, KeyError) as e:
        raise RunnerError(f"{ITEMS_REF_ENV} is not a packed items reference: {e!r}", EXIT_USAGE) from e
    numbers = (count, size)
    if version != packing.VERSION or not isinstance(key, str) or not isinstance(root, str):
        raise RunnerError(f"{ITEMS_REF_ENV} is not a version {packing.VERSION} packed items reference", EXIT_USAGE)
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in numbers):
        raise RunnerError(f"{ITEMS_REF_ENV} is not a packed items reference", EXIT_USAGE)
    return key, count, size, root


def download_item(url: str, reference: str, index: int) -> bytes:
    """Item `index`'s canonical JSON from a map's packed object (`container.packing`): its entry,
    then its record, two ranged GETs of a few hundred bytes plus the item, never the whole
    object; the record must hash to the reference's root.

    Raises:
        RunnerError: no such index; reason InputObjectMismatch (the object is not the one packed
            for this Job: other bytes, shorter, an entry pointing elsewhere), InputObjectUnreadable.
    """
    key, count, size, root = _items_reference(reference)
    if not 0 <= index < count:
        raise RunnerError(f"{ITEMS_REF_ENV} has no item {index} (it packs {count})", EXIT_USAGE)
    first, length = packing.entry_range(index)
    entry = _get(url, key, length, first=first)
    start, length = packing.parse_entry(entry) if len(entry) == packing.ENTRY_BYTES else (0, 0)
    item = None
    if length > 0 and start + length <= size:
        item = packing.item_of_record(index, count, _get(url, key, length, first=start), root)
    if item is None:
        raise RunnerError(
            f"item {index} of the input object {key} is not the one packed for this Job (root {root}, "
            f"{size} bytes); the function was not called",
            EXIT_USAGE,
            reason=INPUT_MISMATCH,
        )
    return item


def _read_item(environ: Mapping[str, str]) -> Any:
    try:
        items = json.loads(environ[ITEMS_ENV])
        index = int(environ.get(INDEX_ENV, ""))
    except ValueError as e:
        raise RunnerError(f"{ITEMS_ENV} or {INDEX_ENV} is not valid: {e}", EXIT_USAGE) from e
    if not isinstance(items, list) or not 0 <= index < len(items):
        raise RunnerError(f"{ITEMS_ENV} has no item {index}", EXIT_USAGE)
    return items[index]


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


UPLOAD_TIMEOUT_S = 300.0  # each socket operation of the upload, not the whole transfer
UPLOAD_ATTEMPTS = 3
CHUNK_BYTES = 1 << 20  # a connection reset or a 5xx is tried again; a 4xx (expired URL) is not


def result_bytes(result: Any) -> bytes | Path:
    """What the object holds: bytes as they are, a file the function wrote (a `pathlib.Path`:
    streamed, never read whole into memory), anything else as canonical JSON.

    Raises:
        RunnerError: the result is none of those.
    """
    if isinstance(result, (bytes, bytearray, memoryview)):
        return bytes(result)
    if isinstance(result, Path):
        if not result.is_file():
            raise RunnerError(f"the result names {str(result)!r}, which is not a file", EXIT_FAILED)
        return result
    try:
        return canonical_json(result, what="the result").encode("utf-8")
    except InputNotSerialisable as e:
        raise RunnerError(f"the result of the function is not JSON: {e}", EXIT_FAILED) from e


def _size(source: bytes | Path) -> int:
    """The Content-Length to announce: the bytes', or the file's as it is now."""
    return len(source) if isinstance(source, bytes) else source.stat().st_size


def _open(source: bytes | Path) -> BinaryIO:
    return io.BytesIO(source) if isinstance(source, bytes) else source.open("rb")


class _Sending:
    """The body of one PUT: `source`'s bytes in CHUNK_BYTES pieces (http.client sends an
    iterable's items as they are, a file's in 8 KiB reads), each hashed into the SHA-256 of the
    reference as it goes out. Exactly `size` bytes, the Content-Length announced: a file that
    grew or shrank since ends the upload (`RunnerError`) instead of sending other bytes than
    those announced."""

    def __init__(self, source: bytes | Path, size: int) -> None:
        self.source, self.size = source, size
        self.sha256 = hashlib.sha256()

    def __iter__(self) -> Iterator[bytes]:
        sent = 0
        with _open(self.source) as f:
            while chunk := f.read(min(CHUNK_BYTES, self.size - sent + 1)):
                sent += len(chunk)
                if sent > self.size:
                    break
                self.sha256.update(chunk)
                yield chunk
        if sent != self.size:
            raise RunnerError(f"the result changed while it was uploaded ({self.size} bytes announced)", EXIT_FAILED)


def upload(url: str, source: bytes | Path) -> tuple[int, str]:
    """PUT `source` (bytes, or a file streamed) to the presigned `url`; file:// URLs (the demo's
    directory store): a temporary file renamed into place, so the object appears whole or not at
    all. Returns the size and SHA-256 of what was sent, hashed as it was sent (one read of the
    result). No Content-MD5: it would take a read of its own before the PUT, and delivery
    compares the store's bytes with the SHA-256 anyway.

    Raises:
        RunnerError: the store refused it (an expired URL, a bad signature) or stayed unreachable;
            the result changed while it was sent.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "file":
        path = urllib.parse.unquote(parts.path)
        sha256, size = hashlib.sha256(), 0
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".upload-")
            with os.fdopen(fd, "wb") as out, _open(source) as f:
                while chunk := f.read(CHUNK_BYTES):
                    sha256.update(chunk)
                    size += len(chunk)
                    out.write(chunk)
            os.replace(tmp, path)
        except OSError as e:
            raise RunnerError(f"cannot write the result to {path}: {e}", EXIT_FAILED) from e
        return size, sha256.hexdigest()
    if parts.scheme not in ("http", "https"):
        raise RunnerError(f"{RESULT_URL_ENV} is not an http(s) or file URL", EXIT_USAGE)
    try:
        size = _size(source)
    except OSError as e:
        raise RunnerError(f"cannot read the result: {e}", EXIT_FAILED) from e
    last = ""
    for _ in range(UPLOAD_ATTEMPTS):
        body = _Sending(source, size)  # hashed anew on each try: the SHA-256 of what the store kept
        request = urllib.request.Request(
            url,
            data=body,
            method="PUT",
            headers={
                "Content-Length": str(size),
                "Content-Type": "application/octet-stream",
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=UPLOAD_TIMEOUT_S) as response:
                response.read()
            return size, body.sha256.hexdigest()
        except urllib.error.HTTPError as e:
            with e:  # its socket closed here, not by the garbage collector
                text = e.read()[:500].decode("utf-8", "replace")
            if e.code < 500:
                raise RunnerError(f"the object store refused the result: HTTP {e.code}: {text}", EXIT_FAILED) from e
            last = f"HTTP {e.code}: {text}"
        except OSError as e:  # URLError, a reset, a timeout
            last = f"{type(e).__name__}: {e}"
    raise RunnerError(f"cannot upload the result ({UPLOAD_ATTEMPTS} tries): {last}", EXIT_FAILED)


def run(target: str, environ: Mapping[str, str]) -> int:
    """Run one function as described in the module docstring; returns the exit code."""
    try:
        function = load_function(target)
        value = read_input(environ)
    except RunnerError as e:
        print(f"k8s_dispatch.container.runner: {e}", file=sys.stderr)
        if e.__cause__ is not None:
            traceback.print_exception(e.__cause__, file=sys.stderr)
        if e.reason is not None:
            _write_message(environ, f"{e.reason}: {e}")
        return e.exit_code
    try:
        result = function(value)
    except Exception:
        traceback.print_exc()
        print(f"k8s_dispatch.container.runner: {target} raised; no result written", file=sys.stderr)
        return EXIT_FAILED
    try:
        url = environ.get(RESULT_URL_ENV)
        if url:
            size, sha256 = upload(url, result_bytes(result))
            text = result_reference(key=environ.get(RESULT_KEY_ENV, ""), size=size, sha256=sha256)
        else:
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


def _write_message(environ: Mapping[str, str], text: str) -> None:
    """A typed failure's termination message (best effort: the log says it too)."""
    path = environ.get(TERMINATION_PATH_ENV) or TERMINATION_MESSAGE_PATH
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text[:MAX_RESULT_BYTES])
    except OSError:
        pass


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print(USAGE, file=sys.stderr)
        return EXIT_USAGE
    return run(args[0], os.environ)


if __name__ == "__main__":
    sys.exit(main())
