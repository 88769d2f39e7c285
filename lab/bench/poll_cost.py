"""Issue 16's figures: objects read from the API per finished Job, poll by watch against the old
LIST poll, for short and long Jobs, in one run; and the plot of it (`--plot`).

Each point is `api_load`'s steady state of ours (N Jobs in flight, each replaced as it finishes,
the first N spread evenly over their run time, so N / JOB_S finish per second from the start:
no time is compressed) on a new localcluster, with `K8S_DISPATCH_POLL_MODE` list or watch.
"Objects read" is every object the server sent in the window, as it counts them itself: the
items its LISTs of Jobs returned (`apiserver_storage_list_returned_objects_total`) and the watch
events it sent on Jobs (`apiserver_watch_events_total`), the bench's own watch taken out: poll's
and the sweep's together, divided by the Jobs that finished in the window.

The window is shorter than the sweep's LIST interval of the watch mode (600 s), so the one full
LIST that mode makes per interval is counted by its share: the window opens once a sweep has made
its LIST (its key is in Redis) and the next is not due before the window ends, none falls in the
window, and N objects /
(Jobs finished per second x 600 s) are added. The LIST mode's sweeps (every 30 s) fall in the
window and are counted as they come. Pods (listed by each `complete_batch` alike in both modes)
are reported apart.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import redis
import yaml

from k8s_dispatch.delivery import jobwatch
from k8s_dispatch.lab.bench import api_load, services
from k8s_dispatch.lab.bench.results import BenchResult, Figure, Ratio, Target
from k8s_dispatch.lab.bench.sizes import Size
from k8s_dispatch.ops.processes import wait_until
from k8s_dispatch.workers.resolver import CapabilityResolver

MODES = ("list", "watch")
SWEEP_LIST_INTERVAL_S = 600.0  # K8S_DISPATCH_SWEEP_LIST_INTERVAL_S's default
LIST_MARGIN_S = 30.0  # what the sweep's LIST key must have left past the window's end
OBJECTS_PER_JOB = Target(10.0, at_least=False, inclusive=True)
LONG_VS_SHORT = Target(1.5, at_least=False, inclusive=True)
POLL_P99_S = Target(0.5, at_least=False, inclusive=True)


@dataclass(frozen=True)
class Point:
    jobs: int  # N in flight
    job_s: float  # how long each runs
    window_s: float  # long enough for ~100 to finish
    # Requests per Job are judged where more than one Job finishes per poll (the sizes):
    # below that each Job pays its own Pod LIST on top of its create and two releases, 4 in all.
    requests_judged: bool = True


POINTS = {
    "smoke": (Point(10, 4.0, 4.0),),
    "quick": (Point(1000, 60.0, 20.0), Point(1000, 600.0, 60.0), Point(300, 600.0, 120.0, requests_judged=False)),
    # The sizes: 5,000 of 10 minutes, and 20,000 of 30 minutes (11 finish a second).
    "full": (Point(1000, 60.0, 30.0), Point(1000, 600.0, 60.0), Point(5000, 600.0, 30.0), Point(20000, 1800.0, 30.0)),
}
# The same steady state on the real control plane (`--cluster real|both`), poll by watch: the
# issue's 5,000 Jobs of 10 minutes (8 finish a second; the Job controller's ~9 requests per Pod
# come on top of ours). Its start and the first N Pods take minutes: at full size only.
REAL_POINTS = {"smoke": (), "quick": (), "full": (Point(5000, 600.0, 60.0),)}


def run(ctx: services.BenchContext, size: Size) -> BenchResult:
    points = POINTS[size.name]
    result = BenchResult(
        name="poll_cost",
        title="objects read from the API per finished Job: poll by watch vs the old LIST poll",
        rounds=1,
        params={"points": [p.__dict__ for p in points], "modes": list(MODES),
                "poll_interval_s": api_load.POLL_INTERVAL_S, "sweep_list_interval_s": SWEEP_LIST_INTERVAL_S},
    )  # fmt: skip
    rows: list[dict[str, Any]] = []
    for point in points:
        for mode in MODES:
            window = _measure(ctx, point, mode)
            rows.append(_row(point, mode, window))
    for point in REAL_POINTS[size.name] if services.REAL in ctx.clusters else ():
        rows.append(_row(point, "watch", _measure(ctx, point, "watch", kind=services.REAL), kind=services.REAL))
    _figures(result, rows)
    result.params["rows"] = rows
    (ctx.work_dir / "poll_cost.json").write_text(json.dumps(rows))
    return result


def _measure(ctx: services.BenchContext, point: Point, mode: str, *, kind: str = services.LOCAL) -> api_load.Window:
    knobs = api_load.Knobs(jobs=(point.jobs,), job_s=point.job_s, window_s=point.window_s)
    caps_file = ctx.work_dir / f"poll-cost-{point.job_s:g}.yaml"
    caps_file.write_text(yaml.safe_dump(api_load.capability_config(point.job_s)))
    caps = CapabilityResolver.from_mapping(api_load.capability_config(point.job_s), source=str(caps_file))
    prefix = f"{ctx.key_prefix}-cost-{uuid.uuid4().hex[:6]}"  # a fresh position per run
    env = {"poll_mode": mode, "key_prefix": prefix, "sweep_list_interval_s": str(SWEEP_LIST_INTERVAL_S)}
    wait = (
        partial(_first_sweep_listed, ctx.redis_url, point.window_s) if mode == "watch" else None
    )  # (cluster, settings)
    return api_load._ours(ctx, knobs, point.jobs, caps, caps_file, kind=kind, extra_env=env, before_window=wait)


def _first_sweep_listed(redis_url: str, window_s: float, cluster: services.Cluster, settings: Any) -> None:
    """Until a sweep's LIST of the watch mode's interval has been made and the next one is not due
    within the window: its key is set (as the sweep starts) with at least the window and a margin
    left (else the key's expiry, then the next sweep's LIST, is waited for: a setup longer than the
    interval would otherwise put that LIST in the window, counted twice), then the server's count
    of Jobs listed stands still for 2 s (its pages are all read)."""
    name = jobwatch.key(settings.key_prefix, settings.effective_deployment, settings.namespace)
    needed_ms = int(1000 * (window_s + LIST_MARGIN_S))
    client = redis.Redis.from_url(redis_url)
    try:
        wait_until(lambda: client.exists(jobwatch.listed_key(name)), timeout=60, interval=0.5,
                   what="beat's first sweep LIST")  # fmt: skip
        if int(client.pttl(jobwatch.listed_key(name))) < needed_ms:
            wait_until(lambda: int(client.pttl(jobwatch.listed_key(name))) >= needed_ms, timeout=SWEEP_LIST_INTERVAL_S,
                       interval=0.5, what="the next sweep LIST")  # fmt: skip
    finally:
        client.close()
    listed = [-1]

    def still() -> bool:
        now = api_load.scrape(cluster).objects["LIST jobs"]
        done, listed[0] = now == listed[0], now
        return done

    wait_until(still, timeout=120, interval=2.0, what="the sweep's LIST read")


def _row(point: Point, mode: str, window: api_load.Window, *, kind: str = services.LOCAL) -> dict[str, Any]:
    """One steady state's figures. On the real server its own count of watch events includes the
    controllers' informers', and its request count every sender's: ours are our worker's count
    of the events it read, and the requests its audit log gives to ours."""
    finished = len(window.finished)
    rate = finished / window.seconds
    amortised = point.jobs / (rate * SWEEP_LIST_INTERVAL_S) if mode == "watch" else 0.0
    real = kind == services.REAL
    events = window.events_read if real else window.objects["WATCH jobs"]
    requests = api_load.per_finished_job(window.sent_by(api_load.OURS), finished) if real else window.per_job
    return {
        "cluster": kind, "mode": mode, "jobs": point.jobs, "job_s": point.job_s, "window_s": round(window.seconds, 1),
        "finished": finished, "objects_per_job": (window.objects["LIST jobs"] + events) / finished + amortised,
        "listed_per_job": window.objects["LIST jobs"] / finished, "events_per_job": events / finished,
        "events_read_per_job": window.events_read / finished, "events_sent_per_job": window.objects["WATCH jobs"] / finished,
        "sweep_list_share_per_job": amortised, "pods_listed_per_job": window.objects["LIST pods"] / finished,
        "requests_per_job": requests, "requests_per_job_every_sender": window.per_job,
        "completion_p99_s": api_load._percentile(window.latencies_s, 0.99) if window.latencies_s else None,
        "poll_p99_s": _poll_p99(window.tasks), "in_flight": list(window.in_flight), "tasks": window.tasks,
        "requests_judged": point.requests_judged,
    }  # fmt: skip


def _poll_p99(tasks: str) -> float | None:
    """poll's p99 duration from `api_load.task_times`' text ("poll 20x p50 0.12s p99 0.30s, ...")."""
    for part in tasks.split(", "):
        words = part.split()
        if words and words[0] == "poll" and "p99" in words:
            return float(words[words.index("p99") + 1].rstrip("s"))
    return None


def _figures(result: BenchResult, rows: list[dict[str, Any]]) -> None:
    by = {(r["mode"], r["jobs"], r["job_s"]): r for r in rows if r.get("cluster", services.LOCAL) == services.LOCAL}
    for r in rows:
        real = r.get("cluster") == services.REAL
        tag = f"{r['mode']}_{r['jobs']}_{r['job_s']:g}s" + ("_real" if real else "")
        what = f"{r['jobs']:,} Jobs of {r['job_s']:g} s, poll by {r['mode']}" + (", real control plane" if real else "")
        judged = r["mode"] == "watch"
        result.figures.append(Figure(f"objects_per_job_{tag}", f"objects read per finished Job, {what}", "objects",
                                     [r["objects_per_job"]], target=OBJECTS_PER_JOB if judged else None, ref="16"))  # fmt: skip
        per_poll = r.get("requests_judged", True)
        result.figures.append(Figure(f"requests_per_job_{tag}", f"requests per finished Job, {what}" + (
                                     "" if per_poll else " (a Job or fewer a poll: its own Pod LIST, 4 the floor)"),
                                     "requests", [r["requests_per_job"]],
                                     target=api_load.REQUESTS_PER_JOB if judged and per_poll else None, ref="16"))  # fmt: skip
        if r["poll_p99_s"] is not None:
            result.figures.append(Figure(f"poll_p99_s_{tag}", f"poll duration p99, {what}", "s", [r["poll_p99_s"]],
                                         target=POLL_P99_S if judged else None, ref="16"))  # fmt: skip
        if r["completion_p99_s"] is not None:
            result.figures.append(Figure(f"completion_p99_s_{tag}", f"Job finished -> terminal event p99, {what}", "s",
                                         [r["completion_p99_s"]], target=api_load.LATENCY_P99 if judged else None,
                                         ref="16"))  # fmt: skip
        result.notes.append(
            f"{what}: {r['finished']} finished in {r['window_s']} s, {r['in_flight'][0]}/{r['in_flight'][1]} in flight; "
            f"per Job {r['listed_per_job']:.2f} listed + {r['events_per_job']:.2f} watch events + "
            f"{r['sweep_list_share_per_job']:.2f} (the sweep's LIST every {SWEEP_LIST_INTERVAL_S:g} s, by its share); "
            f"Pods listed {r['pods_listed_per_job']:.2f}; watch events our worker read {r['events_read_per_job']:.2f} "
            f"(the server sent {r['events_sent_per_job']:.2f} to every watcher); requests of every sender "
            f"{r['requests_per_job_every_sender']:.2f}; worker tasks: {r['tasks']}"
        )
    jobs = sorted({r["jobs"] for r in rows})
    for mode in MODES:
        for n in jobs:
            durations = sorted(d for (m, j, d) in by if m == mode and j == n)
            if len(durations) >= 2:
                short, long = by[(mode, n, durations[0])], by[(mode, n, durations[-1])]
                result.ratios.append(
                    Ratio(f"long_vs_short_{mode}_{n}", f"objects per Job, {long['job_s']:g} s / {short['job_s']:g} s Jobs, "
                          f"{n:,} in flight, poll by {mode}", [long["objects_per_job"] / short["objects_per_job"]],
                          target=LONG_VS_SHORT if mode == "watch" else None, ref="16")
                )  # fmt: skip
    for (mode, n, d), r in by.items():
        if mode == "watch" and ("list", n, d) in by:
            result.ratios.append(Ratio(f"list_vs_watch_{n}_{d:g}s", f"objects per Job, LIST poll / watch, {n:,} Jobs of "
                                       f"{d:g} s", [by[("list", n, d)]["objects_per_job"] / r["objects_per_job"]], ref="16"))  # fmt: skip


def rows_of(results_file: Path) -> list[dict[str, Any]]:
    """The poll_cost rows of a results JSON (`python -m k8s_dispatch.lab.bench`'s)."""
    data = json.loads(results_file.read_text())
    for result in data.get("benchmarks") or []:
        if result.get("name") == "poll_cost":
            return list(result["params"]["rows"])
    raise SystemExit(f"{results_file}: no poll_cost results (run `python -m k8s_dispatch.lab.bench --only poll_cost`)")
