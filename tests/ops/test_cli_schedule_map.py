"""`k8s-dispatch schedule-map`, run as an operator would: the installed command over a migrated
database, a capabilities file and an items file; a repeat of its key is the same map, and a bad
item ends with exit code 3, its reason on the first line, and nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
import yaml

from k8s_dispatch.store import maps, migrate
from k8s_dispatch.store.db import make_engine, make_sessionmaker, transaction
from k8s_dispatch.store.models import Dispatch, MapItem

CLI = Path(sys.executable).with_name("k8s-dispatch")
CAPABILITIES = {"capabilities": {"echo": {"worker": "shell", "image": "busybox:1.36", "command": ["echo"]}}}


@pytest.fixture
def run(tmp_path: Path, redis_url: str, key_prefix: str):
    database = f"sqlite:///{tmp_path / 'k8s-dispatch.db'}"
    migrate.upgrade(database)
    caps = tmp_path / "capabilities.yaml"
    caps.write_text(yaml.safe_dump(CAPABILITIES))
    environ = {k: v for k, v in os.environ.items() if not k.startswith("K8S_DISPATCH_")}
    environ.update(
        K8S_DISPATCH_DATABASE_URL=database,
        K8S_DISPATCH_CAPABILITIES=str(caps),
        K8S_DISPATCH_REDIS_URL=redis_url,
        K8S_DISPATCH_KEY_PREFIX=f"{key_prefix}-{uuid.uuid4().hex[:6]}",
        HOME=str(tmp_path),
    )

    def cli(*args: str, items: object) -> subprocess.CompletedProcess[str]:
        path = tmp_path / f"items-{uuid.uuid4().hex[:6]}.json"
        path.write_text(json.dumps(items))
        command = [str(CLI), "schedule-map", "--case", "c-1", "--tenancy", "t", "--capability", "echo",
                   "--items", str(path), *args]  # fmt: skip
        return subprocess.run(command, cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=120)

    engine = make_engine(database)
    cli.sessions = make_sessionmaker(engine)  # type: ignore[attr-defined]
    yield cli
    engine.dispose()


def test_schedule_map_writes_one_map_and_a_repeat_is_the_same(run) -> None:
    args = ("--idempotency-key", "m-1", "--parallelism", "3", "--min-succeeded", "2", "--create-case", "--json")
    first = run(*args, items=[{"n": 1}, {"n": 2}, {"n": 3}])
    assert first.returncode == 0, first.stderr
    made = json.loads(first.stdout)
    assert made["created"] and made["state"] == "SCHEDULED"
    again = json.loads(run(*args, items=[{"n": 1}, {"n": 2}, {"n": 3}]).stdout)
    assert (again["dispatch_id"], again["created"]) == (made["dispatch_id"], False)
    with transaction(run.sessions) as session:
        shape = maps.map_shapes(session, [made["dispatch_id"]], inputs=True)[made["dispatch_id"]]
    assert (shape.items, shape.parallelism, shape.min_succeeded) == (3, 3, 2)
    assert shape.inputs == [{"n": 1}, {"n": 2}, {"n": 3}]


@pytest.mark.parametrize(
    ("items", "says"),
    [([{"n": 1}, "x" * 300_000], "item 1"), ({"n": 1}, "list of item inputs")],
)
def test_a_bad_map_exits_3_saying_why_and_writes_nothing(run, items: object, says: str) -> None:
    done = run("--idempotency-key", "m-2", "--parallelism", "2", "--create-case", items=items)
    assert done.returncode == 3, done
    assert says in done.stderr.strip().splitlines()[0] and "Traceback" not in done.stderr
    with transaction(run.sessions) as session:
        assert session.scalar(sa.select(sa.func.count()).select_from(Dispatch)) == 0
        assert session.scalar(sa.select(sa.func.count()).select_from(MapItem)) == 0
