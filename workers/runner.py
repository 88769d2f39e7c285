"""Deprecated: the runner moved to `k8s_dispatch.container.runner` (what runs inside a Job's container
is not the Kubernetes side). `python -m k8s_dispatch.workers.runner` still runs it, with a warning on
stderr, so Jobs and capability files written for 0.1 keep working; use the new path."""

from __future__ import annotations

import runpy
import sys

if __name__ == "__main__":
    print(
        "k8s_dispatch.workers.runner is deprecated: run `python -m k8s_dispatch.container.runner`",
        file=sys.stderr,
    )
    runpy.run_module("k8s_dispatch.container.runner", run_name="__main__", alter_sys=True)
