"""The outbox: a lone put is sent before it returns; puts made during a send wait for it and go
together (the outbox's thread, every linger), in order, each id once per message; a failing send
never leaves the outbox stuck; a full batch never waits out the linger."""

from __future__ import annotations

import threading
import time

import pytest

from k8s_dispatch.ops.processes import wait_until
from k8s_dispatch.tasks.outbox import Outbox


class Sent:
    def __init__(self) -> None:
        self.messages: list[list[str]] = []
        self.lock = threading.Lock()

    def __call__(self, ids: list[str]) -> None:
        with self.lock:
            self.messages.append(ids)


def test_a_lone_put_is_sent_before_it_returns_in_messages_of_the_batch():
    sent = Sent()
    outbox = Outbox(sent, batch=3)
    outbox.put(["a"])
    assert sent.messages == [["a"]]
    outbox.put([f"b{i}" for i in range(7)])
    assert sent.messages == [["a"], ["b0", "b1", "b2"], ["b3", "b4", "b5"], ["b6"]]
    outbox.put([])
    assert len(sent.messages) == 4 and outbox.handoffs == 0


def test_a_repeated_id_goes_once_per_message():
    sent = Sent()
    Outbox(sent, batch=50).put(["a", "b", "a"])
    assert sent.messages == [["a", "b"]]


def test_puts_made_while_a_send_is_under_way_wait_for_it_and_go_together():
    release, in_send = threading.Event(), threading.Event()
    sent = Sent()

    def send(ids: list[str]) -> None:
        if not sent.messages:  # the first send blocks until the other puts are in
            in_send.set()
            assert release.wait(10)
        sent(ids)

    outbox = Outbox(send, batch=4, linger_s=0.01)
    first = threading.Thread(target=outbox.put, args=(["t0"],))
    first.start()
    assert in_send.wait(10)
    for i in range(1, 7):
        outbox.put([f"t{i}"])  # returns at once: a send is under way
    assert sent.messages == []
    release.set()
    first.join(10)
    wait_until(lambda: sum(map(len, sent.messages)) == 7, timeout=10, interval=0.01, what="all sent")
    # The first message alone, then the six waiting ones, 4 per message, in order.
    assert sent.messages == [["t0"], ["t1", "t2", "t3", "t4"], ["t5", "t6"]]
    assert outbox.handoffs == 1
    wait_until(lambda: not outbox._sending, timeout=10, interval=0.01, what="the outbox idle")
    outbox.put(["later"])  # idle again: sent by the putting thread
    assert sent.messages[-1] == ["later"]


def test_a_full_batch_waiting_goes_at_once_not_after_the_linger():
    release, in_send = threading.Event(), threading.Event()
    sent = Sent()

    def send(ids: list[str]) -> None:
        if not sent.messages:
            in_send.set()
            assert release.wait(10)
        sent(ids)

    outbox = Outbox(send, batch=4, linger_s=2.0, idle_lingers=1)
    first = threading.Thread(target=outbox.put, args=(["t0"],))
    first.start()
    assert in_send.wait(10)
    outbox.put(["t1"])  # waits: the outbox's thread takes over, lingering 2 s
    release.set()
    first.join(10)
    assert outbox.handoffs == 1 and sent.messages == [["t0"]]
    put_at = time.monotonic()
    outbox.put(["t2", "t3", "t4"])  # 4 waiting: a full message, sent now
    wait_until(lambda: len(sent.messages) == 2, timeout=10, interval=0.01, what="the full batch sent")
    assert time.monotonic() - put_at < 1.0  # well inside the linger
    assert sent.messages[1] == ["t1", "t2", "t3", "t4"]


def test_a_send_that_raises_passes_to_the_putter_and_the_next_put_sends_again():
    sent = Sent()
    fail = [True]

    def send(ids: list[str]) -> None:
        if fail[0]:
            fail[0] = False
            raise RuntimeError("broker gone")
        sent(ids)

    outbox = Outbox(send, batch=10)
    with pytest.raises(RuntimeError):
        outbox.put(["lost"])  # left to the recovery sweep
    outbox.put(["next"])
    assert sent.messages == [["next"]]


def test_many_threads_putting_at_once_send_every_id_exactly_once():
    sent = Sent()
    outbox = Outbox(sent, batch=50, linger_s=0.001)
    ids = [[f"{t}-{i}" for i in range(200)] for t in range(8)]

    def work(mine: list[str]) -> None:
        for one in mine:
            outbox.put([one])

    threads = [threading.Thread(target=work, args=(mine,)) for mine in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wait_until(lambda: sum(map(len, sent.messages)) >= 1600, timeout=10, interval=0.01, what="all sent")
    flat = [i for m in sent.messages for i in m]
    assert sorted(flat) == sorted(i for mine in ids for i in mine)
    assert all(len(m) <= 50 for m in sent.messages)
    for mine in ids:  # each thread's ids in the order it put them
        assert [i for i in flat if i in set(mine)] == mine
