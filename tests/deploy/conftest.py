"""Fixtures for the deployment files: the Compose file, the Dockerfile and deploy/, parsed.

No Docker engine or cluster is needed: every check reads the files, and the Kubernetes
objects are validated against the official client's models.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import yaml
from deploy_files import COMPOSE_FILE, COMPOSE_REQUIRED, DEPLOY, Doc, interpolate, load_docs, optional_files
from kubernetes.client import ApiClient


@pytest.fixture(scope="session")
def compose_text() -> str:
    return COMPOSE_FILE.read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def compose(compose_text: str) -> Doc:
    """The Compose file with variables interpolated from their defaults (an environment with only
    the required variables set)."""
    loaded = yaml.safe_load(interpolate(compose_text, COMPOSE_REQUIRED))
    assert isinstance(loaded, dict)
    return loaded


@pytest.fixture(scope="session")
def kustomization() -> Doc:
    (doc,) = load_docs(DEPLOY / "kustomization.yaml")
    return doc


@pytest.fixture(scope="session")
def manifests(kustomization: Doc) -> list[tuple[str, Doc]]:
    """(file name, object) for every object an operator applies from deploy/: the kustomization's
    resources, its optional components' (KEDA) and the Secret they make after the example."""
    files = [*kustomization["resources"], *optional_files()]
    return [(name, doc) for name in files for doc in load_docs(DEPLOY / name)]


@pytest.fixture(scope="session")
def objects(manifests: list[tuple[str, Doc]]) -> dict[tuple[str, str], Doc]:
    """The objects by (kind, name); a duplicate fails here."""
    found: dict[tuple[str, str], Doc] = {}
    for file, doc in manifests:
        key = (doc["kind"], doc["metadata"]["name"])
        assert key not in found, f"{key} defined twice (again in {file})"
        found[key] = doc
    return found


@pytest.fixture(scope="session")
def api_client() -> Iterator[ApiClient]:
    client = ApiClient()
    yield client
    client.close()
