"""Poll's watch: each poll reads only what changed since the previous one, and hands off the finished Jobs.

A Job watch cut into bounded slices (kopf's `continuous_watch`, client-go's reflector), its
position kept between polls in Redis, per namespace: the `resourceVersion` reached and the
finished Jobs not yet delivered (what a LIST poll would find finished again, so they are handed
off again if their message is lost, and renewed while a backlog waits). The state is written
only after the hand-off, by compare-and-set on the version read: of two overlapping polls one
stores, the other's write is dropped, and what both handed off was deduplicated by the hand-off
markers. Without a version (first poll, Redis flushed), on 410 Gone or a broken watch: the old
paginated LIST, and the watch starts again from that LIST's version. The watch's stream itself
may stay open from one poll to the next (`hold`: `KubeClient.watch_jobs`), and is read again only
from the very version stored.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, cast

import orjson
import redis

from k8s_dispatch.engine.errors import ApiUnavailable
from k8s_dispatch.recovery import delivery
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers import pod_health
from k8s_dispatch.workers.job_status import job_state
from k8s_dispatch.workers.kube import Hold, KubeClient

log = logging.getLogger(__name__)

JsonDict = dict[str, Any]
HandOff = Callable[[list[JsonDict]], int]  # finished Jobs (as read) -> how many were handed off now

# A slice of the watch reads for at most this share of the poll interval, and never past
# WATCH_BOUND_MAX_S: what it leaves unread the next poll reads.
WATCH_BOUND_SHARE = 0.15
WATCH_BOUND_MAX_S = 0.3
# The poll's watch of a namespace is healthy (the sweep may skip its LIST) while a poll has
# stored a version within this many poll intervals.
HEALTHY_INTERVALS = 3
# A stream kept between polls is dropped after this many poll intervals without a poll reading it.
HOLD_IDLE_INTERVALS = 2
_RV = b"rv"
_JOB = "j:"
_UNSTARTED = "u:"


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
    is GONE too, and the sweep finds its dispatch ended (one database read, no request)."""
    kind = event.get("type")
    job = event.get("object") or {}
    if kind == "BOOKMARK":
        return Step.ADVANCE
    if kind == "DELETED":
        return Step.DELIVERED if job_labels.is_delivered((job.get("metadata") or {}).get("labels")) else Step.GONE
    return Step.KEEP if job_state(job).terminal else Step.FORGET


@dataclass
class Position:
    """Where a namespace's watch stands: the version reached (None: never, or lost), the
    finished Jobs not yet delivered, and the running Jobs with no container started yet (what
    the sweep's start checks read), by name, as last read (`delivery.job_snapshot`)."""

    version: str | None = None
    finished: dict[str, JsonDict] = field(default_factory=dict)
    unstarted: dict[str, JsonDict] = field(default_factory=dict)


@dataclass
class Applied:
    """A slice's events applied to a position (pure result)."""

    position: Position
    gone: list[JsonDict] = field(default_factory=list)  # Jobs that left without delivery
    events: int = 0


def apply(position: Position, events: Sequence[Mapping[str, Any]]) -> Applied:
    """The position after `events`, in order (pure): the version of the last, the finished set
    updated by each event's step."""
    finished, unstarted = dict(position.finished), dict(position.unstarted)
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
        if step is Step.KEEP:
            finished[name] = delivery.job_snapshot(job)
            continue
        finished.pop(name, None)
        if step is Step.FORGET and pod_health.unstarted(job):
            unstarted[name] = delivery.job_snapshot(job)
        if step is Step.GONE:
            gone.append(delivery.job_snapshot(job))
    return Applied(Position(version, finished, unstarted), gone=gone, events=len(events))


def bound_s(poll_interval_s: float) -> float:
    """How long one slice of the watch may read, for a poll every `poll_interval_s` (pure)."""
    return min(WATCH_BOUND_MAX_S, WATCH_BOUND_SHARE * poll_interval_s)


def hold(hold_s: float, poll_interval_s: float) -> Hold | None:
    """How a poll's watch stream is kept for the next poll (pure): `hold_s` in all (None: not
    kept), and dropped once HOLD_IDLE_INTERVALS poll intervals pass without a poll reading it
    (the next poll ran elsewhere, or not at all)."""
    return Hold(lifetime_s=hold_s, idle_s=HOLD_IDLE_INTERVALS * poll_interval_s) if hold_s > 0 else None


# --- the position in Redis ------------------------------------------------------------------


def key(prefix: str, deployment: str, namespace: str) -> str:
    """The namespace's position (a hash: the version and the finished Jobs) (pure)."""
    return f"{prefix}:watch:{deployment}:{namespace}"


def healthy_key(name: str) -> str:
    """The key that is there while poll keeps the position `name` up to date (pure)."""
    return f"{name}:healthy"


def load(client: redis.Redis, name: str) -> Position:
    """The stored position (an empty one when none is stored)."""
    raw: dict[bytes, bytes] = client.hgetall(name)  # type: ignore[assignment]  # redis' sync stubs return Any | Awaitable
    if _RV not in raw:
        return Position()
    fields = {k.decode(): v for k, v in raw.items()}
    finished = {k[len(_JOB) :]: orjson.loads(v) for k, v in fields.items() if k.startswith(_JOB)}
    unstarted = {k[len(_UNSTARTED) :]: orjson.loads(v) for k, v in fields.items() if k.startswith(_UNSTARTED)}
    return Position(raw[_RV].decode(), finished, unstarted)


def store(client: redis.Redis, name: str, *, expected: str | None, position: Position, healthy_ms: int) -> bool:
    """Store `position` if the stored version is still `expected` (compare-and-set under WATCH);
    False when another poll stored one in between (then this one's is dropped: that poll read
    the same events or later ones). Marks the namespace's watch healthy for `healthy_ms`."""
    with client.pipeline(transaction=True) as pipe:
        try:
            pipe.watch(name)  # type: ignore[no-untyped-call]  # redis' stubs leave it unannotated
            current = cast(bytes | None, pipe.hget(name, _RV))
            if (current.decode() if current else None) != expected:
                pipe.unwatch()
                return False
            pipe.multi()
            pipe.delete(name)
            mapping: dict[str, bytes] = {_RV.decode(): (position.version or "").encode()}
            mapping.update({_JOB + n: orjson.dumps(job) for n, job in position.finished.items()})
            mapping.update({_UNSTARTED + n: orjson.dumps(job) for n, job in position.unstarted.items()})
            pipe.hset(name, mapping=mapping)  # type: ignore[arg-type]  # bytes values are fine
            pipe.set(healthy_key(name), 1, px=healthy_ms)
            pipe.execute()
        except redis.WatchError:
            return False
    return True


def is_healthy(client: redis.Redis, prefix: str, deployment: str, namespace: str) -> bool:
    """Whether poll's watch of the namespace stored a position lately (by Redis' clock)."""
    return bool(client.exists(healthy_key(key(prefix, deployment, namespace))))


def gone_key(name: str) -> str:
    return f"{name}:gone"


def note_gone(client: redis.Redis, name: str, jobs: Sequence[Mapping[str, Any]]) -> None:
    """Note the dispatches of Jobs that left without being delivered, for the sweep (`gone`)."""
    ids = {
        str(labels[job_labels.DISPATCH_ID_KEY])
        for job in jobs
        if job_labels.DISPATCH_ID_KEY in (labels := (job.get("metadata") or {}).get("labels") or {})
    }
    if ids:
        client.sadd(gone_key(name), *sorted(ids))


def gone(client: redis.Redis, name: str) -> set[str]:
    """The dispatch ids poll noted as gone from the namespace and the sweep has not checked."""
    members = cast(set[bytes], client.smembers(gone_key(name)))
    return {m.decode() for m in members}


def forget_gone(client: redis.Redis, name: str, ids: set[str]) -> None:
    if ids:
        client.srem(gone_key(name), *sorted(ids))


# --- one poll of one namespace ------------------------------------------------------------


@dataclass
class NamespacePoll:
    """What one poll of a namespace did."""

    listed: bool = False  # went through the LIST (no version, 410, or a broken watch)
    seen: int = 0  # Jobs listed, or watch events read
    finished: list[JsonDict] = field(default_factory=list)  # finished, not yet delivered
    handed_off: int = 0
    gone: list[JsonDict] = field(default_factory=list)
    stored: bool = False  # False: an overlapping poll stored its position first


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
) -> NamespacePoll:
    """Resume the namespace's watch (or LIST), hand off its finished Jobs, then store the position.
    With `hold_s`, the watch's stream is kept for the next poll for that long (`hold`).

    Raises:
        Transient: the API (the LIST) is unavailable: nothing is stored, the next poll resumes
            from the same version.
        redis.RedisError: Redis is unavailable (the same).
    """
    name = key(prefix, deployment, namespace)
    selector = job_labels.undelivered_selector(deployment)
    before = load(client, name)
    out = NamespacePoll()
    position: Position | None = None
    if before.version is not None:
        try:
            watched = kube.watch_jobs(
                namespace,
                label_selector=selector,
                resource_version=before.version,
                bound_s=bound_s(poll_interval_s),
                hold=hold(hold_s, poll_interval_s),
            )
        except ApiUnavailable as e:
            log.info("poll: the watch of jobs in %s failed (%s); listing them", namespace, e)
        else:
            if watched.expired:
                log.info("poll: version %s of jobs in %s is too old (410); listing them", before.version, namespace)
            else:
                applied = apply(before, watched.events)
                position, out.seen, out.gone = applied.position, applied.events, applied.gone
                out.finished = list(position.finished.values())
                out.handed_off = hand_off(out.finished)
    if position is None:
        out.listed = True
        position = _relist(kube, namespace, selector=selector, page_size=page_size, hand_off=hand_off, out=out)
    for job in out.gone:
        meta = job.get("metadata") or {}
        # A finished one is, as a rule, one we delivered: kube-apiserver's event for an object
        # leaving the selector carries its previous version, without the delivered label
        # (localcluster's, the new one). Its dispatch is checked all the same (in the database).
        level = logging.DEBUG if job_state(job).terminal else logging.INFO
        log.log(level, "poll: job %s/%s left without being labelled delivered; the sweep checks its dispatch",
                namespace, meta.get("name"))  # fmt: skip
    healthy_ms = max(1, int(HEALTHY_INTERVALS * poll_interval_s * 1000))
    out.stored = store(client, name, expected=before.version, position=position, healthy_ms=healthy_ms)
    if out.stored:
        note_gone(client, name, out.gone)
    else:
        log.info("poll: another poll of jobs in %s stored its position first; this one's is dropped", namespace)
    return out


def _relist(
    kube: KubeClient, namespace: str, *, selector: str, page_size: int, hand_off: HandOff, out: NamespacePoll
) -> Position:
    """Today's paginated LIST, each page's finished Jobs handed off as it comes; the position at
    the LIST's version (its first page's: every page is of that snapshot)."""
    version: str | None = None
    finished: dict[str, JsonDict] = {}
    unstarted: dict[str, JsonDict] = {}
    token: str | None = None
    while True:
        page = kube.list_jobs_page(namespace, label_selector=selector, limit=page_size, continue_token=token)
        if version is None:
            version = str((page.get("metadata") or {}).get("resourceVersion") or "") or None
        items = page.get("items") or []
        out.seen += len(items)
        done = [job for job in items if job_state(job).terminal]
        out.finished += done
        out.handed_off += hand_off(done)
        finished.update({_name(job): delivery.job_snapshot(job) for job in done})
        unstarted.update({_name(job): delivery.job_snapshot(job) for job in items if pod_health.unstarted(job)})
        token = (page.get("metadata") or {}).get("continue") or None
        if token is None:
            return Position(version, finished, unstarted)


def _name(job: Mapping[str, Any]) -> str:
    return str((job.get("metadata") or {}).get("name", ""))
