"""The Runtime the recovery tests build: each module says its K8S_DISPATCH_* with a
`runtime_env` fixture (its cluster, database, namespace, capabilities), and gets `make_runtime`
(more replicas, other settings), `rt` (one, notifying `notified`) and `notified` from here."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from runtimes import Notified

from k8s_dispatch.core.settings import load_settings
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.workers.resolver import CapabilityResolver


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    """A Redis connection of the test's own."""
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


@pytest.fixture
def prefix(key_prefix: str) -> str:
    """A key prefix no other test shares."""
    return f"{key_prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def notified() -> Notified:
    return Notified()


@pytest.fixture
def make_runtime(runtime_env: dict[str, str]) -> Iterator[Callable[..., Runtime]]:
    """`make_runtime(notifier=, resolver= | capabilities=, kubeconfig=, **settings)`: a Runtime
    on the module's environment with `settings` (K8S_DISPATCH_<NAME>) changed; closed at the end."""
    made: list[Runtime] = []

    def make(
        *,
        notifier: Callable[[str], None] | None = None,
        resolver: CapabilityResolver | None = None,
        capabilities: dict[str, Any] | None = None,
        kubeconfig: Path | None = None,
        **overrides: str,
    ) -> Runtime:
        values = {**runtime_env, **{f"K8S_DISPATCH_{k.upper()}": v for k, v in overrides.items()}}
        if kubeconfig is not None:
            values["K8S_DISPATCH_KUBECONFIG"] = str(kubeconfig)
        if capabilities is not None:
            resolver = CapabilityResolver.from_mapping(capabilities, source="<test>")
        rt = Runtime.from_settings(load_settings(values), notifier=notifier, resolver=resolver)
        made.append(rt)
        return rt

    yield make
    for rt in made:
        rt.close()


@pytest.fixture
def rt(make_runtime: Callable[..., Runtime], notified: Notified) -> Runtime:
    return make_runtime(notifier=notified)
