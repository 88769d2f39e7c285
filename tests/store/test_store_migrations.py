"""The migration builds the schema on an empty database, tears it down, and builds it again,
on PostgreSQL and SQLite; the models agree with it; it runs without an alembic.ini."""

from __future__ import annotations

import fnmatch
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy.engine import Engine

from k8s_dispatch.store import migrate
from k8s_dispatch.store.models import Base

OUR_TABLES = {
    "case_instances",
    "case_events",
    "dispatches",
    "dispatch_admission",
    "dispatch_maps",
    "map_items",
    "map_item_ends",
}
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["postgresql", "sqlite"])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A database with no tables at all, made for this test."""
    if request.param == "postgresql":
        return request.getfixturevalue("new_pg_database")()
    return f"sqlite:///{tmp_path / 'empty.db'}"


def table_names(engine: Engine) -> set[str]:
    return set(sa.inspect(engine).get_table_names())


def test_upgrade_from_empty_downgrade_to_base_and_upgrade_again(
    empty_url: str, engine_factory: Callable[..., Engine]
) -> None:
    engine = engine_factory(empty_url)
    assert table_names(engine) == set()
    assert migrate.current(empty_url) is None

    migrate.upgrade(empty_url)
    assert table_names(engine) == OUR_TABLES | {migrate.VERSION_TABLE}
    assert migrate.current(empty_url) == migrate.head()

    migrate.downgrade(empty_url)
    assert table_names(engine) == {migrate.VERSION_TABLE}  # Alembic keeps its (empty) table
    assert migrate.current(empty_url) is None

    migrate.upgrade(empty_url)
    assert table_names(engine) == OUR_TABLES | {migrate.VERSION_TABLE}
    assert migrate.current(empty_url) == migrate.head()


def test_upgrade_twice_is_a_no_op(empty_url: str) -> None:
    migrate.upgrade(empty_url)
    migrate.upgrade(empty_url)
    assert migrate.current(empty_url) == migrate.head()


def test_indexes_and_constraints_the_store_relies_on(db_url: str, engine_factory: Callable[..., Engine]) -> None:
    inspector = sa.inspect(engine_factory(db_url))
    events = {index["name"]: index for index in inspector.get_indexes("case_events")}
    dialect = "postgresql" if db_url.startswith("postgresql") else "sqlite"
    for name, predicate in (
        ("uq_case_events_scheduled", "WORKER_SCHEDULED"),
        ("uq_case_events_terminal", "WORKER_CANCELLED"),
    ):
        assert events[name]["unique"] and events[name]["column_names"] == ["dispatch_id"]
        assert predicate in str(events[name]["dialect_options"][f"{dialect}_where"])
    dispatches = {index["name"]: index for index in inspector.get_indexes("dispatches")}
    assert dispatches["ix_dispatches_state"]["column_names"][0] == "state"
    assert dispatches["ix_dispatches_queued"]["column_names"][:2] == ["tenancy_id", "capability"]
    assert "QUEUED" in str(dispatches["ix_dispatches_queued"]["dialect_options"][f"{dialect}_where"])
    with engine_factory(db_url).connect() as connection:  # the admission turn's one row
        assert connection.execute(sa.text("SELECT id FROM dispatch_admission")).scalars().all() == [1]
    uniques = {u["name"]: u["column_names"] for u in inspector.get_unique_constraints("dispatches")}
    assert uniques["uq_dispatches_tenancy_id_idempotency_key"] == ["tenancy_id", "idempotency_key"]
    assert {fk["referred_table"] for fk in inspector.get_foreign_keys("dispatches")} == {"case_instances"}


def test_models_match_the_migrated_schema(db_url: str, engine_factory: Callable[..., Engine]) -> None:
    with engine_factory(db_url).connect() as connection:
        context = MigrationContext.configure(
            connection,
            opts={"version_table": migrate.VERSION_TABLE, "compare_type": True, "compare_server_default": False},
        )
        differences = compare_metadata(context, Base.metadata)
    if db_url.startswith("sqlite"):
        # Alembic compares no expression index on SQLite (it warns, then reports the index as both
        # removed and added): the queue index's `priority DESC` is one. Its presence and predicate
        # are checked above, and PostgreSQL compares it in full.
        differences = [d for d in differences if getattr(d[1], "name", None) != "ix_dispatches_queued"]
    assert differences == []


def test_migrate_runs_from_any_directory_without_alembic_ini(
    new_pg_database: Callable[[], str], tmp_path: Path
) -> None:
    url = new_pg_database()
    subprocess.run(
        [
            sys.executable,
            "-W",
            "error",
            "-c",
            "import sys; from k8s_dispatch.store.migrate import upgrade; upgrade(sys.argv[1])",
            url,
        ],
        cwd=tmp_path,
        check=True,
        timeout=120,
    )
    assert not list(tmp_path.iterdir())  # nothing read or written in the working directory
    assert migrate.current(url) == migrate.head()


def test_package_data_ships_every_migration_file() -> None:
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "k8s_dispatch.store"
    ]
    package = ROOT / "store"
    files = [
        path.relative_to(package).as_posix()
        for path in (package / "migrations").rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    ]
    assert "migrations/versions/0001_initial.py" in files
    assert [f for f in files if not any(fnmatch.fnmatch(f, p) for p in patterns)] == []
