"""The chaos run, short (CI): `python -m k8s_dispatch.lab chaos` as a developer runs it, a few
hundred dispatches (4 of them map dispatches of 10-20 items, judged item by item) under SIGKILLs
of workers and beat, one broker flush, 5% API errors, an API server restart, a database connection
kill, a restart of the run's own PostgreSQL and of its own Redis (the processes killed and started
again, the workers and beat living through it), a rolling upgrade from the previous commit across
`k8s-dispatch migrate`, a worker's clock stepped 10 minutes forward and beat's 10 minutes back,
cancels whose message is lost, hand edits of running Jobs (tenancy label overwritten,
`delivered=true` added, attempt annotation garbled), a namespace move with work scheduled on both
sides of it, 50 namespaces (48 idle), and the run's own object store (SeaweedFS) restarted under 5
results of 1-3 MiB stored in it, 6 secret inputs and the archived logs of every planned failure,
on each cluster: localcluster, and the real control plane (kube-apiserver restarted on the same
etcd; the API errors, resets and lost responses from the fault proxy in front of it). Every fault
class of the full run is in. Nothing may be lost, doubled, wrong or left over, no slot held once it
has converged; and the run must leave no process, server, worktree or temp dir behind, also when
it is interrupted.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest
import redis

from k8s_dispatch.lab.chaos.edits import EDITS

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-c", "import sys; from k8s_dispatch.lab.cli import main; sys.exit(main())"]  # the lab's CLI
FINAL_LINE = re.compile(
    r"^chaos: dispatched=(?P<dispatched>\d+) terminal=(?P<terminal>\d+) lost=(?P<lost>\d+) "
    r"duplicates=(?P<duplicates>\d+) wrong_output=(?P<wrong_output>\d+) leftover_jobs=(?P<leftover_jobs>\d+) "
    r"second_jobs=(?P<second_jobs>\d+) limit_exceeded=(?P<limit_exceeded>-?\d+) running=(?P<running>\d+) "
    r"queued=(?P<queued>\d+) items=(?P<items>\d+) items_lost=(?P<items_lost>\d+) "
    r"items_duplicates=(?P<items_duplicates>\d+) items_wrong_output=(?P<items_wrong_output>\d+) "
    r"held_pods=(?P<held_pods>\d+) "
    r"kills=(?P<kills>\d+) broker_flushes=(?P<broker_flushes>\d+) api_faults=(?P<api_faults>\d+) "
    r"converged_s=(?P<converged_s>[\d.]+|timeout) seed=(?P<seed>\d+) "
    r"large_results=(?P<large_results>\d+) large_bad=(?P<large_bad>\d+) orphan_objects=(?P<orphan_objects>\d+) "
    r"logs_archived=(?P<logs_archived>\d+) logs_missing=(?P<logs_missing>\d+) "
    r"secret_inputs=(?P<secret_inputs>\d+) secret_leaks=(?P<secret_leaks>\d+) "
    r"objectstore_restarts=(?P<objectstore_restarts>\d+)$"
)
STDERR_TAIL = 40  # lines of the run's progress and warnings a failure shows
# The shared servers the other tests use: the run must leave them alone (it brings its own).
SHARED_REDIS_URL = "redis://127.0.0.1:6379/0"
SHARED_ADMIN_URL = os.environ.get("K8S_DISPATCH_TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
# What the hand edits and the lost cancels may end as, besides the workload's own outcomes.
PLANNED_OUTCOMES = {
    "WORKER_COMPLETED", "WORKER_FAILED:BackoffLimitExceeded", "WORKER_FAILED:DeadlineExceeded",
    "WORKER_FAILED:ResultNotJson",  # the poison results: intended
    "WORKER_FAILED:ItemsFailed",  # a map that needs every item, some failing by design
}  # fmt: skip


def chaos_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("K8S_DISPATCH_")}
    env["PYTHONPATH"] = str(REPO)
    return env


def shared_postmaster_start() -> object:
    """When the shared PostgreSQL started: a restart of it would change this."""
    with psycopg.connect(SHARED_ADMIN_URL, autocommit=True, connect_timeout=5) as admin:
        row = admin.execute("SELECT pg_postmaster_start_time()").fetchone()
    assert row is not None
    return row[0]


def shared_redis_run_id() -> str:
    client = redis.Redis.from_url(SHARED_REDIS_URL)
    try:
        return str(client.info("server")["run_id"])
    finally:
        client.close()


def worktrees() -> str:
    return subprocess.run(["git", "-C", str(REPO), "worktree", "list"], capture_output=True, text=True).stdout


def processes_mentioning(text: str, *, besides: int | None = None) -> list[str]:
    """Live processes whose command line or environment names `text`: the run's work dir is in
    every child's (the kubeconfig and capability file paths), not in the harness's own."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in (os.getpid(), besides):
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = (entry / "environ").read_bytes().decode(errors="replace")
            state = next(
                (line for line in (entry / "status").read_text().splitlines() if line.startswith("State:")), ""
            )
        except OSError:
            continue
        if (text in cmdline or text in environ) and "zombie" not in state:
            found.append(f"{entry.name}: {cmdline}")
    return found


CLUSTERS = ["localcluster", "realcluster"]
EDIT_KINDS = [what for what, _ in EDITS]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("cluster", CLUSTERS)
def test_a_short_chaos_run_loses_nothing_doubles_nothing_and_leaves_nothing(tmp_path, cluster):
    work_dir = tmp_path / "run"
    json_out = tmp_path / "chaos.json"
    # --deadline: room for twice the slowest convergence seen on a loaded machine (the real control
    # plane's last Jobs wait for their clean-up), within the subprocess's timeout.
    args = [
        "chaos", "--cluster", cluster, "--dispatches", "300", "--workers", "3", "--rate", "15", "--kills", "8",
        "--seed", "11", "--deadline", "420", "--json-out", str(json_out), "--work-dir", str(work_dir),
    ]  # fmt: skip
    shared = (shared_postmaster_start(), shared_redis_run_id())
    started = time.monotonic()
    done = subprocess.run(CLI + args, cwd=REPO, env=chaos_env(), capture_output=True, text=True, timeout=850)
    elapsed = time.monotonic() - started
    # The report (its problems and what the logs say of each dispatch they name) last: a CI log
    # keeps a failure's head and tail.
    output = "\n".join(done.stderr.splitlines()[-STDERR_TAIL:]) + "\n" + done.stdout

    lines = done.stdout.strip().splitlines()
    assert lines, output
    match = FINAL_LINE.match(lines[-1])
    assert match, f"the last line is not the chaos line:\n{output}"
    numbers = {k: int(v) for k, v in match.groupdict().items() if k != "converged_s"}
    assert match["converged_s"] != "timeout", f"not converged by the deadline:\n{output}"
    numbers["converged_s"] = float(match["converged_s"])
    assert numbers["dispatched"] == 330 and numbers["terminal"] == 330, output  # 300, and 30 of the second deployment
    assert (numbers["lost"], numbers["duplicates"], numbers["wrong_output"], numbers["leftover_jobs"]) == (
        0,
        0,
        0,
        0,
    ), output
    assert numbers["second_jobs"] == 0, output
    # Maps among the work (4 of the 300): every item one item event, the one its index calls for;
    # and no Pod left holding our finalizer.
    assert numbers["items"] >= 40, output
    assert (numbers["items_lost"], numbers["items_duplicates"], numbers["items_wrong_output"]) == (0, 0, 0), output
    assert numbers["held_pods"] == 0, output
    # Fair share: no sample of the cluster (every 100 ms) saw more Jobs of a tenancy or a capability
    # running than its limit, and after convergence no dispatch holds a slot or waits for one.
    assert numbers["limit_exceeded"] <= 0 and numbers["running"] == 0 and numbers["queued"] == 0, output
    assert numbers["kills"] == 8 and numbers["broker_flushes"] == 1 and numbers["seed"] == 11, output
    assert numbers["api_faults"] > 0, "the API server injected no error at all"
    # The object store (issue 28): each stored result read back through k8s_dispatch.api as the
    # bytes of its SHA-256; every object under the run's prefix a recorded result, an archived log
    # or an input of a dispatch of the run; each planned failure's detail naming an archived log
    # that is there; no secret input's marker in any Job, Pod, event, message or log read; the
    # store restarted once under it all.
    assert (numbers["large_results"], numbers["large_bad"], numbers["orphan_objects"]) == (5, 0, 0), output
    assert numbers["logs_archived"] >= 10 and numbers["logs_missing"] == 0, output
    assert (numbers["secret_inputs"], numbers["secret_leaks"], numbers["objectstore_restarts"]) == (6, 0, 1), output
    assert done.returncode == 0, output

    result = json.loads(json_out.read_text())
    assert {k: result[k] for k in numbers} == numbers
    assert result["cluster"] == cluster
    assert sum(result["api_faults_by_kind"].values()) == numbers["api_faults"]
    assert result["ok"] and result["held_claims"] == 0 and result["api_restarts"] == 1 and result["db_kills"] == 1
    assert result["db_connections_killed"] > 0, "the database kill found no worker connection"
    assert result["objects"] >= numbers["large_results"] + numbers["logs_archived"], result["object_problems"]
    scanned = result["secret_scanned"]  # every place a marker was looked for, and how many things in each
    assert all(scanned.get(place, 0) > 0 for place in ("job", "pod", "celery message", "process log",
                                                        "engine event", "dispatch row")), scanned  # fmt: skip
    assert result["unexpected_exits"] == [], result["unexpected_exits"]
    assert result["deaf_after_redis_restart"] == [], result["deaf_after_redis_restart"]
    assert result["unexpected_task_errors"] == [], result["unexpected_task_errors"]  # each fault a typed error
    assert sum(result["outcomes"].values()) == 330
    assert result["maps"] == 4 and sum(result["item_outcomes"].values()) == result["items"], result["item_outcomes"]
    assert set(result["item_outcomes"]) == {"WORKER_ITEM_COMPLETED", "WORKER_ITEM_FAILED:ContainerFailed"}
    assert set(result["outcomes"]) >= PLANNED_OUTCOMES, result["outcomes"]
    # Other ends only for the dispatches cancelled or edited by hand (each judged: one end, no Job).
    touched = len(result["hand_edited"]) + len(result["cancels_lost"])
    assert sum(n for o, n in result["outcomes"].items() if o not in PLANNED_OUTCOMES) <= touched, result["outcomes"]
    # The servers restarted were the run's own, under the workers and beat, who went on consuming
    # (every dispatch fed after the restarts ended); a release replaced across a migration; clocks
    # stepped on a worker and on beat; cancels lost and Jobs edited while they ran.
    assert (result["redis_restarts"], result["pg_restarts"], result["rolling_upgrades"]) == (1, 1, 1), result["faults"]
    assert result["clock_steps"] == 2 and len(result["release"]) == 40, result["faults"]
    assert result["cancels_lost"], "no running dispatch was cancelled with its message lost"
    assert result["hand_edited"], "no running Job was edited by hand"
    assert set(result["hand_edited"].values()) <= set(EDIT_KINDS), result["hand_edited"]
    assert result["wrong_namespace"] == 0 and result["neighbour"]["ok"], result["neighbour"]
    assert result["jobs_seen"] >= 300, "the observer saw too few Jobs to judge"
    limits = {(p["scope"], p["name"]): p for p in result["limits"]}
    assert set(limits) >= {("tenancy", "tenant-a"), ("tenancy", "tenant-b"), ("capability", "chaos.slow")}, limits
    assert all(p["peak"] <= p["limit"] for p in result["limits"]), limits
    # The limits were felt: dispatches of the limited tenancy waited in the database while it ran.
    # (Its running Jobs need not reach the limit in a sample: a slot is held from admission, and
    # the Job of a just-admitted dispatch is still being created, or one just finished is held
    # until its end is recorded; the short run saw 15 and 16 of 16.)
    assert limits[("tenancy", "tenant-a")]["peak"] > 0, limits
    assert result["queued_peak"].get("tenant-a", 0) > 0, result["queued_peak"]
    assert result["samples"] >= 10 * result["feed_s"] * 0.5, "the observer sampled far less often than every 100 ms"
    assert set(result["by_namespace"]) == {"chaos", "chaos-moved"}, result["by_namespace"]  # before and after
    done_faults = {f["kind"] for f in result["faults"] if f["ok"]}
    assert {"pod_delete", "namespace_change"} <= done_faults, result["faults"]
    assert any(f["kind"] == "pod_delete" and not f["detail"].startswith("deleted 0 ") for f in result["faults"])

    # Nothing of the run is left: processes (its PostgreSQL and Redis among them), temp dirs, the
    # worktree; and the shared servers were neither restarted nor used.
    assert processes_mentioning(str(work_dir)) == []
    assert all(not Path(d).exists() for d in result["temp_dirs"]), result["temp_dirs"]
    assert not any(d in worktrees() for d in result["temp_dirs"]), worktrees()
    assert (shared_postmaster_start(), shared_redis_run_id()) == shared
    print(f"\nshort chaos run on {cluster}: {lines[-1]} in {elapsed:.0f}s")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cluster", CLUSTERS)
def test_an_interrupted_run_still_removes_its_processes_servers_and_temp_dirs(tmp_path, cluster):
    work_dir = tmp_path / "run"
    args = ["chaos", "--cluster", cluster, "--dispatches", "2000", "--rate", "5", "--kills", "4", "--seed", "5",
            "--work-dir", str(work_dir)]  # fmt: skip
    stderr_path = tmp_path / "stderr.txt"
    with stderr_path.open("w") as stderr:
        proc = subprocess.Popen(CLI + args, cwd=REPO, env=chaos_env(), stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            deadline = time.monotonic() + 180
            while "fed " not in stderr_path.read_text():  # set up, and feeding
                assert proc.poll() is None, stderr_path.read_text()
                assert time.monotonic() < deadline, stderr_path.read_text()
                time.sleep(0.2)
            assert processes_mentioning(str(work_dir), besides=proc.pid), "the run's processes should be up by now"
            proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:  # failed before its interrupt: it still removes what it started
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    text = " ".join(stderr_path.read_text().split())
    found = re.search(r"temp dirs ((?:/\S+ ?)+)", text)
    assert found, text
    temp_dirs = found.group(1).split()
    assert len(temp_dirs) == 2, temp_dirs  # the PostgreSQL data dir, the previous release's worktree
    assert code != 0
    assert processes_mentioning(str(work_dir)) == []
    assert all(not Path(d).exists() for d in temp_dirs), temp_dirs
    assert not any(d in worktrees() for d in temp_dirs), worktrees()
