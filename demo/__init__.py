"""The demo: the whole system on embedded defaults (localcluster, an embedded broker, SQLite).
Shipped in the wheel; its dependencies are the `demo` extra (`pip install k8s-dispatch[demo]`).
The product never imports it."""

from __future__ import annotations

import importlib.util

from k8s_dispatch.core.errors import ConfigError

# What the demo extra installs, by import name (`pyproject.toml`'s `demo` extra).
EXTRA_MODULES = ("aiohttp", "uvloop", "fakeredis")


def missing_extra() -> list[str]:
    """The demo extra's modules this environment lacks (a bare `pip install k8s-dispatch`)."""
    return [name for name in EXTRA_MODULES if importlib.util.find_spec(name) is None]


def require_extra(command: str) -> None:
    """Raises ConfigError saying how to install the demo extra when it is missing."""
    missing = missing_extra()
    if missing:
        raise ConfigError(
            f"`k8s-dispatch {command}` needs the demo extra (missing: {', '.join(missing)}): "
            "pip install 'k8s-dispatch[demo]'"
        )
