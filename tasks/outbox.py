"""Committed dispatch ids on their way to the broker, coalesced across transactions.

An engine that writes one dispatch per transaction would pay a broker message, and the worker
its per-message costs (three transactions, task events, an ack), per dispatch. Here the thread
that commits sends at once when no send is under way, so a lone transaction is sent before its
commit returns, as before. Ids other threads commit meanwhile wait: when that send is done, a
thread of the outbox's own takes over and sends what waits every `linger_s` (or as soon as
`batch` ids wait), up to `batch` ids a message, until nothing came for IDLE_LINGERS lingers. Only committed ids are ever put here: "enqueued only after
commit" holds; a process killed with ids waiting leaves them to the recovery sweep, as a kill
between a commit and its send always did.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)

# How long the outbox's thread lets ids gather while commits keep coming: a message costs the
# engine and the worker about the same whatever its size, so ids that arrive together share one;
# never more than this is added to a Job's creation, only while several threads commit at once;
# `batch` ids waiting go at once.
LINGER_S = 0.05
# Lingers with nothing gathered before the outbox's thread stops and commits send again
# themselves: a steady stream of commits never falls back to a message each.
IDLE_LINGERS = 3


class Outbox:
    """Ids to send with `send(ids)`, at most `batch` per call, in the order they were put.

    `send` must not raise for a broker that is down (log and return: the recovery sweep creates
    what a lost message would have); what it raises anyway passes to the putting thread (or is
    logged by the outbox's), and the ids of that batch are left to the sweep.
    """

    def __init__(
        self,
        send: Callable[[list[str]], None],
        *,
        batch: int,
        linger_s: float = LINGER_S,
        idle_lingers: int = IDLE_LINGERS,
    ) -> None:
        self._send, self._batch, self._linger_s, self._idle_lingers = send, batch, linger_s, idle_lingers
        self._lock = threading.Lock()
        self._full = threading.Condition(self._lock)  # `batch` ids wait: the outbox's thread sends now
        self._pending: list[str] = []
        self._sending = False
        self.handoffs = 0  # times the outbox's thread took over (for tests and curiosity)

    def put(self, ids: Sequence[str]) -> None:
        """Queue `ids`; send them (with whatever waits) now unless a send is under way."""
        with self._lock:
            self._pending.extend(ids)
            if self._sending:
                if len(self._pending) >= self._batch:
                    self._full.notify()
                return
            if not self._pending:
                return
            self._sending = True
            batches = self._take()
        try:
            for batch in batches:
                self._send(batch)
        except BaseException:
            with self._lock:
                self._sending = False
            raise
        with self._lock:
            if not self._pending:
                self._sending = False
                return
            self.handoffs += 1
        threading.Thread(target=self._drain, name="k8s-dispatch-outbox", daemon=False).start()

    def _take(self) -> list[list[str]]:
        """Everything waiting, as messages of up to `batch` ids (a repeated id once); the lock held."""
        ids = list(dict.fromkeys(self._pending))
        self._pending.clear()
        return [ids[start : start + self._batch] for start in range(0, len(ids), self._batch)]

    def _drain(self) -> None:
        """The outbox's thread: send what gathered every `linger_s` (at once when `batch` ids
        did), until nothing did for `idle_lingers` lingers in a row."""
        idle = 0
        try:
            while True:
                with self._lock:
                    self._full.wait_for(lambda: len(self._pending) >= self._batch, timeout=self._linger_s)
                    if not self._pending:
                        idle += 1
                        if idle >= self._idle_lingers:
                            self._sending = False
                            return
                        continue
                    idle = 0
                    batches = self._take()
                for batch in batches:
                    self._send(batch)
        except Exception:
            log.exception("the outbox's thread failed; the recovery sweep creates what it had not sent")
            with self._lock:
                self._sending = False
