"""The official Kubernetes client as the operator tools and the bench open it: an `ApiClient`
from a kubeconfig, its closing, and a watch. kubernetes annotates its API classes but not
`kubernetes.config`'s loaders, `ApiClient.close` nor `kubernetes.watch`; their types are
declared once here, so their callers are checked. kubernetes is imported on first use (the CLI
stays quick).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

if TYPE_CHECKING:
    from kubernetes.client import ApiClient, Configuration


class _NewClientFromConfig(Protocol):
    """`kubernetes.config.new_client_from_config`, as it is written (it carries no annotations)."""

    def __call__(
        self,
        config_file: str | None = None,
        context: str | None = None,
        persist_config: bool = True,
        client_configuration: Configuration | None = None,
    ) -> ApiClient: ...


class WatchStream(Protocol):
    """`kubernetes.watch.Watch`: its events are dicts with `type` and `object` (a model, or the
    raw dict of an ERROR)."""

    def stream(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Iterator[dict[str, Any]]: ...

    def stop(self) -> None: ...


def api_client(kubeconfig: Path | str, *, context: str | None = None) -> ApiClient:
    """A client of the kubeconfig's (current, or named) context; close it, or use it in `with`."""
    from kubernetes import config

    new_client = cast(_NewClientFromConfig, config.new_client_from_config)  # unannotated in kubernetes
    return new_client(config_file=str(kubeconfig), context=context)


def close(client: ApiClient) -> None:
    """Close the client's connection pool (and its thread pool, if it made one)."""
    cast(Callable[[], None], client.close)()  # unannotated in kubernetes


@contextmanager
def opened(kubeconfig: Path | str) -> Iterator[ApiClient]:
    """`api_client`, closed on leaving."""
    client = api_client(kubeconfig)
    try:
        yield client
    finally:
        close(client)


def new_watch() -> WatchStream:
    """A fresh `kubernetes.watch.Watch` (one per stream)."""
    from kubernetes import watch

    return cast(Callable[[], WatchStream], watch.Watch)()  # its __init__ carries no annotations
