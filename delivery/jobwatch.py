"""Poll's watch: each poll reads only what changed since the previous one, and hands off the finished Jobs.

A Job watch cut into bounded slices (kopf's `continuous_watch`, client-go's reflector), its
position kept between polls in Redis, per namespace: the `resourceVersion` reached, the
finished Jobs not yet delivered (what a LIST poll would find finished again, so they are handed
off again if their message is lost, and renewed while a backlog waits) and the running maps'
Jobs (handed off by every poll: their items end as their Pods do, which changes no Job). The
state is written only after the hand-off, by compare-and-set on the version read, together with
the note of the Jobs that left undelivered (one script: neither is written without the other): of two
overlapping polls one stores, the other's write is dropped, and what both handed off was
deduplicated by the hand-off markers. Without a version (first poll, Redis flushed), on 410 Gone
or a broken watch: the old paginated LIST, and the watch starts again from that LIST's version.
The watch's stream itself may stay open from one poll to the next (`hold`:
`KubeClient.watch_jobs`), and is read again only from the very version stored. A poll of many
namespaces reads their watches side by side (`poll_namespaces`): their slices wait for quiet
together, and the positions are read and stored in one round trip each. A kept stream's reader
may ring a doorbell (`ring`) when it receives what a poll would hand off (`rings`), so that a
poll can run at once instead of at the next interval (`tasks.prompt_poll`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import partial
from typing import Any, cast

import orjson
import redis

from k8s_dispatch.core.errors import ApiUnavailable, DispatchError
from k8s_dispatch.delivery.complete import job_snapshot
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers import pod_health
from k8s_dispatch.workers.indexed import is_map_job
from k8s_dispatch.workers.job_status import job_state
from k8s_dispatch.workers.kube import Hold, KubeClient
from k8s_dispatch.workers.manifest import FINALIZER

log = logging.getLogger(__name__)

JsonDict = dict[str, Any]
HandOff = Callable[[list[JsonDict]], int]  # finished Jobs (as read) -> how many were handed off now
HandOffIn = Callable[[str, list[JsonDict]], int]  # the same, for the namespace named first
Ring = Callable[[str], object]  # a kept stream of the namespace named received something to hand off

# A slice of the watch reads for at most this share of the poll interval, and never past
# WATCH_BOUND_MAX_S: what it leaves unread the next poll reads.
WATCH_BOUND_SHARE = 0.15
WATCH_BOUND_MAX_S = 0.3
# The poll's watch of a namespace is healthy (the sweep may skip its LIST) while a poll has
# stored a version within this many poll intervals.
HEALTHY_INTERVALS = 3
# A stream kept between polls is dropped after this many poll intervals without a poll reading it.
HOLD_IDLE_INTERVALS = 2
# A kept stream lives between this share of the hold and all of it, by its namespace: streams
# opened by one poll end spread out, not all in one later poll (each new one waits for quiet).
HOLD_SPREAD = 0.5
# How many namespaces' watches (or LISTs) a poll reads at once. A slice mostly waits (for quiet,
# for the server): side by side, 300 namespaces' kept streams are read in a few slices' time.
WATCH_CONCURRENCY = 256
_RV = b"rv"
_JOB = "j:"
_UNSTARTED = "u:"
_MAP = "m:"


class Step(Enum):
    """What one watch event means for delivery."""

    KEEP = "keep"  # finished, not yet delivered: hand it off (again, once its marker expires)
    FORGET = "forget"  # running (or running again under its name): nothing to hand off
    DELIVERED = "delivered"  # left our selector labelled delivered: its completion is recorded
    GONE = "gone"  # deleted, or relabelled, without being delivered: the sweep's to look at
    ADVANCE = "advance"  # a bookmark: only the version moves


def decide(event: Mapping[str, Any]) -> Step:
    """The step for one watch event (pure). DELETED is also how a watch with a label selector
    says an object stopped matching it: labelled delivered by its completion, or otherwise.
    kube-apiserver's event then carries the version before the change, so there a delivered Job
    is GONE too, and the sweep finds its dispatch ended (one database read, and the namespace's
    delivered Jobs LISTed once for any our finalizer still holds). So is a Job labelled delivered
    with our finalizer on: our release takes it off in the same patch, so that was a hand."""
    kind = event.get("type")
    job = event.get("object") or {}
    if kind == "BOOKMARK":
        return Step.ADVANCE
    if kind == "DELETED":
        metadata = job.get("metadata") or {}
        released = FINALIZER not in (metadata.get("finalizers") or [])
        return Step.DELIVERED if released and job_labels.is_delivered(metadata.get("labels")) else Step.GONE
    return Step.KEEP if job_state(job).terminal else Step.FORGET


def _running_map(job: Mapping[str, Any]) -> bool:
    """A map's Indexed Job that runs: handed off by every poll and on each change seen (its items
    are delivered as their Pods finish, `delivery.items`, and a Pod's end changes no Job)."""
    return is_map_job(job) and not job_state(job).terminal


def rings(event: Mapping[str, Any]) -> bool:
    """Whether a poll reading `event` would hand something off (pure): a Job finished and not
    delivered, or a running map's Job that changed (an item ended)."""
    return decide(event) is Step.KEEP or (event.get("type") != "DELETED" and _running_map(event.get("object") or {}))


@dataclass
class Position:
    """Where a namespace's watch stands: the version reached (None: never, or lost), the
    finished Jobs not yet delivered, the running Jobs with no container started yet (what the
    sweep's start checks read), and the running maps' Jobs (`_running_map`), by name, as last
    read (`complete.job_snapshot`)."""

    version: str | None = None
    finished: dict[str, JsonDict] = field(default_factory=dict)
    unstarted: dict[str, JsonDict] = field(default_factory=dict)
    maps: dict[str, JsonDict] = field(default_factory=dict)


@dataclass
class Applied:
    """A slice's events applied to a position (pure result)."""

    position: Position
    gone: list[JsonDict] = field(default_factory=list)  # Jobs that left without delivery
    events: int = 0


def apply(position: Position, events: Sequence[Mapping[str, Any]]) -> Applied:
    """The position after `events`, in order (pure): the version of the last, the finished set
    updated by each event's step."""
    finished, unstarted, maps = dict(position.finished), dict(position.unstarted), dict(position.maps)
    version = position.version
    gone: list[JsonDict] = []
    for event in events:
        job = event.get("object") or {}
        metadata = job.get("metadata") or {}
        version = str(metadata.get("resourceVersion") or version or "") or None
        step = decide(event)
        name = str(metadata.get("name", ""))
        if step is Step.ADVANCE:
            continue
        unstarted.pop(name, None)
        maps.pop(name, None)
        if step is Step.KEEP:
            finished[name] = job_snapshot(job)
            continue
        finished.pop(name, None)
        if step is Step.FORGET and pod_health.unstarted(job):
            unstarted[name] = job_snapshot(job)
        if step is Step.GONE:
            gone.append(job_snapshot(job))
        if step is Step.FORGET and _running_map(job):
            maps[name] = job_snapshot(job)
    return Applied(Position(version, finished, unstarted, maps), gone=gone, events=len(events))


def bound_s(poll_interval_s: float) -> float:
    """How long one slice of the watch may read, for a poll every `poll_interval_s` (pure)."""
    return min(WATCH_BOUND_MAX_S, WATCH_BOUND_SHARE * poll_interval_s)


def hold(
    hold_s: float, poll_interval_s: float, namespace: str = "", *, ring: Ring | None = None, spread: bool = True
) -> Hold | None:
    """How a poll's watch stream of `namespace` is kept for the next poll (pure): at most
    `hold_s` in all (None: not kept), less by a share of HOLD_SPREAD fixed by the namespace's
    name (with `spread`); dropped once HOLD_IDLE_INTERVALS poll intervals pass without a poll
    reading it (the next poll ran elsewhere, or not at all). With `ring`, the stream's reader
    calls `ring(namespace)` for each event a poll would hand off (`rings`)."""
    if hold_s <= 0:
        return None
    share = (zlib.crc32(namespace.encode()) % 1000) / 1000 if namespace and spread else 0.0
    on_event = None if ring is None else partial(_ring_if, ring, namespace)
    return Hold(
        lifetime_s=hold_s * (1 - HOLD_SPREAD * share), idle_s=HOLD_IDLE_INTERVALS * poll_interval_s, on_event=on_event
    )


def _ring_if(ring: Ring, namespace: str, event: Mapping[str, Any]) -> None:
    if rings(event):
        ring(namespace)


# --- the position in Redis ------------------------------------------------------------------


def key(prefix: str, deployment: str, namespace: str) -> str:
    """The namespace's position (a hash: the version and the finished Jobs) (pure)."""
    return f"{prefix}:watch:{deployment}:{namespace}"


def healthy_key(name: str) -> str:
    """The key that is there while poll keeps the position `name` up to date (pure)."""
    return f"{name}:healthy"


def listed_key(name: str) -> str:
    """The key that is there while the sweep's last LIST of the namespace (position `name`)
    stands for its Jobs (`recovery.sweep`); a poll that had to LIST removes it (pure)."""
    return f"{name}:sweep-listed"


def load(client: redis.Redis, name: str) -> Position:
    """The stored position (an empty one when none is stored)."""
    return load_many(client, [name])[0]


def load_many(client: redis.Redis, names: Sequence[str]) -> list[Position]:
    """The stored positions of `names`, in order, in one round trip."""
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(name)
    return [_position(raw) for raw in pipe.execute()]


def _position(raw: dict[bytes, bytes]) -> Position:
    if _RV not in raw:
        return Position()
    fields = {k.decode(): v for k, v in raw.items()}
    finished = {k[len(_JOB) :]: orjson.loads(v) for k, v in fields.items() if k.startswith(_JOB)}
    unstarted = {k[len(_UNSTARTED) :]: orjson.loads(v) for k, v in fields.items() if k.startswith(_UNSTARTED)}
    maps = {k[len(_MAP) :]: orjson.loads(v) for k, v in fields.items() if k.startswith(_MAP)}
    return Position(raw[_RV].decode(), finished, unstarted, maps)


# Compare-and-set of one position, with its gone note and its healthy mark, in one script (atomic,
# and one round trip for any number of namespaces in a pipeline). KEYS: the position, its healthy
# key, its gone set. ARGV: the version expected ("" when none is stored, else "=" and the
# version), the healthy mark's ms, "1" when the position changed (else only the mark is set), how
# many gone ids follow, the ids, then the position's field/value pairs. 1 if stored, 0 if not.
_STORE = """
local current = redis.call('HGET', KEYS[1], 'rv')
if (current == false and ARGV[1] ~= '') or (current ~= false and ARGV[1] ~= '=' .. current) then
    return 0
end
local gone = tonumber(ARGV[4])
for i = 5, 4 + gone do
    redis.call('SADD', KEYS[3], ARGV[i])
end
if ARGV[3] == '1' then
    redis.call('DEL', KEYS[1])
    for i = 5 + gone, #ARGV, 2 do
        redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
    end
end
redis.call('SET', KEYS[2], '1', 'PX', ARGV[2])
return 1
"""

# `_STORE` of positions that did not change and noted nothing, many in one call: each one's
# healthy mark, if its version is still the one expected. KEYS: position, healthy key, in pairs;
# ARGV: the mark's ms, then the versions expected, as `_STORE`'s. A 1 or 0 for each pair.
_MARK = """
local out = {}
for j = 1, #KEYS / 2 do
    local current = redis.call('HGET', KEYS[2 * j - 1], 'rv')
    local expected = ARGV[j + 1]
    if (current == false and expected == '') or (current ~= false and expected == '=' .. current) then
        redis.call('SET', KEYS[2 * j], '1', 'PX', ARGV[1])
        out[j] = 1
    else
        out[j] = 0
    end
end
return out
"""


@dataclass(frozen=True)
class Write:
    """One namespace's store: its position, if the stored version is still `expected`, with the
    Jobs that left undelivered (noted for the sweep); `changed` False writes only the healthy mark."""

    name: str
    expected: str | None
    position: Position
    gone: Sequence[Mapping[str, Any]] = ()
    changed: bool = True


def store(
    client: redis.Redis,
    name: str,
    *,
    expected: str | None,
    position: Position,
    healthy_ms: int,
    gone: Sequence[Mapping[str, Any]] = (),
) -> bool:
    """Store `position` if the stored version is still `expected` (compare-and-set), and note
    `gone` with it; False when another poll stored one in between (then this one's is dropped:
    that poll read the same events or later ones, and noted what left). Marks the namespace's
    watch healthy for `healthy_ms`."""
    return store_many(client, [Write(name, expected, position, gone)], healthy_ms=healthy_ms)[0]


def store_many(client: redis.Redis, writes: Sequence[Write], *, healthy_ms: int) -> list[bool]:
    """`store` for each of `writes`, in one round trip (each write atomic on its own); whether
    each was stored, in order.

    Raises:
        redis.RedisError: Redis is unavailable (any of the writes may have been made).
    """
    if not writes:
        return []
    script = client.register_script(_STORE)
    pipe = client.pipeline(transaction=False)
    # The many unchanged positions of an idle poll: one script call marks them all healthy.
    idle = [i for i, w in enumerate(writes) if not w.changed and not w.gone]
    if idle:
        keys = [k for i in idle for k in (writes[i].name, healthy_key(writes[i].name))]
        expected = [_expected(writes[i].expected) for i in idle]
        client.register_script(_MARK)(keys=keys, args=[healthy_ms, *expected], client=pipe)
    for w in (w for w in writes if w.changed or w.gone):
        ids = _gone_ids(w.gone)
        args: list[bytes | str | int] = [_expected(w.expected), healthy_ms]
        args += ["1" if w.changed else "0", len(ids), *ids]
        if w.changed:
            args += [_RV.decode(), (w.position.version or "").encode()]
            for n, job in w.position.finished.items():
                args += [_JOB + n, orjson.dumps(job)]
            for n, job in w.position.unstarted.items():
                args += [_UNSTARTED + n, orjson.dumps(job)]
            for n, job in w.position.maps.items():
                args += [_MAP + n, orjson.dumps(job)]
        script(keys=[w.name, healthy_key(w.name), gone_key(w.name)], args=args, client=pipe)
    replies = pipe.execute()
    marked = iter(replies[0] if idle else [])
    stored = iter(replies[1:] if idle else replies)
    return [bool(next(marked) if not w.changed and not w.gone else next(stored)) for w in writes]


def _expected(version: str | None) -> str:
    """A version expected, as the scripts compare it: "" for none stored (pure)."""
    return "" if version is None else "=" + version


def ahead(stored: str | None, listed: str) -> bool:
    """Whether a position stored before a LIST is ahead of that LIST's version (pure): the cluster's
    store was restored from a backup, or replaced, under the same Redis. kube-apiserver then
    holds a watch from the stored version open without a single event until its own versions
    reach it, and the watch would look healthy while it saw nothing. Versions that are not
    decimal (a server that does not number them as etcd does) are never compared."""
    return stored is not None and stored.isdecimal() and listed.isdecimal() and int(stored) > int(listed)


# Delete a position (and its healthy mark) if it is still at the version expected. KEYS: the
# position, its healthy key. ARGV: the version. 1 if deleted.
_DROP = """
if redis.call('HGET', KEYS[1], 'rv') ~= ARGV[1] then
    return 0
end
redis.call('DEL', KEYS[1], KEYS[2])
return 1
"""


def stored_version(client: redis.Redis, name: str) -> str | None:
    """The version of the position `name` (None: none stored), without its Jobs."""
    raw = cast(bytes | None, client.hget(name, _RV))
    return raw.decode() if raw is not None else None


def drop(client: redis.Redis, name: str, version: str) -> bool:
    """Forget the position `name` if it still stands at `version` (compare-and-delete: a poll that
    stored another one since keeps it): the next poll LISTs and resumes from that LIST."""
    return bool(client.register_script(_DROP)(keys=[name, healthy_key(name)], args=[version]))


def is_healthy(client: redis.Redis, prefix: str, deployment: str, namespace: str) -> bool:
    """Whether poll's watch of the namespace stored a position lately (by Redis' clock)."""
    return bool(client.exists(healthy_key(key(prefix, deployment, namespace))))


def gone_key(name: str) -> str:
    return f"{name}:gone"


def _gone_ids(jobs: Sequence[Mapping[str, Any]]) -> list[str]:
    """The dispatches of Jobs that left without being delivered, for the sweep (`gone`) (pure)."""
    return sorted(
        {
            str(labels[job_labels.DISPATCH_ID_KEY])
            for job in jobs
            if job_labels.DISPATCH_ID_KEY in (labels := (job.get("metadata") or {}).get("labels") or {})
        }
    )


def gone(client: redis.Redis, name: str) -> set[str]:
    """The dispatch ids poll noted as gone from the namespace and the sweep has not checked."""
    members = cast(set[bytes], client.smembers(gone_key(name)))
    return {m.decode() for m in members}


def note_gone(client: redis.Redis, name: str, ids: Sequence[str]) -> None:
    """Note dispatches for the sweep to check as if poll had seen their Jobs leave (`gone`)."""
    if ids:
        client.sadd(gone_key(name), *sorted(ids))


def forget_gone(client: redis.Redis, name: str, ids: set[str]) -> None:
    if ids:
        client.srem(gone_key(name), *sorted(ids))


# --- one poll of the namespaces ----------------------------------------------------------


@dataclass
class NamespacePoll:
    """What one poll of a namespace did."""

    listed: bool = False  # went through the LIST (no version, 410, or a broken watch)
    seen: int = 0  # Jobs listed, or watch events read
    finished: list[JsonDict] = field(default_factory=list)  # finished, not yet delivered
    handed_off: int = 0
    gone: list[JsonDict] = field(default_factory=list)
    stored: bool = False  # False: an overlapping poll stored its position first (or it failed)
    position: Position | None = field(default=None, repr=False)  # the position reached, to store


@dataclass
class Polled:
    """What one poll of several namespaces did: each one polled, and each one that failed (an
    unavailable API or Redis: nothing of it stored, the next poll resumes from the same version)."""

    done: dict[str, NamespacePoll] = field(default_factory=dict)
    failed: dict[str, Exception] = field(default_factory=dict)


def poll_namespace(
    kube: KubeClient,
    client: redis.Redis,
    *,
    prefix: str,
    deployment: str,
    namespace: str,
    page_size: int,
    poll_interval_s: float,
    hand_off: HandOff,
    hold_s: float = 0.0,
    ring: Ring | None = None,
) -> NamespacePoll:
    """Resume the namespace's watch (or LIST), hand off its finished Jobs, then store the position
    (`poll_namespaces` of one namespace).

    Raises:
        DispatchError: the API (the LIST) is unavailable (Transient) or refused it: nothing is
            stored, the next poll resumes from the same version.
        redis.RedisError: Redis is unavailable (the same).
    """
    polled = poll_namespaces(
        kube, client, prefix=prefix, deployment=deployment, namespaces=[namespace], page_size=page_size,
        poll_interval_s=poll_interval_s, hand_off=lambda _ns, jobs: hand_off(jobs), hold_s=hold_s, ring=ring,
    )  # fmt: skip
    if namespace in polled.failed:
        raise polled.failed[namespace]
    return polled.done[namespace]


def poll_namespaces(
    kube: KubeClient,
    client: redis.Redis,
    *,
    prefix: str,
    deployment: str,
    namespaces: Sequence[str],
    page_size: int,
    poll_interval_s: float,
    hand_off: HandOffIn,
    hold_s: float = 0.0,
    waiting: Callable[[], object] | None = None,
    ring: Ring | None = None,
) -> Polled:
    """Resume each namespace's watch (or LIST), hand off its finished Jobs, then store the
    positions. The positions are read in one round trip and stored in one; the namespaces'
    watches are read side by side, WATCH_CONCURRENCY at a time, so that their slices' waits for
    quiet overlap. With `hold_s`, each watch's stream is kept for the next poll (`hold`), and
    rings `ring` when it receives what a poll would hand off. `waiting` is called about every
    poll interval while the slices run (a lease's renewal).

    A namespace's own failure (its API unavailable or refusing, its hand-off's Redis) fails
    that namespace alone (`Polled.failed`): the others' positions are stored.

    Raises:
        redis.RedisError: Redis is unavailable when the positions are read or stored.
    """
    names = [key(prefix, deployment, namespace) for namespace in namespaces]
    befores = dict(zip(namespaces, load_many(client, names), strict=True))
    selector = job_labels.undelivered_selector(deployment)
    polled = Polled()

    def one(namespace: str) -> NamespacePoll:
        return _advance(
            kube, namespace, befores[namespace], selector=selector, page_size=page_size,
            poll_interval_s=poll_interval_s, hand_off=lambda jobs: hand_off(namespace, jobs),
            keep=hold(hold_s, poll_interval_s, namespace, ring=ring, spread=len(namespaces) > 1),
        )  # fmt: skip

    if len(namespaces) == 1:  # nothing to wait for side by side: this thread reads it
        try:
            polled.done[namespaces[0]] = one(namespaces[0])
        except (DispatchError, redis.RedisError) as e:
            polled.failed[namespaces[0]] = e
    else:
        futures = {_executor().submit(one, namespace): namespace for namespace in namespaces}
        pending = set(futures)
        while pending:
            _, pending = concurrent.futures.wait(pending, timeout=max(0.1, poll_interval_s))
            if pending and waiting is not None:
                waiting()
        for future, namespace in futures.items():
            try:
                polled.done[namespace] = future.result()
            except (DispatchError, redis.RedisError) as e:
                polled.failed[namespace] = e
    for namespace, out in polled.done.items():
        for job in out.gone:
            meta = job.get("metadata") or {}
            # A finished one is, as a rule, one we delivered: kube-apiserver's event for an object
            # leaving the selector carries its previous version, without the delivered label
            # (localcluster's, the new one). Its dispatch is checked all the same (in the database).
            level = logging.DEBUG if job_state(job).terminal else logging.INFO
            log.log(level, "poll: job %s/%s left without being labelled delivered; the sweep checks its dispatch",
                    namespace, meta.get("name"))  # fmt: skip
    healthy_ms = max(1, int(HEALTHY_INTERVALS * poll_interval_s * 1000))
    done = list(polled.done.items())
    writes = [
        Write(name=key(prefix, deployment, namespace), expected=befores[namespace].version,
              position=cast(Position, out.position), gone=out.gone, changed=out.listed or out.seen > 0)
        for namespace, out in done
    ]  # fmt: skip
    for (namespace, out), stored in zip(done, store_many(client, writes, healthy_ms=healthy_ms), strict=True):
        out.stored = stored
        if not stored:
            log.info("poll: another poll of jobs in %s stored its position first; this one's is dropped", namespace)
    # A LIST means the watch had a gap (no position, 410, a broken stream): a Job that left in it
    # undelivered was never noted gone, so the sweep's next pass LISTs the namespace too.
    gaps = [listed_key(key(prefix, deployment, namespace)) for namespace, out in done if out.listed]
    if gaps:
        client.delete(*gaps)
    return polled


def _advance(
    kube: KubeClient,
    namespace: str,
    before: Position,
    *,
    selector: str,
    page_size: int,
    poll_interval_s: float,
    hand_off: HandOff,
    keep: Hold | None,
) -> NamespacePoll:
    """One namespace's watch slice from `before` (or its LIST), its finished Jobs handed off; the
    position reached is in the result, not yet stored. `keep`: how its stream is kept (`hold`).

    Raises:
        DispatchError: the API (the LIST) is unavailable (Transient) or refused it.
        redis.RedisError: the hand-off's Redis is unavailable.
    """
    out = NamespacePoll()
    if before.version is not None:
        try:
            watched = kube.watch_jobs(
                namespace,
                label_selector=selector,
                resource_version=before.version,
                bound_s=bound_s(poll_interval_s),
                hold=keep,
            )
        except ApiUnavailable as e:
            log.info("poll: the watch of jobs in %s failed (%s); listing them", namespace, e)
        else:
            if watched.expired:
                log.info("poll: version %s of jobs in %s is too old (410); listing them", before.version, namespace)
            else:
                applied = apply(before, watched.events)
                out.position, out.seen, out.gone = applied.position, applied.events, applied.gone
                out.finished = list(applied.position.finished.values())
                out.handed_off = hand_off(out.finished + list(applied.position.maps.values()))
                return out
    out.listed = True
    out.position = _relist(kube, namespace, selector=selector, page_size=page_size, hand_off=hand_off, out=out)
    return out


_executor_lock = threading.Lock()
_executor_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    """The process's threads for the namespaces' watches (made on first use: after a fork)."""
    global _executor_pool
    with _executor_lock:
        if _executor_pool is None:
            _executor_pool = concurrent.futures.ThreadPoolExecutor(WATCH_CONCURRENCY, thread_name_prefix="poll-watch")
        return _executor_pool


def _relist(
    kube: KubeClient, namespace: str, *, selector: str, page_size: int, hand_off: HandOff, out: NamespacePoll
) -> Position:
    """Today's paginated LIST, each page's finished Jobs handed off as it comes; the position at
    the LIST's version (its first page's: every page is of that snapshot)."""
    version: str | None = None
    finished: dict[str, JsonDict] = {}
    unstarted: dict[str, JsonDict] = {}
    maps: dict[str, JsonDict] = {}
    token: str | None = None
    while True:
        page = kube.list_jobs_page(namespace, label_selector=selector, limit=page_size, continue_token=token)
        if version is None:
            version = str((page.get("metadata") or {}).get("resourceVersion") or "") or None
        items = page.get("items") or []
        out.seen += len(items)
        done = [job for job in items if job_state(job).terminal]
        out.finished += done
        running_maps = [job for job in items if _running_map(job)]
        out.handed_off += hand_off(done + running_maps)
        finished.update({_name(job): job_snapshot(job) for job in done})
        unstarted.update({_name(job): job_snapshot(job) for job in items if pod_health.unstarted(job)})
        maps.update({_name(job): job_snapshot(job) for job in running_maps})
        token = (page.get("metadata") or {}).get("continue") or None
        if token is None:
            return Position(version, finished, unstarted, maps)


def _name(job: Mapping[str, Any]) -> str:
    return str((job.get("metadata") or {}).get("name", ""))
