"""What poll's watch writes to Redis, and what the sweep's LIST interval reads (real Redis and
localcluster): a position and its note of Jobs gone undelivered are written in one atomic
script, or neither; a sweep's LIST of a watched namespace that failed is due again at the next
sweep; a poll's lease keeps a second one from running beside it."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
import yaml
from runtimes import runtime_values

from k8s_dispatch.core.settings import load_settings
from k8s_dispatch.delivery import jobwatch
from k8s_dispatch.delivery.jobwatch import Position, Write
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.demo.localcluster import LocalCluster
from k8s_dispatch.ops.processes import free_port
from k8s_dispatch.recovery.sweep import run_sweep
from k8s_dispatch.store import migrate
from k8s_dispatch.tasks import lease
from k8s_dispatch.workers import labels as job_labels

CAPABILITIES = {"capabilities": {"sim.ok": {"worker": "sim", "image": "sim:1"}}}


def gone_job(dispatch_id: str) -> dict:
    return {"metadata": {"name": f"kd-{dispatch_id}", "labels": {job_labels.DISPATCH_ID_KEY: dispatch_id}}}


# --- the position and its gone note ---------------------------------------------------------


def test_a_stored_position_carries_its_gone_note_in_the_same_write(client: redis.Redis, prefix: str) -> None:
    name = jobwatch.key(prefix, "d", "ns")
    assert jobwatch.store(client, name, expected=None, position=Position("5"), healthy_ms=10_000, gone=[gone_job("a")])
    assert jobwatch.load(client, name).version == "5" and jobwatch.gone(client, name) == {"a"}
    # Another poll stored version 7 meanwhile: this one's position AND its note are dropped
    # (that poll read the same events, and noted what left itself).
    assert jobwatch.store(client, name, expected="5", position=Position("7"), healthy_ms=10_000)
    assert not jobwatch.store(
        client, name, expected="5", position=Position("6"), healthy_ms=10_000, gone=[gone_job("b")]
    )
    assert jobwatch.load(client, name).version == "7" and jobwatch.gone(client, name) == {"a"}


def test_many_positions_are_stored_in_one_round_trip_each_on_its_own_version(client: redis.Redis, prefix: str) -> None:
    names = [jobwatch.key(prefix, "d", f"ns{i}") for i in range(4)]
    finished = {"j1": {"metadata": {"name": "j1"}}}
    first = jobwatch.store_many(client, [Write(n, None, Position("3", finished)) for n in names], healthy_ms=10_000)
    assert first == [True] * 4
    for n in names:
        client.delete(jobwatch.healthy_key(n))
    writes = [
        Write(names[0], "3", Position("4"), gone=[gone_job("x")]),  # as expected: stored, with its note
        Write(names[1], "2", Position("4"), gone=[gone_job("y")]),  # another poll's version: neither
        Write(names[2], "3", Position("3", finished), changed=False),  # unchanged: only the healthy mark
        Write(names[3], "2", Position("2"), changed=False),  # unchanged, but another poll stored since
    ]
    assert jobwatch.store_many(client, writes, healthy_ms=10_000) == [True, False, True, False]
    loaded = jobwatch.load_many(client, names)
    assert [p.version for p in loaded] == ["4", "3", "3", "3"]
    assert loaded[0].finished == {} and loaded[2].finished == finished
    assert [jobwatch.gone(client, n) for n in names] == [{"x"}, set(), set(), set()]
    assert [bool(client.exists(jobwatch.healthy_key(n))) for n in names] == [True, False, True, False]


# --- the sweep's LIST interval ---------------------------------------------------------------


@pytest.fixture
def make_runtime(sim_cluster: LocalCluster, new_pg_database, redis_url, key_prefix, tmp_path: Path):
    database_url = new_pg_database()
    migrate.upgrade(database_url)
    values = runtime_values(
        database_url=database_url, redis_url=redis_url, prefix=f"{key_prefix}-{uuid.uuid4().hex[:8]}",
        namespace=f"ld-{uuid.uuid4().hex[:8]}", kubeconfig=sim_cluster.kubeconfig, capabilities=CAPABILITIES,
        tmp=tmp_path, poll_mode="watch", sweep_list_interval_s="600", kube_timeout_s="2",
    )  # fmt: skip
    made: list[Runtime] = []

    def make(kubeconfig: Path | None = None) -> Runtime:
        env = {**values, **({"K8S_DISPATCH_KUBECONFIG": str(kubeconfig)} if kubeconfig else {})}
        rt = Runtime.from_settings(load_settings(env), notifier=lambda _id: None)
        made.append(rt)
        return rt

    yield make
    for rt in made:
        rt.close()


def unreachable(kubeconfig: Path, tmp_path: Path) -> Path:
    """The same kubeconfig with its server on a port nothing listens on."""
    config = yaml.safe_load(kubeconfig.read_text())
    for cluster in config["clusters"]:
        cluster["cluster"]["server"] = f"http://127.0.0.1:{free_port()}"
    path = tmp_path / "unreachable.kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_failed_list_is_due_again_at_the_next_sweep(
    make_runtime: Callable[..., Runtime], sim_cluster: LocalCluster, tmp_path: Path
) -> None:
    rt = make_runtime()
    settings = rt.settings
    name = jobwatch.key(settings.key_prefix, settings.effective_deployment, settings.namespace)
    listed = jobwatch.listed_key(name)

    def healthy() -> None:  # a poll keeps the namespace's watch healthy
        jobwatch.store(rt.redis, name, expected=jobwatch.load(rt.redis, name).version, position=Position("1"),
                       healthy_ms=60_000)  # fmt: skip

    healthy()
    down = make_runtime(kubeconfig=unreachable(Path(sim_cluster.kubeconfig), tmp_path))
    report = run_sweep(down, watched=True)
    assert any(f"jobs in {settings.namespace}" in p for p in report.problems), report.problems
    assert not rt.redis.exists(listed)  # the LIST failed: not counted as made
    healthy()
    run_sweep(rt, watched=True)  # due again: it lists, and now the next one is 600 s on
    assert rt.redis.pttl(listed) > 500_000
    # Within the interval a watched sweep follows the watch instead of listing.
    before = rt.redis.pttl(listed)
    report = run_sweep(rt, watched=True)
    assert not report.problems and 0 < rt.redis.pttl(listed) <= before


# --- the poll's lease ------------------------------------------------------------------------


def test_a_run_under_way_keeps_the_next_from_starting_until_it_ends_or_its_lease_expires(
    client: redis.Redis, prefix: str
) -> None:
    first = lease.take(client, prefix, "poll", ttl_s=30)
    assert first is not None
    assert lease.take(client, prefix, "poll", ttl_s=30) is None  # still under way: skipped
    first.release()
    second = lease.take(client, prefix, "poll", ttl_s=0.2)
    assert second is not None
    first.release()  # a run's release never frees another run's lease
    assert lease.take(client, prefix, "poll", ttl_s=30) is None
    deadline_ms = client.pttl(lease.key(prefix, "poll"))
    assert 0 < deadline_ms <= 200
    # Its worker died: no renewal, and the lease expires on its own.
    end = time.monotonic() + 5
    while (third := lease.take(client, prefix, "poll", ttl_s=30)) is None:
        assert time.monotonic() < end, "the lease never expired"
        time.sleep(0.05)
    assert not second.renew()  # expired and taken by another run: not renewed for the old one
    assert third.renew() and client.pttl(lease.key(prefix, "poll")) > 20_000
