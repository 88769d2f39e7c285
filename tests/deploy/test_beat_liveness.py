"""Beat's liveness probe, as deploy/ and the chart write it, run against a real `celery beat`.

Beat touches its heartbeat file after each tick (`tasks/heartbeat.py`). The probe's shell line
must pass while beat ticks, fail once beat stops ticking (SIGSTOP: alive but stuck, as in a hung
publish, the case a dead process's exit does not cover), and pass again when it resumes. The
test runs the manifest's own command, with only its age threshold lowered to keep the test short.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import uuid
from pathlib import Path

import pytest
from deploy_files import DEPLOY, load_docs, render_chart

from k8s_dispatch.engine.settings import Settings
from k8s_dispatch.ops import processes
from k8s_dispatch.tasks.heartbeat import HEARTBEAT_FILE

START_S = 60.0  # a cold `celery beat` on a busy 2-core machine
TEST_MAX_AGE_S = 3
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
        match = _THRESHOLD.search(script)
        assert match is not None, script
        # Beat ticks at least once per poll interval: a few missed ticks are not a restart.
        assert int(match[1]) >= 10 * Settings.model_fields["poll_interval_s"].default


def _probe(script: str, tmp_path: Path) -> int:
    short = _THRESHOLD.sub(f"-lt {TEST_MAX_AGE_S}", script)
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    return subprocess.run(["sh", "-c", short], env=env, capture_output=True, timeout=10, check=False).returncode


@pytest.fixture
def beat(redis_url: str, key_prefix: str, tmp_path: Path) -> processes.ManagedProcess:
    env = {
        "K8S_DISPATCH_REDIS_URL": redis_url,
        "K8S_DISPATCH_KEY_PREFIX": f"{key_prefix}-{uuid.uuid4().hex[:6]}",
        "K8S_DISPATCH_POLL_INTERVAL_S": "0.2",
        "TMPDIR": str(tmp_path),
    }
    process = processes.celery_beat(env=env, log_dir=tmp_path).start()
    yield process
    process.kill(signal.SIGCONT)
    process.kill(signal.SIGKILL)


def test_the_probe_passes_while_beat_ticks_and_fails_once_it_stops(
    beat: processes.ManagedProcess, tmp_path: Path
) -> None:
    heartbeat = tmp_path / HEARTBEAT_FILE
    script = _kustomize_probes()["livenessProbe"][2]
    assert _probe(script, tmp_path) != 0  # no heartbeat yet: not alive

    processes.wait_until(heartbeat.exists, timeout=START_S, interval=0.1, what="a first tick", details=beat.log_tail)
    first = heartbeat.stat().st_mtime_ns
    processes.wait_until(
        lambda: heartbeat.stat().st_mtime_ns > first, timeout=10, interval=0.05, what="the heartbeat advancing"
    )
    assert _probe(script, tmp_path) == 0
    assert beat.alive

    beat.kill(signal.SIGSTOP)  # alive, not ticking
    stopped = heartbeat.stat().st_mtime_ns
    processes.wait_until(
        lambda: _probe(script, tmp_path) != 0, timeout=TEST_MAX_AGE_S + 10, interval=0.2, what="the probe failing"
    )
    assert heartbeat.stat().st_mtime_ns == stopped
    assert beat.alive  # the process is there: only the heartbeat tells that it stopped

    beat.kill(signal.SIGCONT)
    processes.wait_until(
        lambda: _probe(script, tmp_path) == 0, timeout=10, interval=0.1, what="the probe passing again"
    )
