"""Where each attempt's result lives (pure): `PREFIX/DISPATCH_ID/ATTEMPT/result`; a dispatch's
input too large for its Job's env: `PREFIX/DISPATCH_ID/input` (the same bytes for every attempt);
an archived container log: `PREFIX/DISPATCH_ID/ATTEMPT/logs/POD_NAME` (one per Pod, since an
attempt's Job may run several: pod retries, evictions; re-archiving a Pod writes the same key); a
map's packed item inputs: `PREFIX/DISPATCH_ID/items/ROOT`, named by their Merkle root
(`container.packing`), so a Job made again for its open items only gets an object of its own,
and a create repeated for the same items finds its object there, never one changed under a
running Job.

The dispatch id first, so every object of a dispatch is listed together and the cleanup can
decide per dispatch; the attempt next, so a re-created Job never writes over the object of the
attempt before it, whose bytes might be the ones recorded."""

from __future__ import annotations

import re

from k8s_dispatch.core.ids import is_dispatch_id

RESULT_NAME = "result"
INPUT_NAME = "input"
LOGS_NAME = "logs"
ITEMS_NAME = "items"
_ROOT = re.compile(r"^[0-9a-f]{64}$")


def result_key(prefix: str, dispatch_id: str, attempt: int) -> str:
    return f"{prefix}/{dispatch_id}/{attempt}/{RESULT_NAME}"


def input_key(prefix: str, dispatch_id: str) -> str:
    return f"{prefix}/{dispatch_id}/{INPUT_NAME}"


def items_key(prefix: str, dispatch_id: str, root: str) -> str:
    return f"{prefix}/{dispatch_id}/{ITEMS_NAME}/{root}"


def is_items_key(prefix: str, key: str) -> bool:
    """Whether `key` is a map's packed item inputs (`items_key`) under `prefix`."""
    head = prefix + "/"
    parts = key[len(head) :].split("/") if key.startswith(head) else []
    return len(parts) == 3 and parts[1] == ITEMS_NAME and bool(_ROOT.match(parts[2])) and is_dispatch_id(parts[0])


def log_key(prefix: str, dispatch_id: str, attempt: int, pod: str) -> str:
    return f"{prefix}/{dispatch_id}/{attempt}/{LOGS_NAME}/{pod}"


def parse_log_key(prefix: str, key: str) -> tuple[str, int, str] | None:
    """(dispatch id, attempt, Pod name) of a log key under `prefix`; None for any other key."""
    head = prefix + "/"
    parts = key[len(head) :].split("/") if key.startswith(head) else []
    if len(parts) != 4 or parts[2] != LOGS_NAME or not parts[3] or not is_dispatch_id(parts[0]):
        return None
    if not parts[1].isdigit() or parts[1] != str(int(parts[1])):
        return None
    return parts[0], int(parts[1]), parts[3]


def dispatch_of(prefix: str, key: str) -> str | None:
    """The dispatch id of a result, input, items or log key under `prefix`; None for any other key."""
    result = parse_key(prefix, key) or parse_log_key(prefix, key)
    if result is not None:
        return result[0]
    head = prefix + "/"
    parts = key[len(head) :].split("/") if key.startswith(head) else []
    if len(parts) == 2 and parts[1] == INPUT_NAME and is_dispatch_id(parts[0]):
        return parts[0]
    if is_items_key(prefix, key):
        return parts[0]
    return None


def dispatch_prefix(prefix: str, dispatch_id: str) -> str:
    return f"{prefix}/{dispatch_id}/"


def parse_key(prefix: str, key: str) -> tuple[str, int] | None:
    """(dispatch id, attempt) of a result key under `prefix`; None for any other key."""
    head = prefix + "/"
    if not key.startswith(head):
        return None
    parts = key[len(head) :].split("/")
    if len(parts) != 3 or parts[2] != RESULT_NAME or not is_dispatch_id(parts[0]) or not parts[1].isdigit():
        return None
    if parts[1] != str(int(parts[1])):  # one spelling per attempt: "01" is not attempt 1's key
        return None
    return parts[0], int(parts[1])
