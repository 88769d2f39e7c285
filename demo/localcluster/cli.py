"""`localcluster serve`: the cluster as a process (also `k8s-dispatch localcluster serve` and
`python -m k8s_dispatch.demo.localcluster serve`). Prints `listening on http://HOST:PORT`, writes the kubeconfig,
runs until SIGTERM/SIGINT and saves --state on the way out. The process runs on uvloop: a
quarter less time per HTTP request than asyncio's own loop.

`localcluster node --kubeconfig FILE`: the node agent (demo/localcluster/node.py) for any API server."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
from pathlib import Path

import aiohttp
import click
import uvloop
import yaml
from kubernetes.config import ConfigException

from k8s_dispatch.demo.localcluster.apiclient import ApiClient, ApiStatusError
from k8s_dispatch.demo.localcluster.cluster import Server, token_from_kubeconfig
from k8s_dispatch.demo.localcluster.core import MODES
from k8s_dispatch.demo.localcluster.node import NodeAgent
from k8s_dispatch.demo.localcluster.persist import StateError
from k8s_dispatch.demo.localcluster.podstatus import NODE_NAME


@click.group(name="localcluster")
def localcluster() -> None:
    """A local Kubernetes API server for Jobs and Pods."""


@localcluster.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=0, show_default=True, type=int, help="0 picks a free port.")
@click.option(
    "--kubeconfig",
    "kubeconfig_path",
    default="localcluster.kubeconfig",
    show_default=True,
    type=click.Path(dir_okay=False, path_type=Path),
)
@click.option(
    "--state",
    "state_path",
    default=None,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Persist objects here and load them at start.",
)
@click.option("--mode", type=click.Choice(MODES), default="exec", show_default=True)
@click.option("--fault-rate", default=0.0, show_default=True, type=click.FloatRange(0.0, 1.0))
@click.option("--latency-ms", default=0, show_default=True, type=click.IntRange(min=0))
@click.option("--max-running", default=None, type=click.IntRange(min=1), help="Exec mode: processes at once.")
@click.option("--token", default=None, help="Bearer token (default: the kubeconfig's if it exists, else random).")
@click.option(
    "--tls-port",
    default=0,
    show_default=True,
    type=int,
    help="The https listener the kubeconfig names (kubectl sends credentials only over TLS).",
)
@click.option(
    "--tls/--no-tls",
    default=True,
    show_default=True,
    help="Also serve https with a self-signed certificate kept in KUBECONFIG.tls/.",
)
@click.option(
    "--kubelet/--no-kubelet",
    default=True,
    show_default=True,
    help="Run Pods in process; --no-kubelet leaves them to a `localcluster node` agent.",
)
def serve(
    host: str,
    port: int,
    kubeconfig_path: Path,
    state_path: Path | None,
    mode: str,
    fault_rate: float,
    latency_ms: int,
    max_running: int | None,
    token: str | None,
    tls_port: int,
    tls: bool,
    kubelet: bool,
) -> None:
    """Serve the cluster until SIGTERM or SIGINT."""
    token = token or token_from_kubeconfig(kubeconfig_path)
    try:
        uvloop.run(
            _serve(
                Server(
                    host=host,
                    port=port,
                    token=token,
                    kubeconfig_path=kubeconfig_path,
                    tls=tls,
                    tls_port=tls_port,
                    mode=mode,
                    state_path=state_path,
                    fault_rate=fault_rate,
                    latency_ms=latency_ms,
                    max_running=max_running,
                    kubelet=kubelet,
                )
            )
        )
    except StateError as e:
        raise click.ClickException(str(e)) from e


@localcluster.command()
@click.option(
    "--kubeconfig",
    "kubeconfig_path",
    required=True,
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="The API server to serve.",
)
@click.option("--mode", type=click.Choice(MODES), default="exec", show_default=True)
@click.option("--name", default=NODE_NAME, show_default=True, help="The Node's name.")
@click.option(
    "--workdir",
    default=None,
    type=click.Path(file_okay=False, path_type=Path),
    help="Pod logs and files, and the log endpoint's certificate (default: a temporary directory).",
)
@click.option(
    "--log-port",
    default=0,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="The kubelet log endpoint's HTTPS port on 127.0.0.1 (0 picks a free port).",
)
@click.option("--max-running", default=None, type=click.IntRange(min=1), help="Exec mode: processes at once.")
@click.option("--context", default=None, help="The kubeconfig context (default: its current one).")
def node(
    kubeconfig_path: Path,
    mode: str,
    name: str,
    workdir: Path | None,
    log_port: int,
    max_running: int | None,
    context: str | None,
) -> None:
    """Run the Pods of any API server as a node (registers NAME, binds unscheduled Pods to it)
    until SIGTERM or SIGINT, then stops them and removes the Node."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    uvloop.run(
        _node(
            kubeconfig_path,
            context=context,
            mode=mode,
            name=name,
            workdir=workdir,
            log_port=log_port,
            max_running=max_running,
        )
    )


async def _node(
    kubeconfig_path: Path,
    *,
    context: str | None,
    mode: str,
    name: str,
    workdir: Path | None,
    log_port: int,
    max_running: int | None,
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        api = ApiClient(kubeconfig_path, context=context)
    except (ConfigException, yaml.YAMLError, OSError, ValueError) as e:
        raise click.ClickException(f"{kubeconfig_path}: not a usable kubeconfig: {e}") from e
    agent = NodeAgent(api, mode=mode, name=name, workdir=workdir, log_port=log_port, max_running=max_running)
    try:
        try:
            await agent.start()
        except (ApiStatusError, aiohttp.ClientError, TimeoutError, OSError) as e:
            raise click.ClickException(f"node {agent.name}: cannot register with {api.server}: {e}") from e
        click.echo(f"node {agent.name} ready on {api.server}, logs on https://127.0.0.1:{agent.log_port}")
        sys.stdout.flush()
        await stop.wait()
    finally:
        await agent.close()
        await api.close()


def tune_gc() -> None:
    """For a process that is the server: the store keeps every object version a watch may still
    replay, hundreds of thousands of long-lived dicts that the cyclic collector would otherwise
    walk again and again (a quarter of a busy server's time). What exists after startup is
    frozen out of collections, and collections come 70 times less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


async def _serve(server: Server) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    tune_gc()
    click.echo(f"listening on {server.url}")
    # The kubeconfig names the https listener (kubectl sends a token only over TLS): say which.
    if server.https_url:
        click.echo(f"https on {server.https_url}: the kubeconfig {server.kubeconfig_path} points here")
    elif server.kubeconfig_path is not None:
        click.echo(f"the kubeconfig {server.kubeconfig_path} points at {server.url}")
    sys.stdout.flush()
    if server.tls_error:
        click.echo(
            f"localcluster: no https listener ({server.tls_error}); kubectl cannot authenticate over http", err=True
        )
    try:
        await stop.wait()
    finally:
        await server.close()
