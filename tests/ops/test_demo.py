"""`k8s-dispatch demo`, run for real as a user runs it: on embedded defaults when no Redis answers
(the fresh-machine path of `make demo`), and on the configured Redis and PostgreSQL; each ends
with the summary line and exit 0, leaves no file behind and no process running; Ctrl-C midway
cleans up too. The summary's checks themselves are tested as the pure functions they are.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from k8s_dispatch.demo.run import (
    LIMITED_MAX_RUNNING,
    DemoRequest,
    Outcome,
    parse_sweep_line,
    plan_requests,
    summarise,
)
from k8s_dispatch.ops import processes

SCRIPT = str(Path(sys.executable).parent / "k8s-dispatch")
OK_LINE = re.compile(
    r"demo OK: dispatched=(\d+) completed=(\d+) failed=1 \(as intended: 1\) lost=0 duplicates=0 "
    r"right_outputs=(\d+)/(\d+) jobs_left=0 acme: max_running=(\d+)/(\d+) max_queued=(\d+) in ([0-9.]+)s"
)


def assert_the_limited_tenancy_waited_its_turn(match: re.Match[str], output: str) -> None:
    """acme's Jobs never ran more at once than its limit (the cluster sampled, the database read),
    and its dispatches did wait, queued, and were admitted in turn."""
    max_running, limit, max_queued = map(int, match.groups()[4:7])
    assert limit == LIMITED_MAX_RUNNING and 1 <= max_running <= limit, match.group(0)
    assert max_queued > 0, match.group(0)
    assert re.search(r"tenancy acme may run 2 Jobs at once: [1-9]\d* of its \d+ dispatches wait their turn", output)
    waited = re.search(r"tenancy acme \(maxRunning 2\): (\d+) dispatches admitted in turn, after waiting "
                       r"[0-9.]+s to ([0-9.]+)s in the queue; at most (\d+) of its Jobs ran at once .*?"
                       r"(\d+) held a slot and (\d+) waited at once", output)  # fmt: skip
    assert waited, output[-3000:]
    assert float(waited.group(2)) > 0 and int(waited.group(3)) <= limit and int(waited.group(4)) <= limit
    assert int(waited.group(5)) == max_queued


def demo_env(tmp: Path, **settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("K8S_DISPATCH_")}
    env.update({f"K8S_DISPATCH_{k.upper()}": v for k, v in settings.items()})
    env["TMPDIR"] = str(tmp)  # where the demo makes its directory: it must be gone afterwards
    env["COLUMNS"] = "120"
    return env


def processes_under(tmp: Path) -> list[str]:
    """Command lines of the processes whose TMPDIR is `tmp` or below: the demo's worker and beat
    (TMPDIR is the demo's directory) and the Jobs' processes (they inherit the demo's TMPDIR)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or not a process
            continue
        if any(v == f"TMPDIR={tmp}".encode() or v.startswith(f"TMPDIR={tmp}/".encode()) for v in environ):
            found.append(f"{proc.name}: {cmdline}")
    return found


def assert_left_nothing(output: str, *, cwd: Path, tmp: Path) -> None:
    assert re.search(r"worker demo-worker \(pid \d+\) and beat \(pid \d+\) running", output), output
    try:
        processes.wait_until(lambda: not processes_under(tmp), timeout=10, what="the demo's processes gone")
    except processes.WaitTimeout:
        raise AssertionError(f"the demo left processes running: {processes_under(tmp)}") from None
    assert list(cwd.iterdir()) == [], "the demo left files where it ran"
    assert list(tmp.iterdir()) == [], "the demo left files in its temporary directory"


def run_demo(tmp_path: Path, env: dict[str, str], *args: str) -> tuple[subprocess.CompletedProcess[str], Path, Path]:
    cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    tmp.mkdir()
    result = subprocess.run(
        [SCRIPT, "demo", *args], env=demo_env(tmp, **env), cwd=cwd, capture_output=True, text=True, timeout=150
    )
    print(result.stdout, result.stderr)
    return result, cwd, tmp


def test_the_demo_runs_on_embedded_defaults_when_no_redis_answers(tmp_path: Path) -> None:
    nobody = f"redis://127.0.0.1:{processes.free_port()}/0"
    result, cwd, tmp = run_demo(tmp_path, {"redis_url": nobody})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    assert "embedded fakeredis" in result.stdout and "sqlite" in result.stdout
    match = OK_LINE.search(result.stdout)
    assert match, result.stdout[-2000:]
    dispatched, completed, right, of = map(int, match.groups()[:4])
    assert (dispatched, completed, right, of) == (30, 29, 29, 29)
    assert_the_limited_tenancy_waited_its_turn(match, result.stdout)
    assert "SIGKILL to the worker" in result.stdout and "start-up sweep found and did:" in result.stdout
    assert re.search(r"finished unrecorded +│ +\d+ │ +\d+ │", result.stdout)
    assert_left_nothing(result.stdout, cwd=cwd, tmp=tmp)


def test_the_demo_uses_the_configured_redis_and_postgresql(tmp_path: Path, redis_url: str, new_pg_database) -> None:
    pg_url = new_pg_database()  # its own: the demo's sweeps act on every row of the database
    result, cwd, tmp = run_demo(
        tmp_path, {"redis_url": redis_url, "database_url": pg_url}, "--count", "12", "--broker", "redis"
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    assert f"Redis at {redis_url}" in result.stdout and "postgresql" in result.stdout
    match = OK_LINE.search(result.stdout)
    assert match and match.group(1) == "12", result.stdout[-2000:]
    assert_the_limited_tenancy_waited_its_turn(match, result.stdout)
    assert_left_nothing(result.stdout, cwd=cwd, tmp=tmp)
    client = redis.Redis.from_url(redis_url)
    try:
        assert list(client.scan_iter(match="k8s-dispatch-demo-*", count=1000)) == []  # its keys are cleaned up
    finally:
        client.close()


def test_ctrl_c_midway_stops_every_process_and_removes_the_files(tmp_path: Path) -> None:
    cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    tmp.mkdir()
    nobody = f"redis://127.0.0.1:{processes.free_port()}/0"
    demo = subprocess.Popen(
        [SCRIPT, "demo"], env=demo_env(tmp, redis_url=nobody), cwd=cwd,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    output = []
    assert demo.stdout is not None
    for line in demo.stdout:
        output.append(line)
        if "running" in line and "pid" in line:
            running = processes_under(tmp)
            assert len(running) >= 3, running  # the demo, its worker and beat: the check below sees them
            demo.send_signal(signal.SIGINT)
            break
    rest, _ = demo.communicate(timeout=60)
    text = "".join(output) + rest
    assert demo.returncode == 1, text
    assert "aborted" in text
    assert_left_nothing(text, cwd=cwd, tmp=tmp)


# --- the checks (pure) --------------------------------------------------------------------


def outcome(state: str, output: object = None, *, events: int = 1, reason: str | None = None) -> Outcome:
    return Outcome(state=state, output=output, reason=reason, terminal_events=events, notified=True)


def test_the_plan_spreads_capabilities_and_tenancies_and_has_one_bad_input() -> None:
    requests = plan_requests(30, run_id="r1")
    assert {r.capability for r in requests} == {"demo.primes", "demo.sha256", "demo.wordcount"}
    assert {r.tenancy_id for r in requests} == {"acme", "globex"}
    assert [r.must_fail for r in requests].count(True) == 1
    assert len({r.idempotency_key for r in requests}) == 30
    assert all(r.expected is not None for r in requests if not r.must_fail)


def test_a_summary_holds_only_when_every_dispatch_ended_once_as_expected() -> None:
    good = DemoRequest("demo.x", {}, "c", "t", "k1", expected={"n": 1})
    bad = DemoRequest("demo.x", {}, "c", "t", "k2", must_fail=True)
    ok = summarise(
        [good, bad], ["a", "b"], {"a": outcome("COMPLETED", {"n": 1}), "b": outcome("FAILED")}, jobs_left=0, elapsed_s=1
    )
    assert ok.ok and (ok.completed, ok.failed, ok.failed_as_intended, ok.right_outputs) == (1, 1, 1, 1)

    cases = {
        "lost": {"a": outcome("CREATED", events=0), "b": outcome("FAILED")},
        "missing": {"b": outcome("FAILED")},
        "duplicate": {"a": outcome("COMPLETED", {"n": 1}, events=2), "b": outcome("FAILED")},
        "wrong output": {"a": outcome("COMPLETED", {"n": 2}), "b": outcome("FAILED")},
        "unexpected failure": {"a": outcome("FAILED", reason="JobLost"), "b": outcome("FAILED")},
        "bad input completed": {"a": outcome("COMPLETED", {"n": 1}), "b": outcome("COMPLETED", 0)},
    }
    for name, outcomes in cases.items():
        assert not summarise([good, bad], ["a", "b"], outcomes, jobs_left=0, elapsed_s=1).ok, name
    assert not summarise(
        [good, bad], ["a", "b"], {"a": outcome("COMPLETED", {"n": 1}), "b": outcome("FAILED")}, jobs_left=1, elapsed_s=1
    ).ok
    unnotified = {"a": Outcome("COMPLETED", {"n": 1}, None, 1, notified=False), "b": outcome("FAILED")}
    assert not summarise([good, bad], ["a", "b"], unnotified, jobs_left=0, elapsed_s=1).ok
    for field in ("max_running", "max_holding"):  # the limited tenancy ran more at once than its limit
        beyond = summarise(
            [good, bad], ["a", "b"], {"a": outcome("COMPLETED", {"n": 1}), "b": outcome("FAILED")}, jobs_left=0,
            elapsed_s=1,
        )  # fmt: skip
        setattr(beyond, field, LIMITED_MAX_RUNNING)
        assert beyond.ok, field
        setattr(beyond, field, LIMITED_MAX_RUNNING + 1)
        assert not beyond.ok, field


@pytest.mark.parametrize(
    ("line", "rows"),
    [
        (
            "[... INFO] start-up sweep done: sweep: jobs=4 scheduled_without_job=3/3 finished_unrecorded=2/1 unnotified=0/0 errors=0 (found/acted)",
            [("scheduled_without_job", 3, 3), ("finished_unrecorded", 2, 1), ("unnotified", 0, 0)],
        ),
        (
            "start-up sweep done: sweep: jobs=8 scheduled_without_job=15/15/0 finished_unrecorded=8/7/1 errors=0 (found/acted/skipped)",
            [("scheduled_without_job", 15, 15), ("finished_unrecorded", 8, 7)],
        ),
        ("start-up sweep done: something else", []),
    ],
)
def test_the_sweep_line_is_read_into_rows(line: str, rows: list[tuple[str, int, int]]) -> None:
    assert parse_sweep_line(line) == rows
