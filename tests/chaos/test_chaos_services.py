"""The chaos run's own servers, stepped clocks, previous release and hand edits, each against the
real thing: redis-server, PostgreSQL's binaries, libfaketime, git."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psycopg
import pytest
import redis

from k8s_dispatch.lab.chaos.edits import EDITED_TENANCY, EDITS, running_targets
from k8s_dispatch.lab.chaos.services import OwnPostgres, OwnRedis, SteppedClock, build_sleep_shim
from k8s_dispatch.lab.chaos.upgrade import REPO, PreviousRelease
from k8s_dispatch.ops.processes import wait_until
from k8s_dispatch.workers.labels import CAPABILITY_KEY, DELIVERED_LABEL, DISPATCH_ID_KEY, TENANCY_ID_KEY


def test_own_redis_restarts_on_the_same_port_and_clients_reconnect(tmp_path):
    server = OwnRedis(directory=tmp_path / "redis", log_dir=tmp_path, env=dict(os.environ))
    server.start()
    client = redis.Redis.from_url(server.url, socket_timeout=5)
    try:
        client.set("before", "1")
        client.bgrewriteaof()  # on disk now, not within the next second's fsync
        wait_until(lambda: client.info("persistence")["aof_rewrite_in_progress"] == 0, timeout=10)
        pid = server.proc.pid
        server.restart()
        assert server.proc.pid != pid
        assert client.get("before") == b"1"  # the same client, reconnected; the data kept
    finally:
        client.close()
        server.stop()
    assert not server.proc.alive


def test_own_postgres_survives_a_kill_of_every_process_and_leaves_nothing_when_stopped(tmp_path):
    server = OwnPostgres(log_dir=tmp_path, env=dict(os.environ))
    try:
        server.start()
        with psycopg.connect(server.admin_url, autocommit=True, connect_timeout=5) as admin:
            admin.execute("CREATE DATABASE kept")
        pid = server.proc.pid
        assert "SIGKILLed" in server.restart()
        with psycopg.connect(server.admin_url, autocommit=True, connect_timeout=5) as admin:
            names = {name for (name,) in admin.execute("SELECT datname FROM pg_database")}
        assert "kept" in names and server.proc.pid != pid
    finally:
        server.stop()
    assert not server.proc.alive and not server.data.exists()


SHOW_CLOCK = """
import sys, time
time.sleep(0.05)
print("running", flush=True)
deadline = time.monotonic() + 20
while time.monotonic() < deadline:
    time.sleep(0.05)  # libfaketime alone: EINVAL here (an absolute monotonic sleep)
    offset = time.time() - float(open(sys.argv[1]).read())
    if abs(offset) > 300:
        print(round(offset))
        break
"""


def test_a_stepped_clock_jumps_while_the_process_runs_and_its_sleeps_still_work(tmp_path):
    clock = SteppedClock(tmp_path / "clock", 0.0)
    shim = build_sleep_shim(tmp_path / "shim")
    truth = tmp_path / "truth"
    truth.write_text(str(time.time()))
    proc = subprocess.Popen([sys.executable, "-c", SHOW_CLOCK, str(truth)], env=dict(os.environ) | clock.env(shim),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "running\n"  # on the unstepped clock
        truth.write_text(str(time.time()))
        assert clock.step(-600) == -600
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert -610 <= int(out) <= -590, out


def _job(name, *, capability="chaos.slow", dispatch="d", labels=None, conditions=(), deleting=False):
    metadata = {"namespace": "chaos", "name": name,
                "labels": {CAPABILITY_KEY: capability, DISPATCH_ID_KEY: dispatch, **(labels or {})}}  # fmt: skip
    if deleting:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": metadata, "status": {"conditions": [{"type": c, "status": "True"} for c in conditions]}}


def test_only_running_undelivered_jobs_of_the_capability_are_edited():
    jobs = [
        _job("b", dispatch="d-b"),
        _job("a", dispatch="d-a"),
        _job("quick", capability="chaos.quick", dispatch="d-q"),
        _job("done", dispatch="d-done", conditions=("Complete",)),
        _job("failed", dispatch="d-failed", conditions=("Failed",)),
        _job("delivered", dispatch="d-del", labels={DELIVERED_LABEL: "true"}),
        _job("going", dispatch="d-going", deleting=True),
        _job("skipped", dispatch="d-skip"),
    ]
    found = running_targets(jobs, capability="chaos.slow", skip={"d-skip"})
    assert [(t.name, t.dispatch_id) for t in found] == [("a", "d-a"), ("b", "d-b")]
    assert [what for what, _ in EDITS] == [
        "tenancy label overwritten", "k8s-dispatch.io/delivered=true added", "attempt annotation malformed",
    ]  # fmt: skip
    assert EDITS[0][1] == {"labels": {TENANCY_ID_KEY: EDITED_TENANCY}}


@pytest.mark.timeout(120)
def test_the_previous_release_runs_from_its_worktree_and_is_removed_with_it():
    release = PreviousRelease("HEAD~1")
    try:
        commit = release.check_out()
        assert len(commit) == 40
        where = subprocess.run(
            [sys.executable, "-c", "import k8s_dispatch.store.migrate as m; print(m.__file__)"],
            env=release.env(os.environ), cwd=release.root, capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        assert where.startswith(str(release.root)), where  # not this checkout's code
    finally:
        release.remove()
    listed = subprocess.run(["git", "-C", str(REPO), "worktree", "list"], capture_output=True, text=True).stdout
    assert str(release.root) not in listed and not release.root.parent.exists()
