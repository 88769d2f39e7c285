"""List pagination (`limit` + `continue`) over consistent snapshots: the first page of a list
keeps the filtered result it was cut from; the continue token names that snapshot and an
offset, so later pages show the list as of the first page's resourceVersion. Snapshots expire
(LRU and age); an expired or unknown token answers 410 Expired, as a compacted etcd would.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import json
import time
from collections import OrderedDict
from dataclasses import dataclass

from k8s_dispatch.demo.localcluster import apierrors
from k8s_dispatch.demo.localcluster.store import Entry

EXPIRED_MESSAGE = (
    "The provided continue parameter is too old to display a consistent list result. You can start a new "
    "list without the continue parameter, or use the continue token in this response to retrieve the "
    "remainder of the results. Continuing with the provided token results in an inconsistent list - objects "
    "that were created, modified, or deleted between the time the first chunk was returned and now may show up in the list."
)


@dataclass
class Page:
    items: list[Entry]
    rv: int
    continue_token: str
    remaining: int


@dataclass
class _Snapshot:
    rv: int
    items: list[Entry]
    created: float


class Pager:
    def __init__(self, *, max_snapshots: int = 128, max_age: float = 300.0) -> None:
        self._snapshots: OrderedDict[int, _Snapshot] = OrderedDict()
        self._ids = itertools.count(1)
        self._max = max_snapshots
        self._max_age = max_age

    def first(self, items: list[Entry], rv: int, limit: int | None) -> Page:
        if not limit or limit <= 0 or len(items) <= limit:
            return Page(items, rv, "", 0)
        sid = next(self._ids)
        self._snapshots[sid] = _Snapshot(rv, items, time.monotonic())
        self._trim()
        return self._cut(sid, 0, limit)

    def next(self, token: str, limit: int | None) -> Page:
        sid, rv, offset = _decode(token)
        snap = self._snapshots.get(sid)
        if snap is None or snap.rv != rv or time.monotonic() - snap.created > self._max_age:
            self._snapshots.pop(sid, None)
            raise apierrors.gone(EXPIRED_MESSAGE)
        self._snapshots.move_to_end(sid)
        return self._cut(sid, offset, limit if limit and limit > 0 else len(snap.items))

    def _cut(self, sid: int, offset: int, limit: int) -> Page:
        snap = self._snapshots[sid]
        end = offset + limit
        items = snap.items[offset:end]
        if end >= len(snap.items):
            del self._snapshots[sid]
            return Page(items, snap.rv, "", 0)
        return Page(items, snap.rv, _encode(sid, snap.rv, end), len(snap.items) - end)

    def _trim(self) -> None:
        while len(self._snapshots) > self._max:
            self._snapshots.popitem(last=False)


def _encode(sid: int, rv: int, offset: int) -> str:
    raw = json.dumps({"v": "meta.k8s.io/v1", "rv": rv, "start": f"{sid}:{offset}"}, separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def _decode(token: str) -> tuple[int, int, int]:
    try:
        raw = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        sid, offset = raw["start"].split(":")
        return int(sid), int(raw["rv"]), int(offset)
    except (ValueError, KeyError, TypeError, AttributeError, binascii.Error) as e:
        raise apierrors.bad_request(f"continue key is not valid: {e}") from e
