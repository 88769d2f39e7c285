"""The run's database and Redis keys at the edges: ids queried in chunks, libpq URLs and
application names, and what removes the database and the keys at the end."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import redis
from sqlalchemy.engine import make_url

ID_CHUNK = 500


def chunks(ids: list[str]) -> Iterator[list[str]]:
    for start in range(0, len(ids), ID_CHUNK):
        yield ids[start : start + ID_CHUNK]


def conninfo(url: str) -> str:
    """A libpq URL for psycopg (without a SQLAlchemy driver suffix)."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def with_app_name(url: str, app_name: str) -> str:
    parsed = make_url(url)
    if parsed.get_backend_name() != "postgresql":
        return url
    return parsed.update_query_dict({"application_name": app_name}).render_as_string(hide_password=False)


def drop_database(admin_url: str, name: str) -> None:
    with psycopg.connect(conninfo(admin_url), autocommit=True, connect_timeout=10) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def delete_prefix(client: redis.Redis, prefix: str) -> int:
    deleted = 0
    batch: list[bytes] = []
    for key in client.scan_iter(match=f"{prefix}:*", count=1000):
        batch.append(key)
        if len(batch) >= 500:
            deleted += client.delete(*batch)
            batch = []
    if batch:
        deleted += client.delete(*batch)
    return deleted
