"""Where the control plane's programs are: built on first use by `tools/build.sh` into the tool
cache outside the repository (keyed by the wrapper modules, so a second call costs a hash)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

BUILD_SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "build.sh"


class BuildFailed(RuntimeError):
    """`tools/build.sh` could not build a tool; the message carries its output's tail."""


@dataclass(frozen=True)
class Binaries:
    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path


def build(name: str) -> Path:
    """The directory holding tool `name`'s programs, building them first if needed (progress on
    stderr). Raises BuildFailed."""
    result = subprocess.run(
        ["bash", str(BUILD_SCRIPT), name], stdout=subprocess.PIPE, stderr=sys.stderr, text=True, check=False
    )
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        raise BuildFailed(f"tools/build.sh {name} failed (exit {result.returncode})")
    return Path(lines[-1])


@dataclass(frozen=True)
class NodeBinaries:
    """A kubelet node's programs: the kubelet (the kube wrapper), containerd, its runc shim, ctr
    and our pause (the containerd wrapper)."""

    kubelet: Path
    containerd: Path
    shim: Path
    ctr: Path
    pause: Path


def control_plane() -> Binaries:
    etcd, kube = build("etcd"), build("kube")
    return Binaries(etcd / "etcd", kube / "kube-apiserver", kube / "kube-controller-manager")


def kube_scheduler() -> Path:
    return build("kube") / "kube-scheduler"


def node() -> NodeBinaries:
    kube, containerd = build("kube"), build("containerd")
    return NodeBinaries(
        kube / "kubelet",
        containerd / "containerd",
        containerd / "containerd-shim-runc-v2",
        containerd / "ctr",
        containerd / "pause",
    )
