"""Engines, sessions and transactions for the store, on PostgreSQL (psycopg 3) or SQLite.

`make_engine` picks the driver and pool settings for a URL; `transaction` is the one place a
session is committed or rolled back, and the one place a lost connection becomes
`DatabaseUnavailable`, which the tasks retry.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event, exc
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.orm import Session, sessionmaker

from k8s_dispatch.core.errors import DatabaseUnavailable

SQLITE_BUSY_TIMEOUT_MS = 30_000
PG_CONNECT_TIMEOUT_S = 10
PING_IDLE_S = 1.0  # a pooled connection idle for longer is pinged before use
_IDLE_SINCE = "k8s_dispatch_idle_since"


def normalise_url(url: str | URL) -> URL:
    """The URL with its driver made explicit: `postgres://` and `postgresql://` use psycopg 3."""
    parsed = make_url(url)
    if parsed.drivername in ("postgres", "postgresql"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def make_engine(
    url: str | URL, *, pool_size: int = 5, max_overflow: int = 10, echo: bool = False, ping_idle_s: float = PING_IDLE_S
) -> Engine:
    """An engine for `url`. Dispose of it when done.

    PostgreSQL: a pool whose connections are pinged before use when they sat idle (see
    `_ping_when_idle`) and recycled every 30 minutes, so a restarted server costs one failed
    ping, not a failed task. SQLite: see `_sqlite_setup`.
    """
    parsed = normalise_url(url)
    if parsed.get_backend_name() == "sqlite":
        in_memory = parsed.database in (None, "", ":memory:")
        engine = sa.create_engine(
            parsed,
            echo=echo,
            connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
            # A file database gets a normal pool; an in-memory one keeps SQLAlchemy's default.
            **({} if in_memory else {"pool_size": pool_size, "max_overflow": max_overflow}),
        )
        _sqlite_setup(engine)
        return engine
    connect_args: dict[str, Any] = {}
    if parsed.get_backend_name() == "postgresql":
        connect_args["connect_timeout"] = PG_CONNECT_TIMEOUT_S
    engine = sa.create_engine(
        parsed,
        echo=echo,
        pool_size=pool_size,
        max_overflow=max_overflow,
        pool_timeout=30,
        pool_recycle=1800,
        connect_args=connect_args,
    )
    _ping_when_idle(engine, idle_s=ping_idle_s)
    return engine


def _ping_when_idle(engine: Engine, *, idle_s: float) -> None:
    """Ping a pooled connection before handing it out only if it was idle for `idle_s`.

    SQLAlchemy's `pool_pre_ping` pings at every checkout: one more round trip per transaction,
    a large share of a short one's (the create path runs two). A
    connection back from use a moment ago was alive then; one that sat idle (a restarted
    server, a killed backend) is pinged, and a dead one is replaced before anyone sees it
    (`DisconnectionError` makes the pool invalidate it and check out another).
    """

    @event.listens_for(engine, "checkin")
    def _on_checkin(_dbapi_connection: Any, record: Any) -> None:
        record.info[_IDLE_SINCE] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _on_checkout(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        idle_since = record.info.pop(_IDLE_SINCE, None)  # None: connected just now
        if idle_since is None or time.monotonic() - idle_since < idle_s:
            return
        try:
            engine.dialect.do_ping(dbapi_connection)
        except engine.dialect.loaded_dbapi.Error as e:
            raise exc.DisconnectionError(f"a pooled connection failed its ping: {e}") from e


def _sqlite_setup(engine: Engine) -> None:
    """Make SQLite safe for several threads and processes at once.

    Foreign keys on; WAL so readers do not block the writer; a busy timeout so a writer waits
    for the lock instead of failing. Every transaction starts with `BEGIN IMMEDIATE`: it takes
    the write lock up front, so a read-then-write transaction never fails half-way when it
    would upgrade its lock (SQLite does not wait in that case), and SAVEPOINTs work, which
    Python's sqlite3 module would otherwise get wrong. The cost, one writer at a time, is the
    price of an embedded database.
    """

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # we issue BEGIN ourselves (see "begin")
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("PRAGMA foreign_keys = ON")
            cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
            cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute("PRAGMA synchronous = NORMAL")  # durable enough with WAL
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: sa.Connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    """Sessions that keep loaded attributes after commit, so results can be read afterwards."""
    return sessionmaker(bind=engine, expire_on_commit=False)


def is_connection_failure(error: BaseException) -> bool:
    """True if `error` means the database is unreachable or dropped us, rather than a bad query."""
    if isinstance(error, (exc.OperationalError, exc.InterfaceError)):
        return True
    if isinstance(error, exc.DBAPIError) and error.connection_invalidated:
        return True
    return isinstance(error, exc.TimeoutError)  # the pool had no connection to give


@contextmanager
def transaction(factory: sessionmaker[Session]) -> Iterator[Session]:
    """A session inside one transaction: committed on success, rolled back on any error.

    Raises:
        DatabaseUnavailable: the connection failed (unreachable, dropped, pool exhausted,
            locked for too long); raised `from` the driver's error. Other errors pass through.
    """
    session = factory()
    try:
        with session.begin():
            yield session
    except (exc.DBAPIError, exc.TimeoutError) as e:
        if is_connection_failure(e):
            raise DatabaseUnavailable(f"database unavailable: {e.__class__.__name__}: {_first_line(e)}") from e
        raise
    finally:
        session.close()


def database_now(session: Session) -> datetime:
    """The database's clock (aware UTC): the one clock row times are written and compared with.

    Hosts' clocks may disagree by minutes; every timestamp that another process compares (a
    row's updated_at against the sweep's grace period, finished_at, notified_at, status ages)
    is taken from here, so none of them depends on two hosts agreeing. The last reading of
    PostgreSQL's clock (one `SELECT statement_timestamp()` per engine every DB_CLOCK_REFRESH_S,
    so a transaction pays no extra round trip) carried forward by this process's monotonic
    clock: a step of this host's wall clock (NTP, a VM resumed) changes nothing, and a step of
    the database's is followed at the next reading. Accurate to about half that round trip.
    SQLite is embedded: its clock is this process's.
    """
    bind = session.get_bind()
    if bind.dialect.name == "sqlite":
        return datetime.now(UTC)
    engine = bind.engine if isinstance(bind, sa.Connection) else bind
    reading = _DB_CLOCK_READINGS.get(engine)
    now = time.monotonic()
    if reading is None or now - reading.monotonic_s > DB_CLOCK_REFRESH_S:
        before = time.monotonic()
        theirs = session.execute(sa.select(sa.func.statement_timestamp())).scalar_one()
        now = time.monotonic()
        reading = DatabaseClockReading(monotonic_s=(before + now) / 2, database=theirs.astimezone(UTC))
        _DB_CLOCK_READINGS[engine] = reading
    return reading.at(now)


@dataclass(frozen=True)
class DatabaseClockReading:
    """The database's clock as read once, and this process's monotonic clock at that moment."""

    monotonic_s: float  # time.monotonic() half-way through the round trip
    database: datetime  # the database's clock then (aware)

    def at(self, monotonic_s: float) -> datetime:
        """The database's clock at `monotonic_s`, carried forward from this reading."""
        return self.database + timedelta(seconds=monotonic_s - self.monotonic_s)


DB_CLOCK_REFRESH_S = 60.0  # a step of the database's clock, or a drift of ours, is followed within this
_DB_CLOCK_READINGS: weakref.WeakKeyDictionary[Engine, DatabaseClockReading] = weakref.WeakKeyDictionary()


def _first_line(error: BaseException) -> str:
    text = str(getattr(error, "orig", None) or error)
    return text.strip().splitlines()[0] if text.strip() else ""
