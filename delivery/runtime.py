"""Everything a delivery needs, built once per process and ready at construction.

A `Runtime` holds the settings, the capability resolver (its file loaded and validated now),
the database engine and sessions, Redis, the Kubernetes client, the guard and the engine
notifier. It knows nothing of Celery: the tasks layer injects the notifier that sends the
engine's Celery task; tests inject their own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import redis
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from k8s_dispatch.core.settings import Settings
from k8s_dispatch.delivery.guard import Guard
from k8s_dispatch.delivery.metrics import METRICS
from k8s_dispatch.delivery.stats import Stats
from k8s_dispatch.store.db import make_engine, make_sessionmaker
from k8s_dispatch.workers.kube import KubeClient
from k8s_dispatch.workers.resolver import CapabilityResolver

log = logging.getLogger(__name__)

Notifier = Callable[[str], None]  # called with a dispatch id after its terminal event commits
Ended = Callable[[Sequence[str]], None]  # called with dispatch ids after their terminal events commit
Failed = Callable[[str, str, str], None]  # dispatch id, reason, message: after a WORKER_FAILED commits

REDIS_TIMEOUT_S = 5.0  # connect and per-command: a Redis that hangs is unavailable, not slow


@dataclass
class Runtime:
    settings: Settings
    resolver: CapabilityResolver
    engine: Engine
    sessions: sessionmaker[Session]
    redis: redis.Redis
    kube: KubeClient
    guard: Guard
    stats: Stats
    # None: this process cannot reach the engine; terminal dispatches stay "unnotified" and
    # the sweep of a process that can notifies them.
    notifier: Notifier | None = None
    # Told of every dispatch that ended (its slot free); the tasks layer runs admission on it.
    on_ended: Ended | None = None
    # Told of every dispatch that failed, to show it where operators look (the tasks layer: Flower).
    # Must not raise: the failure is recorded already.
    on_failed: Failed | None = None
    _closed: bool = field(default=False, repr=False)

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        *,
        notifier: Notifier | None = None,
        on_ended: Ended | None = None,
        resolver: CapabilityResolver | None = None,
        kube: KubeClient | None = None,
    ) -> Runtime:
        """Build everything now; `resolver`/`kube` replace the ones the settings describe.

        Raises:
            ConfigError: the capability file or the Kubernetes config is invalid (naming the
                file, capability and field).
        """
        resolver = resolver if resolver is not None else CapabilityResolver.from_settings(settings)
        if resolver.default_namespace is None:  # so that scheduling with it records every namespace
            resolver = resolver.with_default_namespace(settings.namespace)
        kube = kube if kube is not None else KubeClient.from_settings(settings, on_request=METRICS.api_request)
        engine = make_engine(settings.database_url)
        client = redis.Redis.from_url(
            settings.redis_url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S
        )
        return cls(
            settings=settings,
            resolver=resolver,
            engine=engine,
            sessions=make_sessionmaker(engine),
            redis=client,
            kube=kube,
            guard=Guard(client, prefix=settings.key_prefix, lease_ms=settings.guard_lease_ms),
            stats=Stats(client, prefix=settings.key_prefix),
            notifier=notifier,
            on_ended=on_ended,
        )

    def namespace_for(self, capability: str) -> str:
        """Where a capability's new dispatches' Jobs go (a dispatch's own is fixed when it is
        scheduled: `DispatchRecord.job_namespace`). Raises: UnknownCapability."""
        return self.resolver.namespace_for(capability) or self.settings.namespace

    def namespaces(self) -> list[str]:
        """Every namespace our Jobs may be in, sorted: what poll and sweep list."""
        return sorted(self.resolver.namespaces(self.settings.namespace) | {self.settings.namespace})

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.kube.close()
        self.redis.close()
        self.engine.dispose()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
