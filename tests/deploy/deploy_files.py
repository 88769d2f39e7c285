"""Reading the deployment files: paths, Compose interpolation, YAML documents, setting names.

Shared by the tests in this directory (imported by name: pytest puts this directory on
`sys.path`) and usable by any other test that needs to read deploy/, e.g. the RBAC check.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from k8s_dispatch.core.settings import ENV_PREFIX, Settings

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
COMPOSE_FILE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"

Doc = dict[str, Any]

# Compose's `${NAME}`, `${NAME:-default}`, `${NAME-default}`, `${NAME:?err}`... (`$$` escapes `$`).
# The environment the Compose file needs set (no default on purpose): Flower's login.
COMPOSE_REQUIRED = {"FLOWER_BASIC_AUTH": "admin:test-password"}
_INTERPOLATION = re.compile(r"(?<!\$)\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}")


def settings_env_names() -> set[str]:
    """Every environment variable name `Settings` reads."""
    return {ENV_PREFIX + name.upper() for name in Settings.model_fields}


def interpolate(text: str, environ: Mapping[str, str] | None = None) -> str:
    """Compose's variable interpolation, as `docker compose config` does it with `environ`."""
    environ = environ or {}

    def replace(match: re.Match[str]) -> str:
        name, op, arg = match["name"], match["op"], match["arg"]
        if op in (":-", "-"):
            unset = name not in environ or (op == ":-" and not environ[name])
            return arg if unset else environ[name]
        if op in (":?", "?"):
            unset = name not in environ or (op == ":?" and not environ[name])
            if unset:
                raise MissingVariable(f"{name}: {arg}")
            return environ[name]
        if op is not None:
            raise AssertionError(f"interpolation {match[0]!r} is not used in this project's files")
        return environ.get(name, "")

    return _INTERPOLATION.sub(replace, text).replace("$$", "$")


class MissingVariable(ValueError):
    """A `${NAME:?message}` whose variable is unset: Compose stops with the message."""


def interpolated_names(text: str) -> set[str]:
    return {m["name"] for m in _INTERPOLATION.finditer(text)}


def load_docs(path: Path) -> list[Doc]:
    """The YAML documents of one file, empty documents left out."""
    with path.open(encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def role_permissions(path: Path = DEPLOY / "rbac.yaml") -> set[tuple[str, str, str]]:
    """(API group, resource, verb) for everything the Role in `path` grants ("" = core group)."""
    (role,) = [doc for doc in load_docs(path) if doc["kind"] == "Role"]
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


# --- rendering: the kustomization (kubectl's kustomize) and the chart (helm from tools/) -----------

CHART = DEPLOY / "helm" / "k8s-dispatch"
RELEASE = "k8s-dispatch"  # the release name that gives the chart's objects the kustomization's names


def helm_binary() -> Path:
    """helm, built from its Go module by tools/build.sh (cached: a second call costs a hash)."""
    from k8s_dispatch.lab.realcluster.binaries import build

    return build("helm") / "helm"


def run(args: list[str], *, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)


def render_chart(
    values: Mapping[str, Any] | None = None, *, namespace: str = "k8s-dispatch", workdir: Path
) -> list[Doc]:
    """`helm template` of the chart with `values` (a values file in `workdir`): its objects."""
    args = [str(helm_binary()), "template", RELEASE, str(CHART), "--namespace", namespace]
    if values is not None:
        path = workdir / "values.yaml"
        path.write_text(yaml.safe_dump(dict(values)), encoding="utf-8")
        args += ["--values", str(path)]
    done = run(args)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


SECRET_EXAMPLE = "secret.example.yaml"  # the keys of the Secret the operator makes: applied by nothing


def components() -> list[str]:
    """The kustomization's optional components (deploy/components/*), as paths under deploy/."""
    return sorted(str(p.parent.relative_to(DEPLOY)) for p in DEPLOY.glob("components/*/kustomization.yaml"))


def optional_files() -> list[str]:
    """What the default kustomization leaves out: each component's resources, and the example
    Secret (paths under deploy/)."""
    files = []
    for component in components():
        (doc,) = load_docs(DEPLOY / component / "kustomization.yaml")
        files += [f"{component}/{name}" for name in doc["resources"]]
    return [*files, SECRET_EXAMPLE]


def render_kustomization() -> list[Doc]:
    """deploy/ as `kubectl apply -k deploy/` would send it."""
    done = run(["kubectl", "kustomize", str(DEPLOY)])
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def write_docs(path: Path, docs: list[Doc]) -> Path:
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False), encoding="utf-8")
    return path


def by_kind_name(docs: list[Doc]) -> dict[tuple[str, str, str], Doc]:
    """The objects by (kind, namespace, name)."""
    return {(d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]): d for d in docs}


def role_rules(docs: list[Doc]) -> dict[str, set[tuple[str, str, str]]]:
    """namespace -> (API group, resource, verb) its Roles grant."""
    found: dict[str, set[tuple[str, str, str]]] = {}
    for doc in docs:
        if doc["kind"] != "Role":
            continue
        grants = found.setdefault(doc["metadata"]["namespace"], set())
        for rule in doc["rules"]:
            grants |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    return found
