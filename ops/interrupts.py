"""Ctrl-C and SIGTERM for the long-running commands (demo, chaos): both stop the run the same
way, so its clean-up runs, and neither gets lost.

Python raises the signal's KeyboardInterrupt wherever the main thread is; if that is inside a
garbage-collection callback (a weakref finaliser), Python prints "Exception ignored in ..."
and drops it, and the run would go on as if nothing had been asked. So the signal is also
remembered, and `check()` raises it again at the run's next step.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

_ASKED = threading.Event()


@contextmanager
def interrupts() -> Iterator[None]:
    """While inside, SIGINT and SIGTERM raise KeyboardInterrupt and are remembered for `check()`
    (main thread only: elsewhere signals cannot be handled, and this does nothing)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, _frame: FrameType | None) -> None:
        _ASKED.set()
        raise KeyboardInterrupt(f"signal {signum}")

    _ASKED.clear()
    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def check() -> None:
    """Raise KeyboardInterrupt if a signal asked to stop (its first one may have been dropped)."""
    if _ASKED.is_set():
        raise KeyboardInterrupt("signal received earlier")
