"""`python -m k8s_dispatch.lab.bench --plot`: objects read per finished Job, poll by watch against the
old LIST poll, against Job duration and against concurrency, from a results JSON's `poll_cost`
rows (measured, never modelled), as a PNG for the README."""

from __future__ import annotations

from pathlib import Path
from typing import Any

DEFAULT_PNG = Path(__file__).resolve().parents[2] / "docs" / "poll-cost.png"
STYLE = {"list": ("tab:red", "o", "LIST poll (old)"), "watch": ("tab:blue", "s", "watch poll (new)")}


def plot(rows: list[dict[str, Any]], out: Path = DEFAULT_PNG) -> Path:
    """Two panels: per Job duration (at the most common N), and every row per N, each point
    marked with its Jobs' duration (the full sizes grow N and duration together). localcluster's
    rows only: the real control plane's one point is in the README's table."""
    import matplotlib

    matplotlib.use("Agg")  # no display: a file
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("cluster", "local") == "local"]
    jobs = max({r["jobs"] for r in rows}, key=lambda n: sum(r["jobs"] == n for r in rows))
    fig, (by_duration, by_jobs) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for mode, (colour, marker, label) in STYLE.items():
        mine = sorted((r for r in rows if r["mode"] == mode and r["jobs"] == jobs), key=lambda r: r["job_s"])
        by_duration.plot([r["job_s"] / 60 for r in mine], [r["objects_per_job"] for r in mine], marker=marker,
                         color=colour, label=label)  # fmt: skip
        mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: (r["jobs"], r["job_s"]))
        by_jobs.plot([r["jobs"] for r in mine], [r["objects_per_job"] for r in mine], marker=marker, color=colour,
                     linestyle="none", label=label)  # fmt: skip
        for r in mine:
            by_jobs.annotate(f"{r['job_s'] / 60:g} min", (r["jobs"], r["objects_per_job"]), fontsize=8,
                             textcoords="offset points", xytext=(5, 3))  # fmt: skip
    for axes in (by_duration, by_jobs):
        axes.set_yscale("log")
        axes.set_ylabel("objects read from the API per finished Job")
        axes.grid(True, which="both", alpha=0.3)
        axes.legend()
    by_duration.set_xlabel(f"Job duration, minutes ({jobs:,} Jobs in flight)")
    by_jobs.set_xscale("log")
    by_jobs.set_xlabel("Jobs in flight (each point: its Jobs' duration)")
    fig.suptitle("Finding finished Jobs: every LIST item and watch event, poll and sweep (localcluster)")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
