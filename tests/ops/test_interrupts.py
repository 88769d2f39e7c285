"""Ctrl-C and SIGTERM stop the demo and chaos runs even when Python drops the first
KeyboardInterrupt (raised inside a garbage-collection callback)."""

from __future__ import annotations

import os
import signal
import sys
import weakref

import pytest

from k8s_dispatch.ops import interrupts


class _Thing:
    pass


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_raises_keyboard_interrupt(sig: int) -> None:
    with interrupts.interrupts(), pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), sig)
        for _ in range(10_000_000):  # the handler runs at the next bytecode boundary
            pass


def test_a_signal_dropped_inside_a_gc_callback_is_raised_by_the_next_check() -> None:
    dropped: list[BaseException | None] = []
    hook, sys.unraisablehook = sys.unraisablehook, lambda unraisable: dropped.append(unraisable.exc_value)
    try:
        with interrupts.interrupts():
            interrupts.check()  # nothing asked yet
            thing = _Thing()
            ref = weakref.ref(thing, lambda _ref: [os.kill(os.getpid(), signal.SIGINT), sum(range(100_000))])
            del thing  # the callback runs now: its KeyboardInterrupt is dropped, as Python does
            assert ref() is None
            assert [type(e) for e in dropped] == [KeyboardInterrupt]
            with pytest.raises(KeyboardInterrupt):
                interrupts.check()
    finally:
        sys.unraisablehook = hook


def test_outside_the_block_the_previous_handlers_are_back() -> None:
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with interrupts.interrupts():
        assert signal.getsignal(signal.SIGINT) is not before[0]
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    interrupts.check()  # a new block starts clean: nothing was asked in this one
