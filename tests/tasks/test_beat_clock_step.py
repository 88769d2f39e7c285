"""Beat keeps its intervals when its host's wall clock steps back (NTP, a VM resumed).

A real `celery -A k8s_dispatch.tasks beat` runs under libfaketime, its wall clock read from a
file the test changes (`tests/stepped_clock.py`); its monotonic clock stays true. After a
60 s step back, poll, admit, cleanup and sweep messages go on landing in Redis at their
intervals: Celery's wall-clock scheduler sent none of them for the length of the step.
"""

from __future__ import annotations

import json
import signal
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from stepped_clock import SteppedClock

from k8s_dispatch import celeryconfig as names
from k8s_dispatch.ops import processes

START_S = 90.0  # a cold beat under libfaketime on a busy 2-core machine
STEP_S = 60
POLL_S = 0.2
SWEEP_S = 1.0
# Sends wanted after the step, each well under what the intervals give in AFTER_STEP_S (and none
# of them reachable by a scheduler stalled for the step's 60 s).
WANTED = {names.POLL_TASK: 15, names.ADMIT_TASK: 15, names.CLEANUP_TASK: 3, names.SWEEP_TASK: 3}
AFTER_STEP_S = 30.0


class SweepQueue:
    """The messages beat left in its (unconsumed) sweep queue, counted by task name."""

    def __init__(self, redis_url: str, prefix: str) -> None:
        self.client = redis.Redis.from_url(redis_url)
        self.key = f"{prefix}:{names.SWEEP_QUEUE}"

    def sent(self) -> Counter[str]:
        return Counter(json.loads(raw)["headers"]["task"] for raw in self.client.lrange(self.key, 0, -1))


@pytest.fixture
def beat_under_stepped_clock(
    redis_url: str, key_prefix: str, tmp_path: Path
) -> Iterator[tuple[processes.ManagedProcess, SteppedClock, SweepQueue]]:
    clock = SteppedClock(tmp_path)
    prefix = f"{key_prefix}-{uuid.uuid4().hex[:6]}"
    env = {
        "K8S_DISPATCH_REDIS_URL": redis_url,
        "K8S_DISPATCH_KEY_PREFIX": prefix,
        "K8S_DISPATCH_POLL_INTERVAL_S": str(POLL_S),
        "K8S_DISPATCH_SWEEP_INTERVAL_S": str(SWEEP_S),
        "TMPDIR": str(tmp_path),
        **clock.env(),
    }
    beat = processes.celery_beat(env=env, log_dir=tmp_path).start()
    queue = SweepQueue(redis_url, prefix)
    try:
        yield beat, clock, queue
    finally:
        beat.kill(signal.SIGKILL)
        queue.client.delete(queue.key)
        queue.client.close()


def test_beat_sends_on_schedule_through_a_step_back_of_its_wall_clock(beat_under_stepped_clock) -> None:
    beat, clock, queue = beat_under_stepped_clock
    processes.wait_until(
        lambda: all(queue.sent()[task] >= 1 for task in WANTED),
        timeout=START_S,
        what="beat sending every entry",
        details=beat.log_tail,
    )

    clock.step(f"-{STEP_S}s")
    assert abs(clock.offset_seen() + STEP_S) < 5, "the step did not take hold"
    before = queue.sent()

    def caught_up() -> bool:
        if not beat.alive:
            pytest.fail(f"beat exited with {beat.returncode}\n{beat.log_tail()}")
        sent = queue.sent()
        return all(sent[task] - before[task] >= wanted for task, wanted in WANTED.items())

    processes.wait_until(
        caught_up,
        timeout=AFTER_STEP_S,
        interval=0.2,
        what=f"every entry sent on through the {STEP_S} s step back",
        details=lambda: f"sent since the step: {queue.sent() - before}\n{beat.log_tail()}",
    )
