"""Engines and transactions: driver selection, SQLite's settings, commit and rollback, and lost
connections turned into `DatabaseUnavailable` (against real PostgreSQL and SQLite)."""

from __future__ import annotations

import uuid
from datetime import UTC, timedelta

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from k8s_dispatch.core.errors import DatabaseUnavailable, Transient
from k8s_dispatch.store import dispatches, scheduling
from k8s_dispatch.store.db import database_now, make_sessionmaker, normalise_url, transaction
from k8s_dispatch.store.models import CaseInstance


@pytest.mark.parametrize(
    ("given", "driver"),
    [
        ("postgres://u:p@db:5432/x", "postgresql+psycopg"),
        ("postgresql://u@db/x", "postgresql+psycopg"),
        ("postgresql+psycopg://u@db/x", "postgresql+psycopg"),
        ("sqlite:///k8s-dispatch.db", "sqlite"),
    ],
)
def test_postgres_urls_use_psycopg_3(given: str, driver: str) -> None:
    url = normalise_url(given)
    assert url.drivername == driver
    assert (url.host, url.database) == (sa.make_url(given).host, sa.make_url(given).database)


def test_sqlite_connections_have_foreign_keys_wal_and_a_busy_timeout(sqlite_url, engine_factory) -> None:
    with engine_factory(sqlite_url).connect() as connection:
        pragmas = {
            p: connection.exec_driver_sql(f"PRAGMA {p}").scalar()
            for p in ("foreign_keys", "journal_mode", "busy_timeout")
        }
    assert pragmas == {"foreign_keys": 1, "journal_mode": "wal", "busy_timeout": 30_000}


def test_sqlite_enforces_foreign_keys(sqlite_url, engine_factory) -> None:
    sm = make_sessionmaker(engine_factory(sqlite_url))
    with pytest.raises(IntegrityError), transaction(sm) as session:
        session.execute(
            sa.text(
                "INSERT INTO dispatches (dispatch_id, case_id, tenancy_id, capability, worker_name, "
                "idempotency_key, input, state) VALUES ('d', 'no-such-case', 't', 'c', 'w', 'k', '{}', 'SCHEDULED')"
            )
        )


def test_transaction_commits_on_success_and_rolls_back_on_error(db_sessionmaker) -> None:
    kept, dropped = f"kept-{uuid.uuid4().hex}", f"dropped-{uuid.uuid4().hex}"
    with transaction(db_sessionmaker) as session:
        scheduling.create_case(session, case_id=kept, tenancy_id="t")
    with pytest.raises(RuntimeError), transaction(db_sessionmaker) as session:
        scheduling.create_case(session, case_id=dropped, tenancy_id="t")
        raise RuntimeError("boom")
    with transaction(db_sessionmaker) as session:
        assert session.get(CaseInstance, kept) is not None
        assert session.get(CaseInstance, dropped) is None


def test_a_query_error_is_not_mistaken_for_an_outage(db_sessionmaker) -> None:
    case_id = f"dup-{uuid.uuid4().hex}"
    with transaction(db_sessionmaker) as session:
        scheduling.create_case(session, case_id=case_id, tenancy_id="t")
    with pytest.raises(IntegrityError), transaction(db_sessionmaker) as session:
        session.add(CaseInstance(id=case_id, tenancy_id="t"))


@pytest.mark.parametrize(
    "url",
    ["postgresql://postgres@127.0.0.1:1/nothing_listens_here", "sqlite:////nonexistent-dir-k8s-dispatch/x.db"],
    ids=["postgresql-refused", "sqlite-unopenable"],
)
def test_an_unreachable_database_is_database_unavailable(url: str, engine_factory) -> None:
    sm = make_sessionmaker(engine_factory(url))
    with pytest.raises(DatabaseUnavailable) as raised, transaction(sm) as session:
        session.execute(sa.text("SELECT 1"))
    assert isinstance(raised.value, Transient)
    assert isinstance(raised.value.__cause__, sa.exc.DBAPIError)


def test_a_dropped_connection_is_database_unavailable_and_the_pool_recovers(pg_url, engine_factory) -> None:
    sm = make_sessionmaker(engine_factory(pg_url, pool_size=1, max_overflow=0))
    with pytest.raises(DatabaseUnavailable) as raised, transaction(sm) as session:
        pid = session.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
        with psycopg.connect(sa.make_url(pg_url).render_as_string(hide_password=False), autocommit=True) as killer:
            assert killer.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone() == (True,)
        session.execute(sa.text("SELECT 1"))
    assert raised.value.__cause__ is not None
    with transaction(sm) as session:  # the pool replaced the dead connection
        assert session.execute(sa.text("SELECT pg_backend_pid()")).scalar_one() != pid


def test_the_database_clock_is_aware_utc_and_what_rows_are_written_with(db_sessionmaker) -> None:
    """Row times default to the database's clock (the one the sweep's grace compares with)."""
    case_id = f"case-{uuid.uuid4().hex[:8]}"
    with transaction(db_sessionmaker) as session:
        before = database_now(session)
        scheduling.create_case(session, case_id=case_id, tenancy_id="t")
    with transaction(db_sessionmaker) as session:
        dispatch_id = scheduling.schedule(
            session, case_id=case_id, tenancy_id="t", capability="demo.sha256", input={"text": "x"},
            idempotency_key="k", router=_Router(), max_input_bytes=1024,
        ).dispatch_id  # fmt: skip
        row = dispatches.get_dispatch(session, dispatch_id)
        after = database_now(session)
    assert before.tzinfo is UTC and after.tzinfo is UTC
    assert before <= row.created_at == row.updated_at <= after < before + timedelta(seconds=30)


class _Router:
    def worker_for(self, capability: str) -> str:
        return "w"
