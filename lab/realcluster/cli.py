"""`realcluster serve`: a real control plane as one command (also `python -m k8s_dispatch.lab realcluster serve`
and `python -m k8s_dispatch.lab realcluster serve`). Builds the binaries on first use, writes the admin kubeconfig,
runs until SIGTERM/SIGINT, then stops every component and removes its files."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import click

from k8s_dispatch.lab.realcluster import binaries, controlplane


@click.group(name="realcluster")
def realcluster() -> None:
    """A real Kubernetes control plane (etcd, kube-apiserver, kube-controller-manager) on loopback."""


@realcluster.command()
@click.option(
    "--kubeconfig",
    "kubeconfig_path",
    default="realcluster.kubeconfig",
    show_default=True,
    type=click.Path(dir_okay=False, path_type=Path),
)
@click.option(
    "--mode",
    type=click.Choice(["exec", "simulate", "none"]),
    default="exec",
    show_default=True,
    help="How the node agent runs Pods (none: no node, Pods stay Pending). Ignored with --node kubelet.",
)
@click.option(
    "--node",
    type=click.Choice(controlplane.NODE_KINDS),
    default="agent",
    show_default=True,
    help="agent: localcluster's node agent runs the Pods; kubelet: kube-scheduler, the kubelet and containerd "
    "run them in real containers (root; runc, CNI plugins and busybox-static from Debian).",
)
@click.option(
    "--nodes",
    type=click.IntRange(1, controlplane.MAX_NODES),
    default=1,
    show_default=True,
    help="With --node kubelet: how many kubelet nodes (each its own containerd, bridge and Pod subnet; "
    "a drain of one moves its Pods to another).",
)
def serve(kubeconfig_path: Path, mode: str, node: str, nodes: int) -> None:
    """Start etcd, kube-apiserver, kube-controller-manager and a node; serve until stopped."""
    if nodes > 1 and node != "kubelet":
        raise click.UsageError("--nodes above 1 needs --node kubelet")
    directory = Path(tempfile.mkdtemp(prefix="realcluster-"))
    sys.exit(controlplane.serve(directory, kubeconfig=kubeconfig_path, mode=mode, node=node, nodes=nodes))


@realcluster.command()
@click.option("--node", type=click.Choice(controlplane.NODE_KINDS), default="agent", show_default=True)
def build(node: str) -> None:
    """Build (or find in the tool cache) etcd, kube-apiserver and kube-controller-manager, and with
    `--node kubelet` kube-scheduler, the kubelet, containerd, its shim, ctr and pause."""
    bins = binaries.control_plane()
    for path in (bins.etcd, bins.kube_apiserver, bins.kube_controller_manager):
        click.echo(str(path))
    if node == "kubelet":
        nb = binaries.node()
        for path in (binaries.kube_scheduler(), nb.kubelet, nb.containerd, nb.shim, nb.ctr, nb.pause):
            click.echo(str(path))
