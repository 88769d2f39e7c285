"""The API budget's arithmetic (a token bucket with a pause), on a fake clock: no waiting."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

from k8s_dispatch.core.errors import ConfigError
from k8s_dispatch.core.settings import Settings, load_settings
from k8s_dispatch.workers import budget
from k8s_dispatch.workers.budget import Budget
from k8s_dispatch.workers.kube import RETRY_AFTER_MAX_S, retry_after_s


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def bucket(qps: float, burst: int) -> tuple[Budget, Clock]:
    clock = Clock()
    return Budget(qps, burst, clock=clock, sleep=clock.sleep), clock


# (qps, burst, reservations at the same instant) -> the wait each is given
@pytest.mark.parametrize(
    ("qps", "burst", "n", "waits"),
    [
        (10, 3, 5, [0, 0, 0, 0.1, 0.2]),  # the burst at once, then one every 1/qps
        (2, 1, 3, [0, 0.5, 1.0]),
        (0, 1, 4, [0, 0, 0, 0]),  # 0: unlimited
        (100, 100, 100, [0] * 100),
    ],
)
def test_reservations_at_one_instant(qps, burst, n, waits):
    b, _ = bucket(qps, burst)
    assert [round(b.reserve(), 9) for _ in range(n)] == waits


def test_tokens_come_back_at_qps_and_never_beyond_the_burst():
    b, clock = bucket(10, 3)
    assert [b.reserve() for _ in range(3)] == [0, 0, 0]
    clock.now += 0.25  # 2.5 tokens back
    assert [round(b.reserve(), 9) for _ in range(3)] == [0, 0, 0.05]
    clock.now += 3600  # an hour idle saves up the burst, not 36,000
    assert [round(b.reserve(), 9) for _ in range(4)] == [0, 0, 0, 0.1]


def test_acquire_sleeps_its_wait_and_says_how_long():
    b, clock = bucket(4, 1)
    assert b.acquire() == 0 and clock.slept == []
    assert b.acquire() == pytest.approx(0.25)
    assert clock.slept == [pytest.approx(0.25)]


def test_a_pause_holds_every_request_then_resumes_at_qps_without_a_burst():
    b, _ = bucket(10, 5)
    b.pause(2.0)
    waits = [round(b.reserve(), 9) for _ in range(3)]
    # Nothing before the pause ends; then one per 1/qps, though 5 tokens were saved before it.
    assert waits == [2.1, 2.2, 2.3]
    b2, _ = bucket(0, 1)  # unlimited: only the pause holds
    b2.pause(1.5)
    assert [b2.reserve() for _ in range(2)] == [1.5, 1.5]


def test_a_shorter_pause_never_cuts_a_longer_one():
    b, _ = bucket(0, 1)
    b.pause(3.0)
    b.pause(1.0)
    assert b.reserve() == 3.0


def test_a_thread_asleep_for_its_token_also_waits_out_a_pause_begun_meanwhile():
    clock = Clock()

    def sleep(seconds: float) -> None:
        if not clock.slept:  # while this thread sleeps, another's request meets a 429
            b.pause(5.0)
        clock.sleep(seconds)

    b = Budget(10, 1, clock=clock, sleep=sleep)
    b.reserve()  # the burst spent: the next one waits 0.1 s
    waited = b.acquire()
    assert waited == pytest.approx(5.0)  # the pause began at its start, so it ends 5 s after it
    assert clock.now == pytest.approx(105.0)


def test_reconfiguring_changes_the_rate_from_now_on():
    b, _ = bucket(10, 5)
    b.configure(1, 2)
    assert (b.qps, b.burst) == (1.0, 2)
    assert [round(b.reserve(), 9) for _ in range(3)] == [0, 0, 1.0]


@pytest.mark.parametrize(("qps", "burst"), [(-1, 10), (10, 0)])
def test_a_budget_refuses_values_that_would_stop_every_request(qps, burst):
    with pytest.raises(ValueError):
        Budget(qps, burst)


def test_the_process_has_one_budget_whatever_asks_for_it():
    first = budget.shared()
    saved = (first.qps, first.burst)
    try:
        assert budget.shared() is first
        assert budget.shared(25, 50) is first and (first.qps, first.burst) == (25.0, 50)
    finally:
        first.configure(*saved)


def test_the_settings_defaults_are_the_budget_modules():
    fields = Settings.model_fields
    assert fields["kube_qps"].default == budget.DEFAULT_QPS
    assert fields["kube_burst"].default == budget.DEFAULT_BURST
    settings = load_settings({"K8S_DISPATCH_KUBE_QPS": "0", "K8S_DISPATCH_KUBE_BURST": "7"})
    assert (settings.kube_qps, settings.kube_burst) == (0, 7)


@pytest.mark.parametrize(
    ("variable", "value"),
    [("K8S_DISPATCH_KUBE_QPS", "-1"), ("K8S_DISPATCH_KUBE_QPS", "many"), ("K8S_DISPATCH_KUBE_BURST", "0")],
)
def test_a_bad_budget_setting_stops_the_process_naming_it(variable, value):
    with pytest.raises(ConfigError, match=variable):
        load_settings({variable: value})


@pytest.mark.parametrize(
    ("status", "headers", "expected"),
    [
        (429, {"Retry-After": "2"}, 2.0),
        (429, {"Retry-After": "0.5"}, 0.5),
        (429, {"Retry-After": "0"}, 0.0),
        (429, {"Retry-After": "3600"}, RETRY_AFTER_MAX_S),  # bounded
        (429, {"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}, None),  # a date: our clock vs theirs
        (429, {"Retry-After": "-1"}, None),
        (429, {"Retry-After": "nan"}, None),
        (429, {}, None),
        (429, None, None),
        (503, {"Retry-After": "1"}, None),  # only a 429 says "you, slow down"
        (500, {"Retry-After": "1"}, None),
    ],
)
def test_what_a_retry_after_asks(status, headers, expected):
    assert retry_after_s(status, headers) == expected


# --- the real wait ---------------------------------------------------------------------------


def test_a_retry_after_pause_is_waited_out_in_a_process_off_the_true_clock():
    """A worker run off the true clock (libfaketime, as the chaos run and the clock-skew tests
    run one) waits out a 429's pause: `time.sleep` fails there with EINVAL (its absolute
    monotonic deadline), which escaped a task as an unexpected OSError."""
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketimeMT.so.1"))
    assert found, "libfaketime is not installed: run tests/services.sh (apt-get install faketime)"
    env = {**os.environ, "LD_PRELOAD": found[0], "FAKETIME": "+600s", "DONT_FAKE_MONOTONIC": "1"}
    program = (
        "import time\n"
        "from k8s_dispatch.workers.budget import Budget\n"
        "b = Budget(100, 1)\n"
        "b.pause(0.2)\n"
        "start = time.monotonic()\n"
        "b.acquire()\n"
        "print(round(time.monotonic() - start, 2))\n"
    )
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert 0.15 <= float(done.stdout) < 5
