"""docker-compose.yml, checked by parsing it: services, commands, healthchecks, start order,
configuration names against the settings object, and that the worker can be scaled.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_files import (
    COMPOSE_FILE,
    COMPOSE_REQUIRED,
    REPO,
    Doc,
    MissingVariable,
    interpolate,
    interpolated_names,
    settings_env_names,
)

from k8s_dispatch.core.settings import ENV_PREFIX, load_settings

APP_SERVICES = ("migrate", "worker", "beat", "flower")
CELERY_APP = ["celery", "-A", "k8s_dispatch.tasks"]


def _environment(service: Doc) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):  # the `- NAME=value` form
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def _binds(service: Doc) -> dict[str, str]:
    """target -> host source of the service's bind mounts (written in the long syntax here)."""
    return {v["target"]: v["source"] for v in service.get("volumes", []) if isinstance(v, dict) and v["type"] == "bind"}


def _duration_s(text: str) -> float:
    """Compose's duration syntax (`1m30s`, `90s`, `2m`)."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"bad duration {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


def test_services_are_the_whole_system(compose: Doc) -> None:
    assert set(compose["services"]) == {"redis", "postgres", *APP_SERVICES}


def test_app_services_share_one_image_built_from_the_dockerfile(compose: Doc) -> None:
    services = compose["services"]
    images = {services[name]["image"] for name in APP_SERVICES}
    assert len(images) == 1
    for name in APP_SERVICES:
        build = services[name]["build"]
        context = build if isinstance(build, str) else build["context"]
        assert (REPO / context / "Dockerfile").is_file()


@pytest.mark.parametrize(
    ("service", "command"),
    [
        ("worker", [*CELERY_APP, "worker", "--loglevel=INFO"]),
        ("beat", [*CELERY_APP, "beat", "--loglevel=INFO"]),
        ("flower", ["k8s-dispatch", "flower", "--port=5555"]),
        ("migrate", ["k8s-dispatch", "migrate"]),
    ],
)
def test_commands(compose: Doc, service: str, command: list[str]) -> None:
    assert compose["services"][service]["command"] == command


def test_migrate_runs_the_installed_console_script() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
    assert "k8s-dispatch" in scripts


def test_celery_app_is_found_where_the_commands_look(tmp_path: Path) -> None:
    # `celery -A k8s_dispatch.tasks` resolves the app with Celery's own finder. Run it in a fresh process
    # outside the tree, as in the image: in this one, tests/tasks/ can shadow the package.
    probe = "from celery.app.utils import find_app; app = find_app('k8s_dispatch.tasks'); print(type(app).__name__, app.main)"
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["Celery", "k8s-dispatch"]


@pytest.mark.parametrize("service", ["redis", "postgres", "worker", "flower"])
def test_long_running_services_have_healthchecks(compose: Doc, service: str) -> None:
    check = compose["services"][service]["healthcheck"]
    assert check["test"][0] in ("CMD", "CMD-SHELL")
    assert _duration_s(check["timeout"]) < _duration_s(check["interval"])


def test_postgres_is_healthy_only_when_it_accepts_tcp(compose: Doc) -> None:
    test = compose["services"]["postgres"]["healthcheck"]["test"]
    assert test[:2] == ["CMD", "pg_isready"]
    assert test[test.index("-h") + 1] == "127.0.0.1"


def test_worker_health_is_a_celery_ping_of_its_own_node(compose: Doc) -> None:
    kind, command = compose["services"]["worker"]["healthcheck"]["test"]
    assert kind == "CMD-SHELL"  # so the container's shell expands $HOSTNAME
    # `$$` in the file is Compose's escape: the shell sees `$HOSTNAME`, Celery's node name.
    assert command.startswith("celery -A k8s_dispatch.tasks inspect ping -d celery@$HOSTNAME ")
    assert "--timeout" in command


def test_flower_health_hits_its_healthcheck_endpoint(compose: Doc) -> None:
    test = compose["services"]["flower"]["healthcheck"]["test"]
    assert "http://127.0.0.1:5555/healthcheck" in test[-1]


def test_start_order_uses_conditions(compose: Doc) -> None:
    services = compose["services"]
    assert services["migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    assert services["worker"]["depends_on"] == {
        "redis": {"condition": "service_healthy"},
        "postgres": {"condition": "service_healthy"},
        "migrate": {"condition": "service_completed_successfully"},
    }
    assert services["beat"]["depends_on"]["redis"] == {"condition": "service_healthy"}
    assert services["flower"]["depends_on"]["redis"] == {"condition": "service_healthy"}


def test_every_dependency_condition_can_be_met(compose: Doc) -> None:
    services = compose["services"]
    for name, service in services.items():
        for dependency, how in service.get("depends_on", {}).items():
            target = services[dependency]
            if how["condition"] == "service_healthy":
                assert "healthcheck" in target, f"{name} waits for {dependency} to be healthy, which has no healthcheck"
            elif how["condition"] == "service_completed_successfully":
                # A one-shot restarted on exit would never stay completed.
                assert target.get("restart", "no") == "no", f"{dependency} is one-shot but restarts"


def test_worker_is_scalable(compose: Doc) -> None:
    worker = compose["services"]["worker"]
    assert "container_name" not in worker  # names are unique: --scale would fail
    assert "ports" not in worker  # a fixed host port is taken by the first replica only
    assert "hostname" not in worker  # Celery node names must differ per replica


def test_worker_stops_gracefully_for_acks_late(compose: Doc) -> None:
    # Docker's default is 10 s; running tasks need time to finish on SIGTERM.
    assert _duration_s(compose["services"]["worker"]["stop_grace_period"]) >= 60


def test_every_k8s_dispatch_variable_is_a_setting(compose: Doc, compose_text: str) -> None:
    known = settings_env_names()
    used = {name for name in interpolated_names(compose_text) if name.startswith(ENV_PREFIX)}
    for service in compose["services"].values():
        used |= {name for name in _environment(service) if name.startswith(ENV_PREFIX)}
    assert used, "the Compose file configures nothing through K8S_DISPATCH_*"
    assert used <= known, f"not fields of core.settings.Settings: {sorted(used - known)}"


@pytest.mark.parametrize("service", APP_SERVICES)
def test_configuration_is_valid_settings(compose: Doc, service: str) -> None:
    """The environment each app service gets builds valid `Settings`, its files mounted."""
    svc = compose["services"][service]
    env = _environment(svc)
    binds = _binds(svc)
    for name in (ENV_PREFIX + "CAPABILITIES", ENV_PREFIX + "KUBECONFIG"):
        if name in env:
            assert env[name] in binds, f"{service}: {name}={env[name]} is not a mounted file"
    if ENV_PREFIX + "CAPABILITIES" in env:
        # Settings checks the file exists: point it at the host file mounted there.
        env[ENV_PREFIX + "CAPABILITIES"] = str(REPO / binds[env[ENV_PREFIX + "CAPABILITIES"]])
    settings = load_settings(env)
    assert settings.database_url.startswith("postgresql+psycopg://")
    assert settings.effective_broker_url == settings.redis_url == "redis://redis:6379/0"


def test_database_url_matches_the_postgres_service(compose: Doc) -> None:
    pg = compose["services"]["postgres"]["environment"]
    url = _environment(compose["services"]["worker"])[ENV_PREFIX + "DATABASE_URL"]
    assert (
        url == f"postgresql+psycopg://{pg['POSTGRES_USER']}:{pg['POSTGRES_PASSWORD']}@postgres:5432/{pg['POSTGRES_DB']}"
    )


def test_worker_mounts_a_kubeconfig_for_a_real_cluster(compose: Doc) -> None:
    worker = compose["services"]["worker"]
    path = _environment(worker)[ENV_PREFIX + "KUBECONFIG"]
    (mount,) = [v for v in worker["volumes"] if isinstance(v, dict) and v["target"] == path]
    assert mount["type"] == "bind" and mount["read_only"] is True
    assert mount["source"] == "~/.kube/config"  # the default, overridable
    # Not created when missing (long syntax): a missing kubeconfig is an error, not a directory.
    assert mount.get("bind", {}).get("create_host_path", False) is False


def test_kubeconfig_path_can_be_overridden(compose_text: str) -> None:
    loaded = yaml.safe_load(interpolate(compose_text, {**COMPOSE_REQUIRED, "KUBECONFIG_FILE": "/srv/kube/prod.yaml"}))
    sources = [v["source"] for v in loaded["services"]["worker"]["volumes"] if isinstance(v, dict)]
    assert "/srv/kube/prod.yaml" in sources


@pytest.mark.parametrize("service", APP_SERVICES)
def test_capabilities_file_is_mounted_where_the_setting_points(compose: Doc, service: str) -> None:
    svc = compose["services"][service]
    path = _environment(svc)[ENV_PREFIX + "CAPABILITIES"]
    source = _binds(svc)[path]
    assert (REPO / source).is_file(), f"default capabilities file {source} is missing"


def test_worker_metrics_port_is_exposed_to_the_network(compose: Doc) -> None:
    worker = compose["services"]["worker"]
    port = _environment(worker)[ENV_PREFIX + "METRICS_PORT"]
    assert port in [str(p) for p in worker["expose"]]


def test_one_shot_and_restart_policies(compose: Doc) -> None:
    services = compose["services"]
    assert services["migrate"]["restart"] == "no"
    for name in ("redis", "postgres", "worker", "beat", "flower"):
        assert services[name]["restart"] == "unless-stopped"


def test_file_parses_without_interpolation_too() -> None:
    # Anchors and merge keys resolve with a plain YAML loader, as Compose's does.
    raw: Any = yaml.safe_load(Path(COMPOSE_FILE).read_text(encoding="utf-8"))
    assert raw["services"]["worker"]["environment"][ENV_PREFIX + "REDIS_URL"] == "redis://redis:6379/0"


def test_flower_requires_a_login_compose_will_not_start_without(compose_text: str, compose: Doc) -> None:
    # No default credentials: with FLOWER_BASIC_AUTH unset, Compose stops with a message.
    with pytest.raises(MissingVariable, match="FLOWER_BASIC_AUTH"):
        interpolate(compose_text, {})
    with pytest.raises(MissingVariable, match="FLOWER_BASIC_AUTH"):
        interpolate(compose_text, {"FLOWER_BASIC_AUTH": ""})
    flower = _environment(compose["services"]["flower"])
    assert flower["FLOWER_BASIC_AUTH"] == COMPOSE_REQUIRED["FLOWER_BASIC_AUTH"]
    # Only Flower holds it; it is not on the command line (`ps` shows that to anyone).
    others = [name for name in APP_SERVICES if name != "flower"]
    assert all("FLOWER_BASIC_AUTH" not in _environment(compose["services"][name]) for name in others)
    assert not any("basic" in word for word in compose["services"]["flower"]["command"])
