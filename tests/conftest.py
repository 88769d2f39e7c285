"""Shared fixtures: real PostgreSQL and SQLite databases of our own, Redis with our own prefix.

Every test session creates its own uniquely named PostgreSQL databases and drops them at the
end, and cleans only the Redis keys under its own prefix: several runs can share one server
and no test touches data it did not create. An unreachable service fails the tests with a
message saying how to start it; nothing is skipped.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import psycopg
import pytest
import redis
from clusters import LOCAL, REAL, ClusterHandle, local_handle, real_handle
from hypothesis import HealthCheck, settings
from objectstore import object_store, unique_prefix  # noqa: F401  (fixtures; starts building weed)
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.orm import Session, sessionmaker

from k8s_dispatch.store import migrate
from k8s_dispatch.store.db import make_engine, make_sessionmaker

if TYPE_CHECKING:
    from k8s_dispatch.demo.localcluster import LocalCluster

PG_ADMIN_URL = os.environ.get("K8S_DISPATCH_TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("K8S_DISPATCH_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
HOW_TO_START = "run `bash tests/services.sh` (or `make test`) to start it"

# The suite runs beside clusters, worker processes and its other xdist workers: how long an example
# takes says how loaded the machine is, not whether the code is right.
settings.register_profile("suite", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("suite")


def _admin_conninfo() -> str:
    # psycopg takes libpq URLs; drop a SQLAlchemy driver suffix if one was given.
    return make_url(PG_ADMIN_URL).set(drivername="postgresql").render_as_string(hide_password=False)


def _admin_connect() -> psycopg.Connection:
    try:
        return psycopg.connect(_admin_conninfo(), autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as e:
        pytest.fail(f"PostgreSQL is unreachable at {PG_ADMIN_URL} ({e}); {HOW_TO_START}", pytrace=False)


@pytest.fixture(scope="session")
def new_pg_database() -> Iterator[Callable[[], str]]:
    """A factory: each call creates an empty PostgreSQL database and returns its URL.

    Names are k8s_dispatch_test_<8 hex>; every database made here is dropped at session end.
    """
    created: list[str] = []
    admin = _admin_connect()

    def create() -> str:
        name = f"k8s_dispatch_test_{uuid.uuid4().hex[:8]}"
        admin.execute(f'CREATE DATABASE "{name}"')
        created.append(name)
        return make_url(_admin_conninfo()).set(database=name).render_as_string(hide_password=False)

    try:
        yield create
    finally:
        for name in created:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                (name,),
            )
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


@pytest.fixture(scope="session")
def pg_url(new_pg_database: Callable[[], str]) -> str:
    """A PostgreSQL database of this test session, migrated to head. Shared: use fresh ids."""
    url = new_pg_database()
    migrate.upgrade(url)
    return url


@pytest.fixture(scope="session")
def sqlite_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A SQLite database file of this test session, migrated to head. Shared: use fresh ids."""
    url = f"sqlite:///{tmp_path_factory.mktemp('sqlite') / 'k8s-dispatch.db'}"
    migrate.upgrade(url)
    return url


@pytest.fixture(params=["postgresql", "sqlite"])
def db_url(request: pytest.FixtureRequest) -> str:
    """The test runs twice: on this session's PostgreSQL database and on its SQLite one."""
    return request.getfixturevalue("pg_url" if request.param == "postgresql" else "sqlite_url")


@pytest.fixture
def engine_factory() -> Iterator[Callable[..., Engine]]:
    """`engine_factory(url, **make_engine_kwargs)`: engines disposed of when the test ends."""
    engines: list[Engine] = []

    def make(url: str, **kwargs: object) -> Engine:
        engine = make_engine(url, **kwargs)  # type: ignore[arg-type]
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.dispose()


@pytest.fixture
def db_sessionmaker(db_url: str, engine_factory: Callable[..., Engine]) -> sessionmaker[Session]:
    """Sessions on `db_url` (both databases); use `store.db.transaction(db_sessionmaker)`."""
    return make_sessionmaker(engine_factory(db_url))


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The Redis the tests share; checked reachable. Namespace every key with `key_prefix`."""
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=5)
    try:
        client.ping()
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
        pytest.fail(f"Redis is unreachable at {REDIS_URL} ({e}); {HOW_TO_START}", pytrace=False)
    finally:
        client.close()
    return REDIS_URL


@pytest.fixture(scope="session")
def key_prefix(redis_url: str) -> Iterator[str]:
    """A Redis key prefix unique to this test session; its keys are deleted at the end."""
    prefix = f"k8s-dispatch-test-{uuid.uuid4().hex[:8]}"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        for start in range(0, len(keys), 500):
            client.delete(*keys[start : start + 500])
    finally:
        client.close()


@pytest.fixture(scope="session")
def real_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    """The real control plane of this test session (simulate mode: the node agent runs Pods from
    the same annotations as localcluster). Built on first use; a failed build fails the tests."""
    from k8s_dispatch.lab.realcluster.controlplane import ControlPlane

    plane = ControlPlane(directory=tmp_path_factory.mktemp("realcluster"), mode="simulate")
    plane.start()
    try:
        yield real_handle(plane)
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def local_sim_cluster() -> Iterator[ClusterHandle]:
    """localcluster in simulate mode, shared by the session's cluster-parametrised tests."""
    from k8s_dispatch.demo.localcluster import LocalCluster

    with LocalCluster(mode="simulate") as cluster:
        yield local_handle(cluster)


@pytest.fixture(scope="module")
def sim_cluster() -> Iterator[LocalCluster]:
    from k8s_dispatch.demo.localcluster import LocalCluster

    with LocalCluster(mode="simulate") as cluster:
        yield cluster


@pytest.fixture(params=[LOCAL, REAL])
def any_cluster(request: pytest.FixtureRequest) -> ClusterHandle:
    """Simulate mode on each cluster in turn, per test: localcluster (the module's own, so a
    module's objects do not pile up in the session's) and the real control plane (the session's):
    the end-to-end suites that must hold on both ask for this. `cluster_under_test` below is the
    same choice for session-scoped fixtures (tests/localcluster's comparisons)."""
    if request.param == LOCAL:
        return local_handle(request.getfixturevalue("sim_cluster"))
    return request.getfixturevalue("real_cluster")


@pytest.fixture(scope="session", params=[LOCAL, REAL])
def cluster_under_test(request: pytest.FixtureRequest) -> ClusterHandle:
    """Each cluster in turn: the test runs on localcluster and on the real control plane."""
    return request.getfixturevalue("local_sim_cluster" if request.param == LOCAL else "real_cluster")


# `make test` runs the suite's rooms side by side (pytest-xdist): a room's tests run one after
# another on one worker. A room is a file (its tests share its module's cluster), except that the
# tests on the real node share one (one kubelet, containerd and pod network per machine), and so
# do the chaos runs (each loads the machine as a production incident would).
KUBELET_ROOM = (
    "tests/realcluster/test_kubelet_",
    "tests/realcluster/test_product_image.py",
    "tests/realcluster/test_node.py",
)


def room(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    if path.startswith(KUBELET_ROOM):
        return "kubelet"
    if path.startswith("tests/chaos/"):
        return "chaos"
    return path


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which returns its scheduler for `-n`
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Hands out whole rooms (xdist's loadgroup would do it from markers, but xdist 3.8 cannot mark
    a test's id under pytest 9.2)."""
    from xdist.scheduler import LoadScopeScheduling

    class Rooms(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return room(nodeid)

    return Rooms(config, log)


def pytest_itemcollected(item: pytest.Item) -> None:
    """A test on the real node outside its room would start a second kubelet beside the first."""
    if "kubelet_cluster" in getattr(item, "fixturenames", ()) and room(item.nodeid) != "kubelet":
        raise pytest.UsageError(f"{item.nodeid} uses the real node: name its file as KUBELET_ROOM says")
