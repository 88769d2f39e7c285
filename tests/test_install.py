"""An engine installs us: the wheel (not editable) in a fresh virtualenv, beside an engine project
with its own `tasks.py`, `engine/` and `workers/`, running README's example from the engine's
directory against real PostgreSQL, Redis and a localcluster, until the notification arrives.

Everything runs from the engine's directory, which is first on every process's `sys.path`: had
k8s-dispatch imported a bare `tasks`, `engine` or `workers` anywhere, it would have found the
engine's and failed; had it installed such names, the engine's worker would have found ours.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from k8s_dispatch.ops.processes import LISTENING, ManagedProcess, free_port, wait_for_log, wait_until

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = re.compile(r"<!-- engine-example: (\S+) -->\n```python\n(.*?)```", re.S)

# The engine's own packages, named like ours; each says whose it is when imported.
ENGINE_FILES = {
    "engine/__init__.py": 'OWNER = "the engine"\n',
    "workers/__init__.py": 'OWNER = "the engine"\n',
}


def readme_examples() -> dict[str, str]:
    found = dict(EXAMPLE.findall((REPO / "README.md").read_text(encoding="utf-8")))
    assert set(found) == {"tasks.py", "schedule.py"}, found.keys()
    return found


def _venv(root: Path, *, demo: bool) -> Path:
    """A new virtualenv with requirements.lock (hashes checked) and our wheel; with `demo`, the wheel's
    demo extra on top, as `pip install 'k8s-dispatch[demo]'` would (at the versions the tests lock)."""
    wheels = root / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(REPO)],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    (wheel,) = wheels.glob("k8s_dispatch-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    uv = [sys.executable, "-m", "uv", "pip", "install", "-q", "--compile-bytecode", "--python", python]
    subprocess.run([*uv, "--require-hashes", "-r", str(REPO / "requirements.lock")], check=True, timeout=600)
    subprocess.run([*uv, "--no-deps", str(wheel)], check=True, timeout=300)
    if demo:
        subprocess.run([*uv, "-c", str(REPO / "requirements-test.lock"), f"{wheel}[demo]"], check=True, timeout=600)
    return venv


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bare product: requirements.lock and our wheel, nothing else."""
    return _venv(tmp_path_factory.mktemp("install"), demo=False)


@pytest.fixture(scope="module")
def demo_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The product with its demo extra (localcluster's and the demo's dependencies)."""
    return _venv(tmp_path_factory.mktemp("install-demo"), demo=True)


@pytest.fixture
def engine_dir(tmp_path: Path) -> Path:
    project = tmp_path / "engine-project"
    for name, text in {**ENGINE_FILES, **readme_examples()}.items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(text, encoding="utf-8")
    return project


def test_the_wheel_adds_one_import_name_and_none_of_the_engines(fresh_venv: Path, engine_dir: Path) -> None:
    site = next((fresh_venv / "lib").glob("python*/site-packages"))
    ours = sorted(p.name for p in site.iterdir() if p.name.lower().startswith(("k8s", "k8s_dispatch")))
    assert len(ours) == 2 and ours[0] == "k8s_dispatch" and ours[1].endswith(".dist-info"), ours
    for name in ("tasks", "engine", "workers", "recovery", "delivery", "store", "core", "lab", "demo", "ops"):
        assert not (site / name).exists() and not (site / f"{name}.py").exists(), name
    probe = (
        "import engine, workers, tasks, k8s_dispatch.api, k8s_dispatch.tasks, k8s_dispatch.workers; "
        "print(engine.OWNER, workers.OWNER, tasks.app.main, k8s_dispatch.tasks.app.main)"
    )
    out = subprocess.run(
        [str(fresh_venv / "bin" / "python"), "-c", probe],
        cwd=engine_dir, env=clean_env(fresh_venv, {}), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["the", "engine", "the", "engine", "engine", "k8s-dispatch"]


PRODUCT_PACKAGES = ("core", "store", "workers", "artifacts", "delivery", "recovery", "tasks", "container", "ops")


def test_the_bare_wheel_is_the_product_alone(fresh_venv: Path, engine_dir: Path) -> None:
    """`pip install k8s-dispatch` without extras: every module of the product imports, the lab is
    not there at all, the demo's own dependencies are not installed (aiohttp is: the kubernetes
    client needs it), and the demo says how to get them."""
    probe = (
        "import importlib, importlib.util, pkgutil, k8s_dispatch\n"
        f"for name in {PRODUCT_PACKAGES!r}:\n"
        "    package = importlib.import_module('k8s_dispatch.' + name)\n"
        "    for info in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):\n"
        "        if not info.name.endswith('.__main__') and '.migrations' not in info.name:\n"
        "            importlib.import_module(info.name)\n"
        "import k8s_dispatch.api, k8s_dispatch.cli, k8s_dispatch.celeryconfig\n"
        "print(importlib.util.find_spec('k8s_dispatch.lab'), importlib.util.find_spec('k8s_dispatch.demo.localcluster') is not None,\n"
        "      [m for m in ('uvloop', 'fakeredis') if importlib.util.find_spec(m)])\n"
    )
    env = clean_env(fresh_venv, {})
    out = subprocess.run([str(fresh_venv / "bin" / "python"), "-c", probe], cwd=engine_dir, env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "True", "[]"], out.stdout
    demo = subprocess.run([str(fresh_venv / "bin" / "k8s-dispatch"), "demo"], cwd=engine_dir, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert demo.returncode == 3, (demo.stdout, demo.stderr)
    assert "pip install 'k8s-dispatch[demo]'" in demo.stderr
    assert subprocess.run([str(fresh_venv / "bin" / "k8s-dispatch"), "--help"], cwd=engine_dir, env=env,
                          capture_output=True, timeout=120).returncode == 0  # fmt: skip


def test_the_demo_extra_makes_the_demo_run(demo_venv: Path, engine_dir: Path) -> None:
    """`pip install 'k8s-dispatch[demo]'` then `k8s-dispatch demo`: the demo's own dependencies come
    with the extra, and the whole demo runs from the installed wheel."""
    demo = subprocess.run(
        [str(demo_venv / "bin" / "k8s-dispatch"), "demo", "--count", "3", "--broker", "embedded", "--timeout", "240"],
        cwd=engine_dir, env=clean_env(demo_venv, {}), capture_output=True, text=True, timeout=420,
    )  # fmt: skip
    assert demo.returncode == 0, (demo.stdout[-3000:], demo.stderr[-3000:])


def clean_env(venv: Path, settings: dict[str, str]) -> dict[str, str]:
    """The environment of a process an engine starts: its venv first on PATH, no PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("K8S_DISPATCH_") and k != "PYTHONPATH"}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    return {**env, **settings}


@pytest.fixture
def processes(engine_dir: Path) -> Iterator[list[ManagedProcess]]:
    started: list[ManagedProcess] = []
    yield started
    for proc in reversed(started):
        proc.stop()


def test_readmes_engine_example_completes_and_is_notified(
    demo_venv: Path, engine_dir: Path, new_pg_database, redis_url: str, processes: list[ManagedProcess]
) -> None:
    """The README's engine, its worker and beat, against localcluster (the demo extra's)."""
    bin_dir = demo_venv / "bin"
    kubeconfig = engine_dir / "localcluster.kubeconfig"
    settings = {
        "K8S_DISPATCH_DATABASE_URL": new_pg_database(),
        "K8S_DISPATCH_REDIS_URL": redis_url,
        "K8S_DISPATCH_KEY_PREFIX": f"install-{uuid.uuid4().hex[:8]}",
        "K8S_DISPATCH_KUBECONFIG": str(kubeconfig),
        "K8S_DISPATCH_POLL_INTERVAL_S": "0.5",
    }
    env = clean_env(demo_venv, settings)

    def start(name: str, *argv: str, ready: str) -> ManagedProcess:
        proc = ManagedProcess(
            name, [str(bin_dir / argv[0]), *argv[1:]], env, engine_dir / f"{name}.log", cwd=engine_dir
        )
        processes.append(proc.start())
        wait_for_log(proc, ready, timeout=120)
        return proc

    migrated = subprocess.run(
        [str(bin_dir / "k8s-dispatch"), "migrate"], cwd=engine_dir, env=env, capture_output=True, text=True, timeout=120
    )
    assert migrated.returncode == 0, migrated.stderr
    # The Job's container runs `python -m k8s_dispatch.container.runner`: the fresh venv's python.
    start("localcluster", "python", "-m", "k8s_dispatch.demo.localcluster", "serve", "--mode", "exec",
          "--port", str(free_port()), "--tls-port", "0", "--kubeconfig", str(kubeconfig), ready=LISTENING)  # fmt: skip
    start(
        "k8s-dispatch-worker",
        "celery",
        "-A",
        "k8s_dispatch.tasks",
        "worker",
        "--loglevel=INFO",
        "--hostname=kd@%h",
        ready=" ready.",
    )
    start("k8s-dispatch-beat", "celery", "-A", "k8s_dispatch.tasks", "beat", "--loglevel=INFO", ready="beat: Starting")
    start(
        "engine-worker",
        "celery",
        "-A",
        "tasks",
        "worker",
        "-Q",
        "engine",
        "--loglevel=INFO",
        "--hostname=engine@%h",
        ready=" ready.",
    )

    scheduled = subprocess.run(
        [str(bin_dir / "python"), "schedule.py"], cwd=engine_dir, env=env, capture_output=True, text=True, timeout=120
    )
    assert scheduled.returncode == 0, scheduled.stderr
    dispatch_id = scheduled.stdout.strip()
    assert re.fullmatch(r"[0-9a-f-]{36}", dispatch_id), scheduled.stdout

    outcomes = engine_dir / "outcomes.jsonl"

    def notified() -> list[dict[str, object]]:
        if not outcomes.exists():
            return []
        return [json.loads(line) for line in outcomes.read_text(encoding="utf-8").splitlines()]

    logs = lambda: "\n".join(p.log_tail() for p in processes)  # noqa: E731 - read only on failure
    seen = wait_until(notified, timeout=120, what="the engine's notification", details=logs)
    assert seen[0] == {
        "id": dispatch_id,
        "event": "WORKER_COMPLETED",
        "output": {"lines": 0, "words": 6, "chars": len("to be or not to be")},
    }
    assert "engine.dispatch_finished" in (engine_dir / "engine-worker.log").read_text(errors="replace")
    assert shutil.which("python", path=env["PATH"]) == str(bin_dir / "python")
