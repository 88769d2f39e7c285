"""`celery -A k8s_dispatch.tasks beat` stops on SIGTERM wherever the signal lands, under CPU load.

Celery's own beat handler raised SystemExit in the middle of a publish after closing the broker
connection. redis-py's clean-up then failed on the closed socket, and that error replaced the
SystemExit ("Message Error", or a silent reconnect). Beat went on sending until the supervisor
SIGKILLed it (`tasks.app._stop_beat_between_ticks`). Each trial starts a real beat and SIGTERMs
it right after a "Sending due task" line, while its publish is most likely still running, and
again and again for a moment after (a second signal inside the first's handler deadlocked it).
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from k8s_dispatch.ops import processes

TRIALS = 20
EXIT_DEADLINE_S = 10.0  # a clean stop takes about 1 s here under load; the harness allows 30
START_S = 60.0  # a cold `celery beat` on a busy 2-core machine
SENDING = "Scheduler: Sending due task"
SIGTERM_BURST_S = 0.02


@pytest.fixture
def cpu_hogs() -> Iterator[None]:
    """Two busy loops in other processes (the machine has two cores) for the test's duration."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def test_beat_exits_on_sigterm_at_random_moments_under_load(deploy, sim_cluster, cpu_hogs, tmp_path) -> None:
    d = deploy(sim_cluster)  # polls every 0.2 s, as every task test's beat
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    failures = []
    for trial in range(TRIALS):
        beat = processes.celery_beat(env=d.env, log_dir=tmp_path, name=f"beat-{trial}").start()
        try:
            sends = rng.randint(1, 4)

            def sent_enough(beat: processes.ManagedProcess = beat, sends: int = sends) -> bool:
                if not beat.alive:
                    pytest.fail(f"beat exited with {beat.returncode} before sending\n{beat.log_tail()}")
                return beat.log_path.read_text(errors="replace").count(SENDING) >= sends

            processes.wait_until(
                sent_enough, timeout=START_S, interval=0.001, what=f"{sends} sends", details=beat.log_tail
            )
            # Mostly mid-send (right after the line, before the publish is done), sometimes between ticks.
            time.sleep(rng.choice([0.0, 0.0, rng.uniform(0.0, 0.005), rng.uniform(0.0, 0.2)]))
            assert beat.popen is not None
            # Then more for 20 ms, as a supervisor or a teardown may send it again: one landing
            # inside the first's handler must not deadlock it (about 1 in 4 did).
            repeat_until = time.monotonic() + SIGTERM_BURST_S
            beat.kill(signal.SIGTERM)
            while time.monotonic() < repeat_until:
                beat.kill(signal.SIGTERM)
            started = time.monotonic()
            try:
                code: int | None = beat.popen.wait(EXIT_DEADLINE_S)
            except subprocess.TimeoutExpired:
                code = None  # still running: SIGKILLed below, as a supervisor would
            took = time.monotonic() - started
            log = beat.log_path.read_text(errors="replace")
            if code not in (0, -signal.SIGTERM) or "Message Error" in log:
                failures.append(f"trial {trial}: exit {code} after {took:.1f}s\n{beat.log_tail(30)}")
        finally:
            beat.kill(signal.SIGKILL)
    assert not failures, f"seed {seed}: {len(failures)}/{TRIALS} SIGTERMs not obeyed cleanly\n" + "\n".join(failures)
