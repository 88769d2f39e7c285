"""Fixtures for the store's tests: a fixed capability router, fresh cases, row counts, and a
runner that starts threads together at a barrier, round after round."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from k8s_dispatch.core.errors import UnknownCapability
from k8s_dispatch.store import scheduling
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import CaseEvent, CaseInstance, Dispatch

T = TypeVar("T")
MAX_INPUT_BYTES = 1000


class StaticRouter:
    """A CapabilityRouter over a fixed table: the tests' stand-in for the workers' resolver."""

    def __init__(self, workers: dict[str, str]) -> None:
        self.workers = workers

    def worker_for(self, capability: str) -> str:
        try:
            return self.workers[capability]
        except KeyError:
            raise UnknownCapability(f"no worker serves {capability!r}") from None


@dataclass(frozen=True)
class Case:
    case_id: str
    tenancy_id: str


@pytest.fixture
def router() -> StaticRouter:
    return StaticRouter({"echo": "echo-worker", "sleep": "sleep-worker"})


@pytest.fixture
def new_case() -> Callable[[sessionmaker[Session]], Case]:
    """`new_case(sm)`: a committed case with fresh ids (the session databases are shared)."""

    def make(sm: sessionmaker[Session]) -> Case:
        case = Case(case_id=f"case-{uuid.uuid4().hex}", tenancy_id=f"tenancy-{uuid.uuid4().hex[:12]}")
        with transaction(sm) as session:
            scheduling.create_case(session, case_id=case.case_id, tenancy_id=case.tenancy_id)
        return case

    return make


@pytest.fixture
def schedule_for(router: StaticRouter) -> Callable[..., scheduling.ScheduleResult]:
    """`schedule_for(sm, case, **overrides)`: schedule an echo with a fresh key, committed."""

    def run(sm: sessionmaker[Session], case: Case, **overrides: Any) -> scheduling.ScheduleResult:
        request: dict[str, Any] = {
            "case_id": case.case_id,
            "tenancy_id": case.tenancy_id,
            "capability": "echo",
            "input": {"message": "hello"},
            "idempotency_key": f"key-{uuid.uuid4().hex}",
            "router": router,
            "max_input_bytes": MAX_INPUT_BYTES,
        }
        request.update(overrides)
        with transaction(sm) as session:
            return scheduling.schedule(session, **request)

    return run


def row_counts(sm: sessionmaker[Session]) -> dict[str, int]:
    with transaction(sm) as session:
        return {
            model.__tablename__: session.scalar(sa.select(sa.func.count()).select_from(model))
            for model in (CaseInstance, CaseEvent, Dispatch)
        }


@pytest.fixture
def count_rows() -> Callable[[sessionmaker[Session]], dict[str, int]]:
    """`count_rows(sm)`: rows per table, to show that a refused request wrote nothing."""
    return row_counts


def run_concurrently(
    threads: int, rounds: int, work: Callable[[int, int], T], *, timeout: float = 120
) -> list[list[T]]:
    """Run `work(round, thread)` on `threads` threads, released together by a barrier each
    round; returns results[round][thread]. Any error in a thread fails the caller."""
    barrier = threading.Barrier(threads, timeout=timeout)
    results: list[list[Any]] = [[None] * threads for _ in range(rounds)]
    errors: list[BaseException] = []

    def loop(thread: int) -> None:
        try:
            for round_ in range(rounds):
                barrier.wait()
                results[round_][thread] = work(round_, thread)
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)
            barrier.abort()

    pool = [threading.Thread(target=loop, args=(i,), name=f"racer-{i}") for i in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(timeout)
    assert not any(thread.is_alive() for thread in pool), "racing threads did not finish"
    if errors:
        raise errors[0]
    return results


@pytest.fixture
def race() -> Callable[..., list[list[Any]]]:
    """`race(threads, rounds, work)`: see `run_concurrently`."""
    return run_concurrently
