"""Workers and backends: who can run which capability, and routing a capability to a backend.

A `Worker` is a name and the capabilities it serves, rebuildable from two strings. A
`Backend` is anything that says whether it `supports` a capability (the Kubernetes backend
is one); `CompositeBackend` asks its backends in order and routes to the first that does.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from k8s_dispatch.core.errors import ConfigError, UnknownCapability
from k8s_dispatch.workers.types import CapabilityName, WorkerName, is_capability_name, is_worker_name


@dataclass(frozen=True)
class Worker:
    """A worker name and the capability names it serves."""

    name: WorkerName
    capabilities: frozenset[CapabilityName]

    @classmethod
    def from_strings(cls, name: str, capabilities: str) -> Worker:
        """`Worker.from_strings("demo-text", "demo.sha256,demo.wordcount")`.

        Spaces around names are ignored; duplicates collapse.

        Raises:
            ConfigError: the name is not a DNS-1123 label, a capability name is invalid, or
                there is no capability at all.
        """
        if not is_worker_name(name):
            raise ConfigError(f"worker name {name!r} is not a DNS-1123 label")
        names = [part.strip() for part in capabilities.split(",")]
        if names == [""]:
            raise ConfigError(f"worker {name!r} lists no capability")
        bad = [part for part in names if not is_capability_name(part)]
        if bad:
            raise ConfigError(f"worker {name!r}: {', '.join(map(repr, bad))} not valid capability names")
        return cls(WorkerName(name), frozenset(CapabilityName(part) for part in names))

    def to_strings(self) -> tuple[str, str]:
        """The two strings `from_strings` takes back; capabilities sorted."""
        return self.name, ",".join(sorted(self.capabilities))

    @classmethod
    def parse(cls, text: str) -> Worker:
        """The inverse of `str(worker)`: `"demo-text:demo.sha256,demo.wordcount"`.

        Raises:
            ConfigError: as `from_strings`, or no `:` separating the two parts.
        """
        name, colon, capabilities = text.partition(":")
        if not colon:
            raise ConfigError(f"worker {text!r} is not NAME:CAPABILITY[,CAPABILITY...]")
        return cls.from_strings(name, capabilities)

    def __str__(self) -> str:
        name, capabilities = self.to_strings()
        return f"{name}:{capabilities}"


class Backend(Protocol):
    """Runs some capabilities. Implementations add their own verbs (create, poll, ...)."""

    @property
    def name(self) -> str: ...

    def supports(self, capability: str) -> bool: ...


class CompositeBackend:
    """Routes a capability to the first of its backends that supports it (order = priority)."""

    def __init__(self, backends: Iterable[Backend]) -> None:
        self.backends: tuple[Backend, ...] = tuple(backends)

    @property
    def name(self) -> str:
        return "composite(" + ",".join(b.name for b in self.backends) + ")"

    def supports(self, capability: str) -> bool:
        return any(b.supports(capability) for b in self.backends)

    def backend_for(self, capability: str) -> Backend:
        """Raises: UnknownCapability: no backend supports `capability`."""
        for backend in self.backends:
            if backend.supports(capability):
                return backend
        known = ", ".join(b.name for b in self.backends) or "none"
        raise UnknownCapability(f"no backend supports capability {capability!r} (backends: {known})")
