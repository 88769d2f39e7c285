"""The doorbell behind prompt polls (`tasks.prompt_poll`): rings answered by one run, no sooner
than the gap after the last, a refused run tried again, and a ring too old dropped."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from k8s_dispatch.tasks import prompt_poll
from k8s_dispatch.tasks.prompt_poll import Doorbell

WAIT_S = 10.0


class Runs:
    """A run that records each call (when, which namespaces) and answers as told."""

    def __init__(self, answers: Sequence[bool] = ()) -> None:
        self.calls: list[tuple[float, list[str]]] = []
        self.answers = list(answers)
        self.called = threading.Condition()
        self.hold = threading.Event()
        self.hold.set()
        self.entered = threading.Event()

    def __call__(self, namespaces: Sequence[str]) -> bool:
        self.entered.set()
        assert self.hold.wait(WAIT_S)
        with self.called:
            self.calls.append((time.monotonic(), list(namespaces)))
            self.called.notify_all()
        return self.answers.pop(0) if self.answers else True

    def wait_calls(self, n: int) -> list[tuple[float, list[str]]]:
        with self.called:
            assert self.called.wait_for(lambda: len(self.calls) >= n, WAIT_S), self.calls
            return list(self.calls)


def test_the_gap_is_a_share_of_the_poll_interval_and_never_long() -> None:
    assert prompt_poll.gap_s(1.0) == 0.25
    assert prompt_poll.gap_s(2.0) == 0.5
    assert prompt_poll.gap_s(30.0) == 0.5  # a long interval does not make a Job wait longer


def test_rings_while_a_run_is_under_way_are_answered_by_one_run_after_the_gap() -> None:
    runs = Runs()
    bell = Doorbell(runs, gap_s=0.3, give_up_s=WAIT_S)
    runs.hold.clear()  # the first run waits inside `run`
    bell.ring("a")
    assert runs.entered.wait(WAIT_S)
    for namespace in ("b", "c", "b"):
        bell.ring(namespace)
    runs.hold.set()
    first, second = runs.wait_calls(2)
    assert first[1] == ["a"]
    assert second[1] == ["b", "c"]  # each namespace once, in one run
    assert second[0] - first[0] >= 0.3 * 0.99  # not sooner than the gap after the last run
    with runs.called:
        assert runs.called.wait_for(lambda: bell.runs == 2, WAIT_S)


def test_a_run_refused_while_another_poll_holds_the_lease_is_tried_again() -> None:
    runs = Runs(answers=[False, False, True])
    bell = Doorbell(runs, gap_s=0.05, give_up_s=WAIT_S)
    bell.ring("ns")
    calls = runs.wait_calls(3)
    assert [namespaces for _, namespaces in calls] == [["ns"]] * 3
    with runs.called:
        assert runs.called.wait_for(lambda: bell.runs == 1, WAIT_S)


def test_a_ring_older_than_a_poll_interval_is_left_to_beats_poll() -> None:
    runs = Runs(answers=[False])
    bell = Doorbell(runs, gap_s=0.2, give_up_s=0.1)  # refused once; by the retry the ring is too old
    bell.ring("ns")
    runs.wait_calls(1)
    deadline = time.monotonic() + WAIT_S
    while bell.dropped == 0:
        assert time.monotonic() < deadline, "the old ring was never dropped"
        time.sleep(0.01)
    bell.ring("other")  # a new ring is answered, the old one is not
    calls = runs.wait_calls(2)
    assert calls[1][1] == ["other"]


def test_a_run_that_raises_does_not_stop_the_doorbell() -> None:
    calls: list[list[str]] = []
    raised, answered = threading.Event(), threading.Event()

    def run(namespaces: Sequence[str]) -> bool:
        calls.append(list(namespaces))
        if len(calls) == 1:
            raised.set()
            raise RuntimeError("the API went away")
        answered.set()
        return True

    bell = Doorbell(run, gap_s=0.01, give_up_s=WAIT_S)
    bell.ring("a")
    assert raised.wait(WAIT_S)
    bell.ring("b")
    assert answered.wait(WAIT_S)
    assert calls[-1] == ["b"]
