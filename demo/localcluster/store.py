"""The object store, as etcd plus the watch cache are to the API server: every object version is
an immutable `Entry` with a cluster-wide increasing resourceVersion, serialised to bytes at most
once; every write appends an event to a bounded log that watches replay from; a watch from a
resourceVersion older than the log answers 410 Gone.

Writes are synchronous (one event loop owns the store); listeners are told of each event and must
not write back synchronously (they schedule their work).
"""

from __future__ import annotations

import asyncio
import bisect
import builtins
import contextlib
import json
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

from k8s_dispatch.demo.localcluster.resources import Resource

Key = tuple[str, str]  # (namespace, name); namespace "" for cluster-scoped objects
ADDED, MODIFIED, DELETED = "ADDED", "MODIFIED", "DELETED"


def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON. orjson: serialising objects is a large part of a busy server's work."""
    try:
        return orjson.dumps(obj)
    except TypeError:  # what orjson refuses (integers past 64 bits, keys that are not strings)
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


loads = orjson.loads


@dataclass(eq=False, slots=True)
class Entry:
    """One version of one object. `obj` is never mutated once stored."""

    resource: Resource
    namespace: str
    name: str
    obj: dict[str, Any]
    rv: int
    _raw: bytes | None = None

    @property
    def raw(self) -> bytes:
        if self._raw is None:
            self._raw = dumps(self.obj)
        return self._raw

    @property
    def meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = self.obj["metadata"]
        return meta

    @property
    def uid(self) -> str:
        uid: str = self.obj["metadata"].get("uid", "")
        return uid

    def thaw(self) -> dict[str, Any]:
        """A deep, mutable copy of the object."""
        obj: dict[str, Any] = loads(self.raw)
        return obj


@dataclass(eq=False, slots=True)
class Event:
    type: str
    entry: Entry
    old: Entry | None = None

    @property
    def rv(self) -> int:
        return self.entry.rv


def _at_version(entry: Entry, rv: int) -> Entry:
    """`entry`'s object as it was, stamped with resourceVersion `rv` (a watch cache's DELETED for
    an object that stopped matching: its previous content, the event's version)."""
    obj = {**entry.obj, "metadata": {**entry.obj["metadata"], "resourceVersion": str(rv)}}
    return Entry(entry.resource, entry.namespace, entry.name, obj, rv)


class Gone(Exception):
    """The requested resourceVersion is older than the oldest event kept."""


class Watcher:
    """One watch stream's queue of events for one resource, filtered by namespace and a predicate."""

    def __init__(
        self, resource: Resource, namespace: str | None, predicate: Callable[[Entry], bool], *, max_queue: int
    ) -> None:
        self.resource = resource
        self.namespace = namespace
        self.predicate = predicate
        self.max_queue = max_queue
        self.queue: deque[tuple[str, Entry]] = deque()
        self.closed = False
        self.overflowed = False
        # Set by `Store.break_watches`: the watch sends it as an ERROR event after what it queued.
        self.error: dict[str, Any] | None = None
        self._wakeup = asyncio.Event()

    def offer(self, event: Event) -> None:
        if self.closed:
            return
        entry = event.entry
        if self.namespace is not None and entry.namespace != self.namespace:
            return
        now = self.predicate(entry)
        if event.type == MODIFIED and event.old is not None:
            before = self.predicate(event.old)
            kind = MODIFIED if before and now else ADDED if now else DELETED if before else None
            if kind == DELETED:  # left the selector: kube-apiserver sends what matched, at this version
                entry = _at_version(event.old, entry.rv)
        elif event.type == DELETED:
            kind = DELETED if now or (event.old is not None and self.predicate(event.old)) else None
        else:
            kind = event.type if now else None
        if kind is None:
            return
        if len(self.queue) >= self.max_queue:
            self.overflowed = True
            self.close()
            return
        self.queue.append((kind, entry))
        self._wakeup.set()

    def close(self) -> None:
        self.closed = True
        self._wakeup.set()

    async def wait(self, timeout: float) -> None:
        """Wait until there is something in the queue, the watcher closes or the timeout passes."""
        if self.queue or self.closed:
            return
        self._wakeup.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wakeup.wait(), timeout)


@dataclass
class _Table:
    """One resource's objects, their keys kept in order (a LIST reads a namespace's range, and a
    busy server writes between LISTs: sorting per LIST, or scanning every namespace, costs what
    the real server's cache does not), and how many each namespace holds (the Job quota)."""

    objects: dict[Key, Entry] = field(default_factory=dict)
    sorted_keys: list[Key] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, key: Key, entry: Entry) -> None:
        self.objects[key] = entry
        bisect.insort(self.sorted_keys, key)
        self.counts[key[0]] = self.counts.get(key[0], 0) + 1

    def discard(self, key: Key) -> None:
        del self.objects[key]
        del self.sorted_keys[bisect.bisect_left(self.sorted_keys, key)]
        self.counts[key[0]] -= 1

    def namespace_keys(self, namespace: str) -> list[Key]:
        """The keys of `namespace`, in order: (namespace,) sorts before all of them and
        (namespace + NUL,) after all of them and before any other namespace's."""
        keys = self.sorted_keys
        return keys[bisect.bisect_left(keys, (namespace,)) : bisect.bisect_left(keys, (namespace + "\0",))]


class Store:
    def __init__(self, *, event_log_size: int = 200_000, watch_queue_max: int = 500_000) -> None:
        self.rv = 0
        self.compacted_rv = 0
        self._tables: dict[str, _Table] = {}
        self._owned: dict[str, set[tuple[str, str, str]]] = {}
        self._log: deque[Event] = deque()
        self._log_size = event_log_size
        self._watchers: dict[str, set[Watcher]] = {}
        self._listeners: list[Callable[[Event], None]] = []
        self._watch_queue_max = watch_queue_max

    # --- reads -----------------------------------------------------------------------

    def _table(self, resource: Resource) -> _Table:
        table = self._tables.get(resource.plural)
        if table is None:
            table = self._tables[resource.plural] = _Table()
        return table

    def get(self, resource: Resource, namespace: str, name: str) -> Entry | None:
        return self._table(resource).objects.get((namespace, name))

    def list(self, resource: Resource, namespace: str | None = None) -> list[Entry]:
        """Entries sorted by (namespace, name), as etcd's key order lists them."""
        table = self._table(resource)
        objects = table.objects
        return [objects[k] for k in (table.sorted_keys if namespace is None else table.namespace_keys(namespace))]

    def count(self, resource: Resource, namespace: str | None = None) -> int:
        table = self._table(resource)
        return len(table.objects) if namespace is None else table.counts.get(namespace, 0)

    def owned_by(self, uid: str) -> builtins.list[tuple[str, str, str]]:  # `list` is the method above
        """(plural, namespace, name) of objects whose ownerReferences name `uid`."""
        return sorted(self._owned.get(uid, ()))

    def all_entries(self) -> Iterable[Entry]:
        for table in self._tables.values():
            yield from table.objects.values()

    # --- writes ----------------------------------------------------------------------

    def _stamp(self, resource: Resource, obj: dict[str, Any]) -> Entry:
        self.rv += 1
        meta = {**obj["metadata"], "resourceVersion": str(self.rv)}
        obj = {**obj, "metadata": meta}
        return Entry(resource, meta.get("namespace", "") if resource.namespaced else "", meta["name"], obj, self.rv)

    def insert(self, resource: Resource, obj: dict[str, Any]) -> Entry:
        """Store a new object; the caller has checked that its key is free."""
        entry = self._stamp(resource, obj)
        table = self._table(resource)
        key = (entry.namespace, entry.name)
        assert key not in table.objects, key
        table.add(key, entry)
        self._index(entry, None)
        self._emit(Event(ADDED, entry))
        return entry

    def replace(self, old: Entry, obj: dict[str, Any]) -> Entry:
        entry = self._stamp(old.resource, obj)
        self._table(old.resource).objects[(old.namespace, old.name)] = entry
        self._index(entry, old)
        self._emit(Event(MODIFIED, entry, old))
        return entry

    def remove(self, old: Entry, final: dict[str, Any] | None = None) -> Entry:
        """Delete an object; the DELETED event carries `final` (default: the last version)."""
        entry = self._stamp(old.resource, final if final is not None else old.obj)
        self._table(old.resource).discard((old.namespace, old.name))
        self._index(None, old)
        self._emit(Event(DELETED, entry, old))
        return entry

    def _index(self, new: Entry | None, old: Entry | None) -> None:
        if new is not None and old is not None and new.meta.get("ownerReferences") is old.meta.get("ownerReferences"):
            return  # unchanged (versions share what they did not change)

        def refs(e: Entry | None) -> set[str]:
            return {r.get("uid", "") for r in (e.meta.get("ownerReferences") or [])} if e else set()

        before, after = refs(old), refs(new)
        if before == after:
            return
        entry = new or old
        assert entry is not None  # with neither, both sides have no references: returned above
        item = entry.resource.plural, entry.namespace, entry.name
        for uid in before - after:
            owned = self._owned.get(uid)
            if owned is not None:
                owned.discard(item)
                if not owned:
                    del self._owned[uid]
        for uid in after - before:
            self._owned.setdefault(uid, set()).add(item)

    def _emit(self, event: Event) -> None:
        if len(self._log) >= self._log_size:
            self.compacted_rv = self._log.popleft().rv
        self._log.append(event)
        for watcher in list(self._watchers.get(event.entry.resource.plural, ())):
            watcher.offer(event)
        for listener in self._listeners:
            listener(event)

    # --- watch -----------------------------------------------------------------------

    def subscribe(self, listener: Callable[[Event], None]) -> None:
        self._listeners.append(listener)

    def events_since(self, rv: int) -> builtins.list[Event]:
        """Events with resourceVersion > rv, oldest first; raises Gone when rv predates the log."""
        if rv < self.compacted_rv:
            raise Gone(rv)
        out = []
        for event in reversed(self._log):
            if event.rv <= rv:
                break
            out.append(event)
        out.reverse()
        return out

    def watch(
        self, resource: Resource, namespace: str | None, predicate: Callable[[Entry], bool], *, since: int | None = None
    ) -> Watcher:
        """A watcher of future events, first fed the logged events after `since` (raises Gone)."""
        watcher = Watcher(resource, namespace, predicate, max_queue=self._watch_queue_max)
        if since is not None:
            for event in self.events_since(since):
                if event.entry.resource is resource:
                    watcher.offer(event)
        self._watchers.setdefault(resource.plural, set()).add(watcher)
        return watcher

    def unwatch(self, watcher: Watcher) -> None:
        watcher.close()
        self._watchers.get(watcher.resource.plural, set()).discard(watcher)

    def break_watches(self, status: dict[str, Any]) -> int:
        """End every open watch with an ERROR event carrying `status` (a Status object), sent
        after the events each has queued, as kube-apiserver does when a watch breaks off with
        an error other than 410 (an etcd or storage failure). How many watches it ended."""
        count = 0
        for watchers in self._watchers.values():
            for watcher in list(watchers):
                if not watcher.closed:
                    watcher.error = status
                    watcher.close()
                    count += 1
        return count

    def close_watchers(self) -> None:
        for watchers in self._watchers.values():
            for watcher in list(watchers):
                watcher.close()

    # --- restore ---------------------------------------------------------------------

    def restore(self, rv: int, objects: Iterable[tuple[Resource, dict[str, Any]]]) -> None:
        """Load a snapshot into an empty store; the event log starts empty at `rv`."""
        for resource, obj in objects:
            meta = obj["metadata"]
            entry = Entry(
                resource,
                meta.get("namespace", "") if resource.namespaced else "",
                meta["name"],
                obj,
                int(meta.get("resourceVersion") or 0),
            )
            self._table(resource).add((entry.namespace, entry.name), entry)
            self._index(entry, None)
        self.rv = rv
        self.compacted_rv = rv
