"""A dispatch's Job namespace is fixed once: by `schedule_many` from a router that names it, or
else by the first worker's compare-and-set; `mark_created_many` never overwrites it (both
databases)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from k8s_dispatch.core.errors import ConfigError
from k8s_dispatch.store import dispatches, scheduling
from k8s_dispatch.store.db import transaction
from k8s_dispatch.store.models import DispatchState
from tests.store.conftest import MAX_INPUT_BYTES, StaticRouter


class NamespaceRouter(StaticRouter):
    """A router that also says where each capability's Jobs go, as the workers' resolver does."""

    def __init__(self, workers: dict[str, str], namespaces: dict[str, Any]) -> None:
        super().__init__(workers)
        self.namespaces = namespaces

    def namespace_for(self, capability: str) -> Any:
        self.worker_for(capability)
        return self.namespaces.get(capability)


def request(case: Any, capability: str = "echo") -> scheduling.ScheduleRequest:
    return scheduling.ScheduleRequest(case.case_id, case.tenancy_id, capability, {"n": 1}, f"key-{uuid.uuid4().hex}")


def namespace_of(sm: Any, dispatch_id: str) -> str | None:
    with transaction(sm) as session:
        row = dispatches.get_dispatch(session, dispatch_id)
        assert row is not None
        return row.job_namespace


def test_schedule_records_the_namespace_the_router_names_now(db_sessionmaker, new_case) -> None:
    case = new_case(db_sessionmaker)
    router = NamespaceRouter({"echo": "w", "sleep": "w"}, {"echo": "ns-a"})  # sleep names none
    with transaction(db_sessionmaker) as session:
        echo, sleep = scheduling.schedule_many(
            session, [request(case), request(case, "sleep")], router=router, max_input_bytes=MAX_INPUT_BYTES
        )
    assert namespace_of(db_sessionmaker, echo.dispatch_id) == "ns-a"
    assert namespace_of(db_sessionmaker, sleep.dispatch_id) is None  # left to the first worker

    router.namespaces["echo"] = "ns-b"  # the config moves: the dispatch scheduled before does not
    with transaction(db_sessionmaker) as session:
        later = scheduling.schedule_many(session, [request(case)], router=router, max_input_bytes=MAX_INPUT_BYTES)[0]
        moved = dispatches.fix_job_namespaces(session, {echo.dispatch_id: "ns-b"})
    assert moved == {echo.dispatch_id: "ns-a"}
    assert namespace_of(db_sessionmaker, echo.dispatch_id) == "ns-a"
    assert namespace_of(db_sessionmaker, later.dispatch_id) == "ns-b"


def test_a_router_without_namespaces_leaves_the_namespace_to_the_first_worker(
    db_sessionmaker, new_case, router
) -> None:
    case = new_case(db_sessionmaker)
    with transaction(db_sessionmaker) as session:
        result = scheduling.schedule_many(session, [request(case)], router=router, max_input_bytes=MAX_INPUT_BYTES)[0]
    assert namespace_of(db_sessionmaker, result.dispatch_id) is None
    missing = str(uuid.uuid4())
    with transaction(db_sessionmaker) as session:
        first = dispatches.fix_job_namespaces(session, {result.dispatch_id: "ns-a", missing: "ns-a"})
    with transaction(db_sessionmaker) as session:
        second = dispatches.fix_job_namespaces(session, {result.dispatch_id: "ns-b"})
    assert first == {result.dispatch_id: "ns-a"}  # no such dispatch: left out
    assert second == {result.dispatch_id: "ns-a"}  # compare-and-set: the first one stays
    assert namespace_of(db_sessionmaker, result.dispatch_id) == "ns-a"


def test_mark_created_never_overwrites_the_recorded_namespace(db_sessionmaker, new_case) -> None:
    case = new_case(db_sessionmaker)
    router = NamespaceRouter({"echo": "w"}, {"echo": "ns-a"})
    with transaction(db_sessionmaker) as session:
        result = scheduling.schedule_many(session, [request(case)], router=router, max_input_bytes=MAX_INPUT_BYTES)[0]
    name = f"kd-{result.dispatch_id}"
    with transaction(db_sessionmaker) as session:
        marked = dispatches.mark_created_many(session, [dispatches.CreatedJob(result.dispatch_id, name, "ns-b", 0)])
    assert marked == {result.dispatch_id}
    with transaction(db_sessionmaker) as session:
        row = dispatches.get_dispatch(session, result.dispatch_id)
        assert row is not None
        assert (row.state, row.job_name, row.job_namespace) == (DispatchState.CREATED, name, "ns-a")


@pytest.mark.parametrize("bad", ["Not-A-Label", "", "n" * 64, 7])
def test_a_router_naming_an_invalid_namespace_is_refused_and_nothing_is_written(
    db_sessionmaker, new_case, count_rows, bad
) -> None:
    case = new_case(db_sessionmaker)
    router = NamespaceRouter({"echo": "w"}, {"echo": bad})
    before = count_rows(db_sessionmaker)
    with pytest.raises(ConfigError, match="namespace"), transaction(db_sessionmaker) as session:
        scheduling.schedule_many(session, [request(case)], router=router, max_input_bytes=MAX_INPUT_BYTES)
    assert count_rows(db_sessionmaker) == before
