"""Dispatches and objects for these tests: a scheduled dispatch, an object of an attempt, an end."""

from __future__ import annotations

import hashlib
import uuid

from sqlalchemy.orm import Session, sessionmaker

from k8s_dispatch.artifacts import Artifacts
from k8s_dispatch.artifacts.reference import ResultReference
from k8s_dispatch.store import dispatches, scheduling
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import EventType
from k8s_dispatch.workers.resolver import CapabilityResolver

RESOLVER = CapabilityResolver.from_mapping(
    {"capabilities": {"big": {"worker": "w", "image": "i", "results": "objectStore"}}}
)


def schedule(sm: sessionmaker[Session]) -> str:
    case_id = f"case-{uuid.uuid4().hex}"
    with transaction(sm) as session:
        scheduling.create_case(session, case_id=case_id, tenancy_id="t")
        result = scheduling.schedule(
            session,
            case_id=case_id,
            tenancy_id="t",
            capability="big",
            input={},
            idempotency_key=uuid.uuid4().hex,
            router=RESOLVER,
            max_input_bytes=1000,
        )
    return result.dispatch_id


def put(artifacts: Artifacts, dispatch_id: str, attempt: int, data: bytes) -> ResultReference:
    key = artifacts.key(dispatch_id, attempt)
    artifacts.store.put(key, data)
    return ResultReference(key, len(data), hashlib.sha256(data).hexdigest())


def end(sm: sessionmaker[Session], dispatch_id: str, event: EventType, payload: dict[str, object]) -> None:
    with transaction(sm) as session:
        assert dispatches.record_terminal(session, dispatch_id, event, payload)
