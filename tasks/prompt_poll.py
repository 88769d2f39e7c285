"""Poll at once when a kept watch receives a finished Job, not at beat's next tick.

Poll's watch streams stay open between polls, each read by a thread of its own
(`delivery.jobwatch.hold`). When one receives what a poll would hand off (a Job finished, a map's
item ended), it rings this process's doorbell, and a poll of that namespace runs here at once:
under poll's lease, reading the stream already open (no request to the API server). A finished
Job is then handed off within a few milliseconds of its status, where it waited half a poll
interval on average. Nothing depends on it: beat's polls go on as before, and a ring that is
lost (the process stopped, the lease held too long) costs at most one interval.

Rings that come close together are answered by one poll, at most one per `gap_s`: under a steady
stream of completions the polls run every `gap_s`, and their hand-offs are batches, not one
message per Job.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)

# Prompt polls run at most once per this share of the poll interval; that gap is never over GAP_MAX_S.
GAP_SHARE = 0.25
GAP_MAX_S = 0.5

RunPoll = Callable[[Sequence[str]], bool]  # poll these namespaces now; False: another poll holds the lease


def gap_s(poll_interval_s: float) -> float:
    """The least time between two prompt polls for a poll every `poll_interval_s` (pure)."""
    return min(GAP_MAX_S, GAP_SHARE * poll_interval_s)


class Doorbell:
    """Rings from any thread; one thread of its own runs `run` for the namespaces rung since its
    last run, no sooner than `gap_s` after it. A run refused (the lease is held: a poll is under
    way) is tried again after `gap_s`; a ring older than `give_up_s` is dropped, as a poll of
    beat's has read its namespace since."""

    def __init__(self, run: RunPoll, *, gap_s: float, give_up_s: float) -> None:
        self._run, self._gap_s, self._give_up_s = run, gap_s, give_up_s
        self._lock = threading.Lock()
        self._rung: dict[str, float] = {}  # namespace -> when it was first rung (monotonic)
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_run = -float("inf")
        self.runs = 0  # how many polls it ran
        self.dropped = 0  # how many rings it left to beat's polls (too old)

    def ring(self, namespace: str) -> None:
        with self._lock:
            self._rung.setdefault(namespace, time.monotonic())
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="prompt-poll", daemon=True)
                self._thread.start()
        self._wake.set()

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            early = self._last_run + self._gap_s - time.monotonic()
            if early > 0:
                time.sleep(early)  # the gap: rings that come meanwhile are answered by the same run
            with self._lock:
                self._wake.clear()
                now = time.monotonic()
                due = {ns: at for ns, at in self._rung.items() if now - at <= self._give_up_s}
                self.dropped += len(self._rung) - len(due)
                self._rung = {}
            if not due:
                continue
            self._last_run = time.monotonic()
            try:
                ran = self._run(sorted(due))
            except Exception:  # a poll's own failure: beat's next one goes on
                log.exception("a prompt poll of %s failed", sorted(due))
                ran = True
            if ran:
                self.runs += 1
                continue
            with self._lock:  # another poll is under way: again after the gap, unless rung anew
                for namespace, at in due.items():
                    self._rung.setdefault(namespace, at)
            self._wake.set()
