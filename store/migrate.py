"""Schema migrations of the engine's store, run from the installed package.

The Alembic scripts ship inside `store/migrations`; the config is built here in code, so no
alembic.ini is needed in the working directory. `k8s-dispatch migrate` calls `upgrade`.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import exc

from k8s_dispatch.store.database_errors import database_error
from k8s_dispatch.store.db import make_engine

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
VERSION_TABLE = "k8s_dispatch_alembic_version"  # ours, so the engine's own Alembic can coexist


def _config(url: str) -> Config:
    config = Config()
    # ConfigParser interpolates '%': escape it in the path. The URL never goes through it.
    config.set_main_option("script_location", str(MIGRATIONS_DIR).replace("%", "%%"))
    config.attributes["url"] = url
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the database at `url` up to `revision` (default: the newest).

    Raises:
        ConfigError: the database does not exist or refused the login (the message says what to do).
        DatabaseUnavailable: the server could not be reached.
    """
    check_reachable(url)
    try:
        command.upgrade(_config(url), revision)
    except (exc.OperationalError, exc.InterfaceError) as e:  # the server went away meanwhile
        raise database_error(url, e) from e


def check_reachable(url: str) -> None:
    """Connect once, so that a database that is missing or unreachable is one line saying what
    to do, not a migration's traceback. A SQLite file is created here, as `upgrade` would."""
    engine = make_engine(url, pool_size=1, max_overflow=0)
    try:
        with engine.connect():
            pass
    except (exc.OperationalError, exc.InterfaceError) as e:
        raise database_error(url, e) from e
    finally:
        engine.dispose()


def downgrade(url: str, revision: str = "base") -> None:
    """Take the database at `url` down to `revision` (default: no tables of ours at all)."""
    command.downgrade(_config(url), revision)


def current(url: str) -> str | None:
    """The revision the database at `url` is at, or None if it was never migrated."""
    engine = make_engine(url, pool_size=1, max_overflow=0)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
            return context.get_current_revision()
    finally:
        engine.dispose()


def head() -> str:
    """The newest revision shipped with this package."""
    revision = ScriptDirectory.from_config(_config("")).get_current_head()
    if revision is None:
        raise RuntimeError(f"no migrations found in {MIGRATIONS_DIR}")
    return revision
