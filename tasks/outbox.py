"""Committed dispatch ids on their way to the broker, coalesced across transactions.

An engine that writes one dispatch per transaction would pay a broker message (and the worker
its per-message costs) per dispatch. Here the thread that commits sends at once when no send
is under way (so a lone transaction is sent before its commit returns, as before), and ids
committed by other threads meanwhile wait for that send to finish and go together, up to
`batch` per message. Only committed ids are ever put here: "enqueued only after commit" holds.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

# Messages a committing thread sends for others before it hands the rest to a thread of the
# outbox's own, so no engine thread's commit waits long on everyone else's sends.
LEADER_SENDS = 4


class Outbox:
    """Ids to send with `send(ids)`, at most `batch` per call, in the order they were put.

    `send` must not raise for a broker that is down (log and return: the recovery sweep creates
    what a lost message would have); anything it raises passes to the putting thread, and the
    ids still waiting go with the next `put`.
    """

    def __init__(self, send: Callable[[list[str]], None], *, batch: int, leader_sends: int = LEADER_SENDS) -> None:
        self._send, self._batch, self._leader_sends = send, batch, leader_sends
        self._lock = threading.Lock()
        self._pending: list[str] = []
        self._sending = False

    def put(self, ids: Sequence[str]) -> None:
        """Queue `ids`; send them (and whatever waits) now unless another thread is sending."""
        with self._lock:
            self._pending.extend(ids)
            if self._sending or not self._pending:
                return
            self._sending = True
        if not self._drain(limit=self._leader_sends):
            threading.Thread(target=self._drain, name="k8s-dispatch-outbox", daemon=False).start()

    def _drain(self, *, limit: int | None = None) -> bool:
        """Send batches until none waits (True: `_sending` cleared) or `limit` sends (False)."""
        sends = 0
        try:
            while True:
                with self._lock:
                    if not self._pending:
                        self._sending = False
                        return True
                    if limit is not None and sends >= limit:
                        return False
                    batch = list(dict.fromkeys(self._pending[: self._batch]))  # a repeat once per message
                    del self._pending[: self._batch]
                self._send(batch)
                sends += 1
        except BaseException:
            with self._lock:
                self._sending = False
            raise
