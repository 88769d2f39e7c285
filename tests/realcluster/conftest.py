"""The kubelet cluster of this test session: the real control plane with a real node (kube-scheduler,
the kubelet, containerd and runc; our own images imported), started on first use, stopped (and
every container, mount and cgroup it made removed) at the end. Root, runc, the CNI plugins and
busybox-static are needed; `make tools` builds and installs them. A node that cannot start fails
the tests with its logs: nothing falls back to the node agent."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from clusters import ClusterHandle, real_handle

from tests.tasks.conftest import deploy  # noqa: F401  (the fixture: real worker and beat processes, for the kubelet node)

# tests/recovery's helpers import each other by module name (forged_jobs, runtimes), as pytest makes
# them importable for the tests beside them; the kubelet's crash matrix reuses that suite's site.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recovery"))
from tests.recovery.test_crash_matrix import make_site  # noqa: F401  (the fixture: a site with crash points)


@pytest.fixture(scope="session")
def kubelet_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    from k8s_dispatch.lab.realcluster.controlplane import ControlPlane

    plane = ControlPlane(directory=tmp_path_factory.mktemp("kubelet"), node="kubelet")
    plane.start()
    try:
        yield real_handle(plane)
    finally:
        plane.stop()
