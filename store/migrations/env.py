"""Alembic environment for the engine's store: online migrations only, on one connection.

`store.migrate` passes the database URL (or an open connection) through
`config.attributes`, so no alembic.ini and no URL interpolation is involved.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy.engine import Connection

from k8s_dispatch.store.db import make_engine
from k8s_dispatch.store.migrate import VERSION_TABLE
from k8s_dispatch.store.models import Base

config = context.config


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        version_table=VERSION_TABLE,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_engine(config.attributes["url"], pool_size=1, max_overflow=0)
    try:
        with engine.connect() as connection:
            _run(connection)
            connection.commit()
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise RuntimeError("offline (--sql) migrations are not supported: run `k8s-dispatch migrate`")
run_migrations_online()
