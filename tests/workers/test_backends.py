"""workers/backends.py: workers as two strings, and routing a capability to its backend."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from k8s_dispatch.core.errors import ConfigError, UnknownCapability
from k8s_dispatch.workers.backends import Backend, CompositeBackend, Worker
from k8s_dispatch.workers.resolver import CapabilityResolver, demo_resolver
from tests.workers import strategies as S


@pytest.mark.parametrize(
    ("name", "capabilities", "expected"),
    [
        ("demo-text", "demo.wordcount,demo.sha256", {"demo.wordcount", "demo.sha256"}),
        ("w", "a", {"a"}),
        ("w", " a , b ,a", {"a", "b"}),  # spaces ignored, duplicates collapse
        ("w", "images/thumbnail,ns:task", {"images/thumbnail", "ns:task"}),
    ],
)
def test_worker_from_strings(name: str, capabilities: str, expected: set[str]) -> None:
    worker = Worker.from_strings(name, capabilities)
    assert worker == Worker(name, frozenset(expected))
    assert Worker.from_strings(*worker.to_strings()) == worker
    assert Worker.parse(str(worker)) == worker


def test_worker_strings_are_sorted_and_stable() -> None:
    worker = Worker.from_strings("demo-text", "demo.wordcount,demo.sha256")
    assert worker.to_strings() == ("demo-text", "demo.sha256,demo.wordcount")
    assert str(worker) == "demo-text:demo.sha256,demo.wordcount"


@pytest.mark.parametrize(
    ("name", "capabilities", "complaint"),
    [
        ("Demo", "a", "DNS-1123"),
        ("", "a", "DNS-1123"),
        ("w" * 64, "a", "DNS-1123"),
        ("w", "", "no capability"),
        ("w", " ", "no capability"),
        ("w", "a,,b", "'' not valid"),
        ("w", "a b", "'a b' not valid"),
        ("w", "a,-b", "'-b' not valid"),
    ],
)
def test_worker_from_strings_refuses(name: str, capabilities: str, complaint: str) -> None:
    with pytest.raises(ConfigError, match=complaint):
        Worker.from_strings(name, capabilities)


@pytest.mark.parametrize("text", ["demo-text", "", ":a", "w:"])
def test_worker_parse_refuses(text: str) -> None:
    with pytest.raises(ConfigError):
        Worker.parse(text)


@given(S.worker_names, st.frozensets(S.capability_names, min_size=1, max_size=5))
def test_worker_round_trips_through_its_strings(name: str, capabilities: frozenset[str]) -> None:
    worker = Worker(name, capabilities)
    assert Worker.from_strings(*worker.to_strings()) == worker
    assert Worker.parse(str(worker)) == worker


@dataclass(frozen=True)
class ResolverBackend:
    """A backend serving a resolver's capabilities, as the Kubernetes backend does."""

    name: str
    resolver: CapabilityResolver

    def supports(self, capability: str) -> bool:
        return capability in self.resolver


def _backend(name: str, *capabilities: str) -> ResolverBackend:
    config = {"capabilities": {c: {"worker": name, "image": "img"} for c in capabilities}}
    return ResolverBackend(name, CapabilityResolver.from_mapping(config, source=name))


def test_composite_routes_by_capability() -> None:
    text, math = _backend("text", "demo.wordcount", "demo.sha256"), _backend("math", "demo.primes")
    composite = CompositeBackend([text, math])
    assert composite.backend_for("demo.sha256") is text
    assert composite.backend_for("demo.primes") is math
    assert composite.supports("demo.primes") and not composite.supports("demo.nope")
    assert composite.name == "composite(text,math)"


def test_composite_first_backend_wins_on_overlap() -> None:
    first, second = _backend("first", "shared", "a"), _backend("second", "shared", "b")
    assert CompositeBackend([first, second]).backend_for("shared") is first
    assert CompositeBackend([second, first]).backend_for("shared") is second


@pytest.mark.parametrize("backends", [[], [_backend("text", "demo.wordcount")]])
def test_composite_unknown_capability(backends: list[Backend]) -> None:
    with pytest.raises(UnknownCapability, match=r"'demo.nope'"):
        CompositeBackend(backends).backend_for("demo.nope")


def test_composites_nest_and_accept_a_resolver_backend() -> None:
    inner = CompositeBackend([ResolverBackend("demo", demo_resolver())])
    outer = CompositeBackend([_backend("extra", "x.y"), inner])
    assert outer.backend_for("demo.primes") is inner
    assert inner.backend_for("demo.primes").name == "demo"
