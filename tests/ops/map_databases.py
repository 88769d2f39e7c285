"""What the ops tests of maps (`show`, `status`) share: an empty, migrated database of the test's
own on each store, and the router their maps are scheduled with."""

from __future__ import annotations

from pathlib import Path

import pytest

from k8s_dispatch.store import migrate

STORES = ["postgresql", "sqlite"]  # the params of a `url` fixture that calls `migrated_url`


class Router:
    """Every capability to one worker: the ops tests' maps never run."""

    def worker_for(self, capability: str) -> str:
        return "w"


def migrated_url(request: pytest.FixtureRequest, sqlite_file: Path) -> str:
    """An empty, migrated database for this test alone (the maps in it are all its own): a new
    PostgreSQL database, or `sqlite_file`, as the fixture's param says."""
    if request.param == "postgresql":
        url: str = request.getfixturevalue("new_pg_database")()
    else:
        url = f"sqlite:///{sqlite_file}"
    migrate.upgrade(url)
    return url
