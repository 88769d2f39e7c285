"""`store.db.database_now` is PostgreSQL's clock, whatever this host's wall clock does.

A real process (not this one) reads `database_now` while libfaketime steps its wall clock by
±700 s between two reads, within one refresh interval; the value stays within a second of the
server's `clock_timestamp()`. Plus the carry-forward itself, as a table.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from stepped_clock import SteppedClock

from k8s_dispatch.ops import processes
from k8s_dispatch.store.db import DB_CLOCK_REFRESH_S, DatabaseClockReading

STEP_S = 700  # past the start clock (600 s) a step used to fail a waiting Job on
AGREE_S = 1.0

# Answers each line on stdin with database_now, the server's clock and its own wall clock.
_READER = """
import json, sys, time
import sqlalchemy as sa
from k8s_dispatch.store.db import database_now, make_engine, make_sessionmaker, transaction

sessions = make_sessionmaker(make_engine(sys.argv[1], pool_size=1, max_overflow=0))
for _ in sys.stdin:
    with transaction(sessions) as session:
        ours = database_now(session)
        theirs = session.execute(sa.select(sa.func.clock_timestamp())).scalar_one()
    print(json.dumps({"ours": ours.timestamp(), "theirs": theirs.timestamp(), "wall": time.time()}), flush=True)
"""


class Reader:
    """The reading process, asked one line at a time."""

    def __init__(self, pg_url: str, clock: SteppedClock) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", _READER, pg_url],
            env=processes.project_env(clock.env()),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def read(self) -> dict[str, float]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write("read\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        assert line, f"the reader exited ({self.process.poll()})"
        answer: dict[str, float] = json.loads(line)
        answer["true"] = time.time()
        return answer

    def close(self) -> None:
        self.process.kill()
        self.process.communicate(timeout=10)  # reaps it and closes both pipes


@pytest.fixture
def clock(tmp_path: Path) -> SteppedClock:
    return SteppedClock(tmp_path)


@pytest.fixture
def reader(pg_url: str, clock: SteppedClock):
    process = Reader(pg_url, clock)
    yield process
    process.close()


@pytest.mark.parametrize("step", [f"+{STEP_S}s", f"-{STEP_S}s"])
def test_a_step_of_this_hosts_wall_clock_leaves_database_now_on_the_databases_clock(
    clock: SteppedClock, reader: Reader, step: str
) -> None:
    started = time.monotonic()
    first = reader.read()  # the reading database_now carries forward
    assert abs(first["ours"] - first["theirs"]) < AGREE_S
    assert abs(first["wall"] - first["true"]) < AGREE_S

    clock.step(step)

    def stepped() -> dict[str, float] | None:
        answer = reader.read()
        return answer if abs(answer["wall"] - answer["true"]) > STEP_S / 2 else None

    after = processes.wait_until(stepped, timeout=10, what="the reader's wall clock stepped")
    assert abs(after["wall"] - after["true"] - float(step[:-1])) < 5  # the step took hold
    assert time.monotonic() - started < DB_CLOCK_REFRESH_S  # no fresh reading in between
    assert abs(after["ours"] - after["theirs"]) < AGREE_S, (after["ours"] - after["theirs"], step)


T0 = datetime(2026, 12, 2, 6, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("read_at", "now", "expected"),
    [
        (100.0, 100.0, T0),
        (100.0, 130.5, T0 + timedelta(seconds=30.5)),
        (100.0, 99.0, T0 - timedelta(seconds=1)),  # a read that started before the reading's midpoint
    ],
)
def test_a_reading_is_carried_forward_by_the_monotonic_clock(read_at: float, now: float, expected: datetime) -> None:
    assert DatabaseClockReading(monotonic_s=read_at, database=T0).at(now) == expected
