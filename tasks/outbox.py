"""Committed dispatch ids on their way to the broker, coalesced across transactions.

An engine that writes one dispatch per transaction would pay a broker message, and the worker
its per-message costs (three transactions, task events, an ack), per dispatch. Here the thread
that commits sends at once when no send is under way, so a lone transaction is sent before its
commit returns, as before. Ids other threads commit meanwhile wait: when that send is done, a
thread of the outbox's own takes over and sends what waits every `linger_s`, up to `batch` ids
a message, until nothing waits. Only committed ids are ever put here: "enqueued only after
commit" holds; a process killed with ids waiting leaves them to the recovery sweep, as a kill
between a commit and its send always did.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)

# How long the outbox's thread lets ids gather while commits keep coming: at 400 commits/s,
# 8 per message (the worker's cost per Job falls from ~6 ms at 1 per message to ~1.3), and
# never more than this added to a Job's creation, only while several threads commit at once.
LINGER_S = 0.02


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
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._send, self._batch, self._linger_s, self._sleep = send, batch, linger_s, sleep
        self._lock = threading.Lock()
        self._pending: list[str] = []
        self._sending = False
        self.handoffs = 0  # times the outbox's thread took over (for tests and curiosity)

    def put(self, ids: Sequence[str]) -> None:
        """Queue `ids`; send them (with whatever waits) now unless a send is under way."""
        with self._lock:
            self._pending.extend(ids)
            if self._sending or not self._pending:
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
        """The outbox's thread: send what gathered every `linger_s`, until nothing did."""
        try:
            while True:
                self._sleep(self._linger_s)
                with self._lock:
                    if not self._pending:
                        self._sending = False
                        return
                    batches = self._take()
                for batch in batches:
                    self._send(batch)
        except Exception:
            log.exception("the outbox's thread failed; the recovery sweep creates what it had not sent")
            with self._lock:
                self._sending = False
