"""Beat's liveness probe, as deploy/ and the chart write it, run against a real `celery beat`.

Beat writes the boot-time clock to its heartbeat file each time the broker takes a task
(`tasks/heartbeat.py`). The probe's shell line must pass while beat sends, and fail once it does
not: stopped (SIGSTOP: alive but stuck, as in a hung publish, the case a dead process's exit does
not cover) or ticking with no broker to send to (its own Redis killed); and pass again when it
resumes. The test runs the manifest's own command, with only its age threshold lowered to keep
the test short.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from deploy_files import DEPLOY, load_docs, render_chart

from k8s_dispatch.core.settings import Settings
from k8s_dispatch.ops import processes
from k8s_dispatch.tasks.heartbeat import HEARTBEAT_FILE, liveness_clock

START_S = 60.0  # a cold `celery beat` on a busy 2-core machine
TEST_MAX_AGE_S = 3
SENDING = "Scheduler: Sending due task"
_THRESHOLD = re.compile(r"-lt (\d+)$")


def _beat_probes(docs: list[dict]) -> dict[str, list[str]]:
    (beat,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-beat")]
    (container,) = beat["spec"]["template"]["spec"]["containers"]
    return {kind: container[kind]["exec"]["command"] for kind in ("livenessProbe", "readinessProbe")}


def _kustomize_probes() -> dict[str, list[str]]:
    return _beat_probes(load_docs(DEPLOY / "beat.yaml"))


def test_probes_check_the_heartbeat_file_with_a_margin_over_the_poll_interval(tmp_path: Path) -> None:
    chart = _beat_probes(render_chart(workdir=tmp_path))
    assert chart == _kustomize_probes()  # one probe in both
    for command in chart.values():
        shell, flag, script = command
        assert (shell, flag) == ("sh", "-c")
        assert f'"${{TMPDIR:-/tmp}}/{HEARTBEAT_FILE}"' in script
        assert "/proc/uptime" in script  # the clock beat writes (CLOCK_BOOTTIME), not the wall clock
        match = _THRESHOLD.search(script)
        assert match is not None, script
        # Beat sends a poll every poll interval: a few late ones are not a restart.
        assert int(match[1]) >= 10 * Settings.model_fields["poll_interval_s"].default


def _probe(script: str, tmp_path: Path) -> int:
    short = _THRESHOLD.sub(f"-lt {TEST_MAX_AGE_S}", script)
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    return subprocess.run(["sh", "-c", short], env=env, capture_output=True, timeout=10, check=False).returncode


@pytest.mark.parametrize(
    ("written_ago_s", "passes"),
    [(0.0, True), (TEST_MAX_AGE_S - 1.5, True), (TEST_MAX_AGE_S + 1.0, False), (-100.0, False), (None, False)],
)
def test_the_probe_ages_the_heartbeat_on_the_boot_time_clock(
    tmp_path: Path, written_ago_s: float | None, passes: bool
) -> None:
    """Fresh passes, old fails, one from the future (an earlier boot's) fails, none fails."""
    if written_ago_s is not None:
        (tmp_path / HEARTBEAT_FILE).write_text(f"{liveness_clock() - written_ago_s:.3f}\n")
    script = _kustomize_probes()["livenessProbe"][2]
    assert (_probe(script, tmp_path) == 0) is passes


def _beat_env(redis_url: str, key_prefix: str, tmp_path: Path) -> dict[str, str]:
    return {
        "K8S_DISPATCH_REDIS_URL": redis_url,
        "K8S_DISPATCH_KEY_PREFIX": f"{key_prefix}-{uuid.uuid4().hex[:6]}",
        "K8S_DISPATCH_POLL_INTERVAL_S": "0.2",
        "TMPDIR": str(tmp_path),
    }


@pytest.fixture
def beat(redis_url: str, key_prefix: str, tmp_path: Path) -> Iterator[processes.ManagedProcess]:
    process = processes.celery_beat(env=_beat_env(redis_url, key_prefix, tmp_path), log_dir=tmp_path).start()
    yield process
    process.kill(signal.SIGCONT)
    process.kill(signal.SIGKILL)


def _wait_first_send(beat: processes.ManagedProcess, heartbeat: Path) -> None:
    processes.wait_until(heartbeat.exists, timeout=START_S, interval=0.1, what="a first send", details=beat.log_tail)
    first = heartbeat.read_text()
    processes.wait_until(
        lambda: heartbeat.read_text() != first, timeout=10, interval=0.05, what="the heartbeat advancing"
    )


def test_the_probe_passes_while_beat_sends_and_fails_once_it_stops(
    beat: processes.ManagedProcess, tmp_path: Path
) -> None:
    heartbeat = tmp_path / HEARTBEAT_FILE
    script = _kustomize_probes()["livenessProbe"][2]
    assert _probe(script, tmp_path) != 0  # no heartbeat yet: not alive

    _wait_first_send(beat, heartbeat)
    assert _probe(script, tmp_path) == 0
    assert beat.alive

    beat.kill(signal.SIGSTOP)  # alive, not ticking
    stopped = heartbeat.read_text()
    processes.wait_until(
        lambda: _probe(script, tmp_path) != 0, timeout=TEST_MAX_AGE_S + 10, interval=0.2, what="the probe failing"
    )
    assert heartbeat.read_text() == stopped
    assert beat.alive  # the process is there: only the heartbeat tells that it stopped

    beat.kill(signal.SIGCONT)
    processes.wait_until(
        lambda: _probe(script, tmp_path) == 0, timeout=10, interval=0.1, what="the probe passing again"
    )


@dataclass
class OwnRedis:
    """A Redis server of this test's alone, to kill and start again on its port."""

    process: processes.ManagedProcess
    url: str

    def start(self) -> None:
        self.process.start()
        log = self.process.log_path
        processes.wait_until(lambda: log.read_bytes().count(b"Ready to accept") == self.process.starts, timeout=30)


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[OwnRedis]:
    server = shutil.which("redis-server")
    if server is None:
        pytest.fail("redis-server is not installed: run tests/services.sh")
    port = processes.free_port()
    argv = [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    redis = OwnRedis(
        processes.ManagedProcess("redis", argv, dict(os.environ), tmp_path / "redis.log"), f"redis://127.0.0.1:{port}/0"
    )
    redis.start()
    yield redis
    redis.process.kill(signal.SIGKILL)


def test_the_probe_fails_while_beat_ticks_with_no_broker_and_passes_once_it_is_back(
    own_redis: OwnRedis, key_prefix: str, tmp_path: Path
) -> None:
    """A beat whose sends fail is not alive, though it ticks on: the heartbeat is a send, not a tick."""
    beat = processes.celery_beat(env=_beat_env(own_redis.url, key_prefix, tmp_path), log_dir=tmp_path).start()

    def attempts() -> int:
        return beat.log_path.read_text(errors="replace").count(SENDING)

    try:
        heartbeat = tmp_path / HEARTBEAT_FILE
        script = _kustomize_probes()["livenessProbe"][2]
        _wait_first_send(beat, heartbeat)
        assert _probe(script, tmp_path) == 0

        own_redis.process.kill(signal.SIGKILL)
        attempted = attempts()
        processes.wait_until(
            lambda: _probe(script, tmp_path) != 0,
            timeout=TEST_MAX_AGE_S + 10,
            interval=0.2,
            what="the probe failing with no broker",
            details=beat.log_tail,
        )
        # Beat lives and ticks on, trying to send: only the failed sends tell that it is of no use.
        processes.wait_until(lambda: attempts() >= attempted + 3, timeout=30, what="beat ticking on")
        assert beat.alive

        own_redis.start()
        processes.wait_until(
            lambda: _probe(script, tmp_path) == 0,
            timeout=60,
            interval=0.2,
            what="the probe passing once the broker is back",
            details=beat.log_tail,
        )
    finally:
        beat.kill(signal.SIGKILL)
