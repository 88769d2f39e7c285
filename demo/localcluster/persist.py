"""`--state`: the store on disk, as etcd would keep it. A snapshot of every object and the
resourceVersion counter is written atomically (temp file + rename, in a worker thread) at most
`debounce` seconds after a change, and once more on shutdown; `load` reads it back.

Format: JSON lines; the first holds {"format", "resourceVersion"}, each other one object.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

from k8s_dispatch.demo.localcluster.resources import BY_PLURAL, Resource
from k8s_dispatch.demo.localcluster.store import Event, Store

FORMAT = "demo/localcluster/v1"


class StateError(Exception):
    """The state file exists but cannot be read."""


def snapshot_bytes(store: Store) -> bytes:
    header = json.dumps({"format": FORMAT, "resourceVersion": store.rv}).encode()
    lines = [header]
    for entry in store.all_entries():
        lines.append(b'{"resource":"' + entry.resource.plural.encode() + b'","object":' + entry.raw + b"}")
    return b"\n".join(lines) + b"\n"


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def load(path: Path) -> tuple[int, list[tuple[Resource, dict[str, Any]]]]:
    """(resourceVersion, objects) from a state file; (0, []) when it does not exist."""
    if not path.exists():
        return 0, []
    try:
        lines = path.read_bytes().splitlines()
        header: dict[str, Any] = json.loads(lines[0]) if lines else {"format": FORMAT, "resourceVersion": 0}
        if header.get("format") != FORMAT:
            raise StateError(f"{path}: not a localcluster state file")
        objects = []
        for line in lines[1:]:
            if line.strip():
                item = json.loads(line)
                objects.append((BY_PLURAL[item["resource"]], item["object"]))
        return int(header["resourceVersion"]), objects
    except (ValueError, KeyError, IndexError) as e:
        raise StateError(f"{path}: unreadable state file: {e}") from e


class Persister:
    def __init__(self, store: Store, path: Path, *, loop: asyncio.AbstractEventLoop, debounce: float = 0.1) -> None:
        self.store = store
        self.path = Path(path)
        self._loop = loop
        self._debounce = debounce
        self._timer: asyncio.TimerHandle | None = None
        self._writing: asyncio.Future[None] | None = None
        self._dirty = False
        self.writes = 0
        store.subscribe(self._on_event)

    def _on_event(self, event: Event) -> None:
        self._dirty = True
        if self._timer is None and self._writing is None:
            self._timer = self._loop.call_later(self._debounce, self._flush)

    def _flush(self) -> None:
        self._timer = None
        if not self._dirty or self._writing is not None:
            return
        self._dirty = False
        data = snapshot_bytes(self.store)
        self._writing = self._loop.run_in_executor(None, write_atomic, self.path, data)
        self._writing.add_done_callback(self._written)

    def _written(self, fut: asyncio.Future[None]) -> None:
        self._writing = None
        self.writes += 1
        fut.result()
        if self._dirty and self._timer is None:
            self._timer = self._loop.call_later(self._debounce, self._flush)

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._writing is not None:
            await self._writing
        write_atomic(self.path, snapshot_bytes(self.store))
        self.writes += 1
