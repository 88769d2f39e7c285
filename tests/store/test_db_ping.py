"""store.db's pooled connections: one that sat idle is pinged (and replaced if dead) before
use; one back from use a moment ago is not, and a dead one then costs one DatabaseUnavailable
(which the tasks retry), after which the pool has replaced it."""

from __future__ import annotations

import psycopg
import pytest
import sqlalchemy as sa

from k8s_dispatch.core.errors import DatabaseUnavailable
from k8s_dispatch.store.db import make_sessionmaker, transaction


def kill_backend(pg_url: str, pid: int) -> None:
    with psycopg.connect(sa.make_url(pg_url).render_as_string(hide_password=False), autocommit=True) as killer:
        assert killer.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone() == (True,)


def backend_pid(sm) -> int:
    with transaction(sm) as session:
        return session.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()


def test_an_idle_connection_killed_under_the_pool_is_replaced_unseen(pg_url, engine_factory) -> None:
    sm = make_sessionmaker(engine_factory(pg_url, pool_size=1, max_overflow=0, ping_idle_s=0.0))
    pid = backend_pid(sm)
    kill_backend(pg_url, pid)

    assert backend_pid(sm) != pid  # pinged at checkout, found dead, replaced: no error


def test_a_connection_in_steady_use_is_not_pinged_so_its_death_shows_once(pg_url, engine_factory) -> None:
    sm = make_sessionmaker(engine_factory(pg_url, pool_size=1, max_overflow=0, ping_idle_s=3600.0))
    pid = backend_pid(sm)
    kill_backend(pg_url, pid)

    with pytest.raises(DatabaseUnavailable), transaction(sm) as session:
        session.execute(sa.text("SELECT 1"))
    assert backend_pid(sm) != pid  # the pool replaced it after the failure
