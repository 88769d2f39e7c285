"""The process whose memory figure 5 measures: one recovery sweep, configured only by
K8S_DISPATCH_* settings, importing only the product (not the bench), as a worker's sweep runs.

    python -m k8s_dispatch.lab.bench.sweep_child   # prints one JSON line: RSS before and after the sweep, its counts
"""

from __future__ import annotations

import json
import resource
import sys
import time

from k8s_dispatch.core.settings import load_settings
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.recovery.sweep import run_sweep


def peak_rss_kib() -> int:
    """This process's peak resident set so far, in KiB: Linux's VmHWM, else `ru_maxrss`.

    Not `ru_maxrss` on Linux: it keeps the peak of the memory a process had before `exec`,
    here the forked copy of the (much bigger) bench process that started this one.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS


def main() -> int:
    with Runtime.from_settings(load_settings()) as rt:
        start_kib = peak_rss_kib()
        started = time.perf_counter()
        report = run_sweep(rt)
        seconds = time.perf_counter() - started
    print(json.dumps({
        "start_rss_kib": start_kib, "peak_rss_kib": peak_rss_kib(), "seconds": seconds,
        "jobs_listed": report.jobs_listed, "errors": report.errors,
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
