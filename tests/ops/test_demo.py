"""`k8s-dispatch demo`, run for real as a user runs it: on embedded defaults when no Redis answers
(the fresh-machine path of `make demo`), and on the configured Redis and PostgreSQL; each ends
with the summary line and exit 0, shows its one large result (`demo.report`, in its directory
object store) recorded and read back with the SHA-256 of the bytes the test computes itself, leaves
no file behind and no process running; Ctrl-C midway cleans up too. The summary's checks
themselves are tested as the pure functions they are.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from k8s_dispatch.artifacts.reference import ResultReference
from k8s_dispatch.core.errors import ConfigError
from k8s_dispatch.core.settings import load_settings
from k8s_dispatch.demo import functions as demo_functions
from k8s_dispatch.demo.run import (
    LIMITED_MAX_RUNNING,
    REPORT_AT,
    REPORT_ROWS,
    DemoRequest,
    Outcome,
    ReadBack,
    parse_sweep_line,
    plan_requests,
    right_output,
    summarise,
)
from k8s_dispatch.ops import processes
from k8s_dispatch.workers.resolver import DEMO_MAX_RESULT_BYTES, CapabilityResolver, demo_config

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


def assert_the_large_result_was_read_back(output: str) -> None:
    """The summary's row and line for `demo.report`: the reference its terminal event recorded and
    the bytes `api.read_result` streamed have the size and SHA-256 of the CSV computed here."""
    expected = demo_functions.report({"rows": REPORT_ROWS, "seed": REPORT_AT})
    size, sha256 = f"{len(expected):,}", hashlib.sha256(expected).hexdigest()
    assert re.search(r"object store +directory objects/ under files \(its file:// URLs work", output), output[:3000]
    row = (
        rf"demo\.report: object store result read back, SHA-256 as expected +│ +{len(expected) / (1 << 20):.1f} MiB │ ✓"
    )
    assert re.search(row, output), output[-4000:]
    line = (
        rf"demo\.report [0-9a-f-]{{36}}: its terminal event recorded a reference to {size} bytes, SHA-256 {sha256}; "
        rf"k8s_dispatch\.api\.read_result streamed {size} bytes with SHA-256 {sha256} in [0-9.]+s: the same bytes as "
        r"the CSV the demo computed itself"
    )
    assert re.search(line, output), output[-4000:]


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
    assert_the_large_result_was_read_back(result.stdout)
    assert_left_nothing(result.stdout, cwd=cwd, tmp=tmp)  # the object store's directory too


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
    assert_the_large_result_was_read_back(result.stdout)
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


def test_the_plan_spreads_capabilities_and_tenancies_and_has_one_bad_input_and_one_large_result() -> None:
    requests = plan_requests(30, run_id="r1")
    assert {r.capability for r in requests} == {"demo.primes", "demo.sha256", "demo.wordcount", "demo.report"}
    assert {r.tenancy_id for r in requests} == {"acme", "globex"}
    assert [r.must_fail for r in requests].count(True) == 1
    assert len({r.idempotency_key for r in requests}) == 30
    assert all(r.expected is not None for r in requests if not r.must_fail)
    (report,) = [r for r in requests if r.stored]
    assert report.capability == "demo.report" and report.tenancy_id != "acme"  # not held back by acme's limit
    data = demo_functions.report(report.input)
    assert report.expected == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert 3 * (1 << 20) < len(data) < DEMO_MAX_RESULT_BYTES  # a few MiB: far beyond a termination message


def test_the_report_is_the_same_csv_for_the_same_input() -> None:
    data = demo_functions.report({"rows": 1000, "seed": 7})
    assert data == demo_functions.report({"rows": 1000, "seed": 7})
    assert data != demo_functions.report({"rows": 1000, "seed": 8})
    lines = data.decode("ascii").splitlines()
    assert lines[0] == "row,region,product,units,unit_price,total" and len(lines) == 1001
    for line in lines[1:]:
        _row, _region, _product, units, price, total = line.split(",")
        cents = round(float(price) * 100)
        assert 1 <= int(units) <= 500 and 100 <= cents < 10_000
        assert round(float(total) * 100) == int(units) * cents, line
    assert demo_functions.report({"rows": 0, "seed": 1}) == b"row,region,product,units,unit_price,total\n"
    bad: object
    for bad in ({"rows": -1, "seed": 1}, {"rows": demo_functions.MAX_REPORT_ROWS + 1, "seed": 1}, {"rows": 5},
                {"rows": True, "seed": 1}, {"rows": 5, "seed": "x"}, []):  # fmt: skip
        with pytest.raises(ValueError):
            demo_functions.report(bad)


def test_the_stored_demo_capability_needs_an_object_store(tmp_path: Path) -> None:
    """Only `demo_config(object_store=True)` has it, since the demo table is the default one and a
    capability with results in the object store is refused where none is configured."""
    assert "demo.report" not in demo_config()["capabilities"]
    path = tmp_path / "capabilities.yaml"
    path.write_text(yaml.safe_dump(demo_config(object_store=True)))
    with pytest.raises(ConfigError, match=r"demo\.report.*results: objectStore"):
        CapabilityResolver.from_settings(load_settings({"K8S_DISPATCH_CAPABILITIES": str(path)}))
    store = (tmp_path / "objects").as_uri()
    resolver = CapabilityResolver.from_settings(
        load_settings({"K8S_DISPATCH_CAPABILITIES": str(path), "K8S_DISPATCH_OBJECT_STORE_ENDPOINT": store})
    )
    spec = resolver.spec("demo.report")
    assert spec.results_in_object_store and spec.max_result_bytes == DEMO_MAX_RESULT_BYTES
    assert not resolver.spec("demo.sha256").results_in_object_store


def test_a_stored_result_is_right_when_its_reference_has_the_expected_size_and_sha256() -> None:
    digest = hashlib.sha256(b"x").hexdigest()
    request = DemoRequest("demo.report", {}, "c", "t", "k", expected={"size": 1, "sha256": digest}, stored=True)
    reference = ResultReference(key="results/d/0/result", size=1, sha256=digest)
    assert right_output(request, reference.to_output())
    assert not right_output(request, ResultReference(key="k", size=2, sha256=digest).to_output())
    assert not right_output(request, ResultReference(key="k", size=1, sha256="0" * 64).to_output())
    for output in ({"size": 1, "sha256": digest}, None, "x", {"k8s-dispatch.io/object": {"size": 1}}):
        assert not right_output(request, output), output


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
    stored = DemoRequest("demo.report", {}, "c", "t", "k3", expected={"size": 1, "sha256": "a" * 64}, stored=True)
    reference = ResultReference(key="k", size=1, sha256="a" * 64).to_output()
    with_stored = summarise(
        [good, bad, stored], ["a", "b", "c"],
        {"a": outcome("COMPLETED", {"n": 1}), "b": outcome("FAILED"), "c": outcome("COMPLETED", reference)},
        jobs_left=0, elapsed_s=1,
    )  # fmt: skip
    assert not with_stored.ok and with_stored.stored == 1 and with_stored.right_outputs == 2  # not read back yet
    read = ReadBack("demo.report", "c", 1, "a" * 64, recorded_size=1, recorded_sha256="a" * 64, read_size=1,
                    read_sha256="a" * 64)  # fmt: skip
    with_stored.read_back = [read]
    assert with_stored.ok
    wrong: dict[str, Any]
    for wrong in (
        {"read_sha256": "b" * 64},
        {"read_size": 2},
        {"recorded_sha256": None},
        {"error": "ResultObjectMissing"},
    ):
        with_stored.read_back = [replace(read, **wrong)]
        assert not with_stored.ok, wrong
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
