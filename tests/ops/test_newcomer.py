"""A newcomer's first commands, run as they would run them: the installed `k8s-dispatch` in an
empty directory, with nothing set but what each case gets wrong (no configuration, a missing
database, a typo in the capabilities file, an unreachable Redis, an API server that refuses the
credentials). Each ends with exit code 3 and a first line that says what to do next, never a
traceback, and nothing is created on the way."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from packaging.version import Version

from k8s_dispatch.ops.processes import free_port
from k8s_dispatch.store import migrate
from tests.conftest import PG_ADMIN_URL

CLI = Path(sys.executable).with_name("k8s-dispatch")
EXIT_CONFIG = 3  # README: "3 invalid configuration or input ... (nothing was done)"
CAPABILITIES = {"capabilities": {"echo": {"worker": "shell", "image": "busybox:1.36", "command": ["echo"]}}}


@dataclass(frozen=True)
class Ran:
    code: int
    stdout: str
    stderr: str

    @property
    def first_line(self) -> str:
        return (self.stderr.strip().splitlines() or [""])[0]


@pytest.fixture
def newcomer(tmp_path: Path):
    """`run(*args, **env)`: the CLI in an empty directory, HOME there too (no ~/.kube/config),
    no K8S_DISPATCH_* variable but the ones given."""
    home = tmp_path / "newcomer"
    home.mkdir()

    def run(*args: str, **env: str) -> Ran:
        environ = {k: v for k, v in os.environ.items() if not k.startswith("K8S_DISPATCH_")}
        environ.update(HOME=str(home), **{f"K8S_DISPATCH_{k.upper()}": v for k, v in env.items()})
        done = subprocess.run(
            [str(CLI), *args], cwd=home, env=environ, capture_output=True, text=True, timeout=120, check=False
        )
        return Ran(done.returncode, done.stdout, done.stderr)

    run.home = home  # type: ignore[attr-defined]
    return run


def _said(ran: Ran, code: int, *phrases: str) -> None:
    assert ran.code == code, ran
    assert "Traceback" not in ran.stderr, ran.stderr
    for phrase in phrases:
        assert phrase in ran.first_line, ran.stderr


def test_status_with_no_configuration_says_to_migrate_or_set_the_url_and_creates_nothing(newcomer) -> None:
    ran = newcomer("status")
    _said(ran, EXIT_CONFIG, "set K8S_DISPATCH_DATABASE_URL", "run `k8s-dispatch migrate`")
    assert "is not set" in ran.first_line
    assert list(newcomer.home.iterdir()) == [], "status created a file"
    for command in (["show", str(uuid.uuid4())], ["cancel", str(uuid.uuid4())], ["sweep"]):
        _said(newcomer(*command), EXIT_CONFIG, "K8S_DISPATCH_DATABASE_URL")
    recover = newcomer("recover")  # the sweep's old name: it says so, then does what `sweep` does
    assert (
        recover.code == EXIT_CONFIG
        and recover.first_line == "`k8s-dispatch recover` is deprecated: use `k8s-dispatch sweep`"
    )
    assert "K8S_DISPATCH_DATABASE_URL" in recover.stderr.splitlines()[1]
    assert list(newcomer.home.iterdir()) == []


def test_a_database_with_no_tables_says_to_migrate(newcomer, new_pg_database) -> None:
    _said(newcomer("status", database_url=new_pg_database()), EXIT_CONFIG, "run `k8s-dispatch migrate`")


def test_a_database_that_does_not_exist_says_to_create_it(newcomer) -> None:
    missing = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/kd_missing_{uuid.uuid4().hex[:8]}"
    for command in ("migrate", "status"):
        ran = newcomer(command, database_url=missing)
        _said(ran, EXIT_CONFIG, "create the database", "k8s-dispatch migrate")
        assert len(ran.stderr.strip().splitlines()) == 1, ran.stderr  # short: one line


def test_an_unreachable_database_says_to_start_it_or_fix_the_url(newcomer) -> None:
    url = f"postgresql://postgres@127.0.0.1:{free_port()}/k8s_dispatch"
    _said(newcomer("migrate", database_url=url), EXIT_CONFIG, "start the database server", "K8S_DISPATCH_DATABASE_URL")


@pytest.fixture
def migrated(newcomer) -> str:
    url = f"sqlite:///{newcomer.home / 'k8s-dispatch.db'}"
    migrate.upgrade(url)
    return url


def test_a_typo_in_the_capabilities_file_says_which_file_to_fix(newcomer, migrated: str) -> None:
    spec = CAPABILITIES["capabilities"]["echo"]
    typo = {"capabilities": {"echo": {**{k: v for k, v in spec.items() if k != "command"}, "comand": ["echo"]}}}
    caps = newcomer.home / "capabilities.yaml"
    caps.write_text(yaml.safe_dump(typo))
    args = ("schedule", "--case", "c", "--tenancy", "t", "--capability", "echo", "--idempotency-key", "k")
    ran = newcomer(*args, "--create-case", database_url=migrated, capabilities=str(caps))
    _said(ran, EXIT_CONFIG, f"fix the capabilities file {caps}")
    assert "'comand': unknown field" in ran.stderr


def test_an_unreachable_redis_says_to_start_it_or_fix_the_url(newcomer, migrated: str, sim_cluster) -> None:
    port = free_port()
    ran = newcomer(
        "sweep",
        database_url=migrated,
        kubeconfig=str(sim_cluster.kubeconfig),
        redis_url=f"redis://127.0.0.1:{port}/0",
    )
    _said(ran, EXIT_CONFIG, f"start Redis at 127.0.0.1:{port} or fix K8S_DISPATCH_REDIS_URL")


def test_no_kubeconfig_says_to_set_one(newcomer, migrated: str, redis_url: str) -> None:
    _said(newcomer("sweep", database_url=migrated, redis_url=redis_url), EXIT_CONFIG, "set K8S_DISPATCH_KUBECONFIG")


def test_refused_credentials_say_which_kubeconfig_to_fix(newcomer, migrated: str, redis_url: str, sim_cluster) -> None:
    config = yaml.safe_load(Path(sim_cluster.kubeconfig).read_text())
    for user in config["users"]:
        user["user"]["token"] = "not-the-token"
    wrong = newcomer.home / "wrong.kubeconfig"
    wrong.write_text(yaml.safe_dump(config))
    ran = newcomer("sweep", database_url=migrated, redis_url=redis_url, kubeconfig=str(wrong))
    _said(ran, EXIT_CONFIG, f"fix the credentials in {wrong}", "refused")
    assert "401" in ran.first_line


def test_version_is_the_installed_packages(newcomer) -> None:
    # Read from the CLI's own directory: a checkout's root may hold a build's stale egg-info.
    installed = subprocess.run(
        [sys.executable, "-c", "from importlib.metadata import version; print(version('k8s-dispatch'))"],
        cwd=newcomer.home, capture_output=True, text=True, check=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    ran = newcomer("--version")
    assert (ran.code, ran.stdout.strip()) == (0, f"k8s-dispatch {installed}"), ran
    assert Version(installed).release >= (0, 1), installed


def test_localcluster_serve_prints_the_port_its_kubeconfig_names(newcomer, tmp_path: Path) -> None:
    kubeconfig = tmp_path / "lc.kubeconfig"
    argv = [str(CLI), "localcluster", "serve", "--mode", "simulate", "--port", str(free_port()), "--kubeconfig", str(kubeconfig)]  # fmt: skip
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=newcomer.home
    ) as process:
        try:
            assert process.stdout is not None
            first, second = process.stdout.readline(), process.stdout.readline()
            server = yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
            assert first.startswith("listening on http://") and server.startswith("https://")
            assert server in second and str(kubeconfig) in second, (first, second)
        finally:
            process.terminate()
            process.wait(timeout=30)
