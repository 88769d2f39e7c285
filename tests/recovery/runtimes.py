"""Helpers the recovery tests share: a notifier that records, and one dispatch scheduled."""

from __future__ import annotations

import threading
import uuid
from typing import Any

from k8s_dispatch.engine import store
from k8s_dispatch.engine.db import transaction
from k8s_dispatch.engine.errors import BrokerUnavailable
from k8s_dispatch.recovery.runtime import Runtime


class Notified:
    """A notifier recording the dispatch ids it is called with (thread-safe); `fail` makes it raise."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.fail = False
        self._lock = threading.Lock()

    def __call__(self, dispatch_id: str) -> None:
        if self.fail:
            raise BrokerUnavailable("the test's broker is down")
        with self._lock:
            self.ids.append(dispatch_id)


def schedule(rt: Runtime, capability: str = "sim.ok", input: Any = None, *, tenancy: str = "tenant-a") -> str:
    """One dispatch of `capability` on a new case (input `{"n": 1}` unless given); its id."""
    case_id = f"case-{uuid.uuid4().hex[:8]}"
    with transaction(rt.sessions) as session:
        store.create_case(session, case_id=case_id, tenancy_id=tenancy)
        return store.schedule(
            session,
            case_id=case_id,
            tenancy_id=tenancy,
            capability=capability,
            input={"n": 1} if input is None else input,
            idempotency_key=f"key-{uuid.uuid4()}",
            router=rt.resolver,
            max_input_bytes=rt.settings.max_input_bytes,
        ).dispatch_id
