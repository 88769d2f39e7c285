"""Reading the deployment files: paths, Compose interpolation, YAML documents, setting names.

Shared by the tests in this directory (imported by name: pytest puts this directory on
`sys.path`) and usable by any other test that needs to read deploy/, e.g. the RBAC check.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from k8s_dispatch.engine.settings import ENV_PREFIX, Settings

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
COMPOSE_FILE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"

Doc = dict[str, Any]

# Compose's `${NAME}`, `${NAME:-default}`, `${NAME-default}`, `${NAME:?err}`... (`$$` escapes `$`).
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
        if op is not None:
            raise AssertionError(f"interpolation {match[0]!r} is not used in this project's files")
        return environ.get(name, "")

    return _INTERPOLATION.sub(replace, text).replace("$$", "$")


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
