"""The kubeconfig file clients load as is: one cluster (the https URL and its CA, or the http URL
when TLS is off), one user (a bearer token), one context named `localcluster` with namespace
`default` (pure text + one write)."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

CONTEXT = "localcluster"


def render(url: str, token: str, *, ca_data: str | None = None, namespace: str = "default") -> str:
    cluster: dict[str, str] = {"server": url}
    if ca_data:
        cluster["certificate-authority-data"] = ca_data
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": CONTEXT, "cluster": cluster}],
        "users": [{"name": CONTEXT, "user": {"token": token}}],
        "contexts": [{"name": CONTEXT, "context": {"cluster": CONTEXT, "user": CONTEXT, "namespace": namespace}}],
        "current-context": CONTEXT,
        "preferences": {},
    }
    return yaml.safe_dump(doc, sort_keys=False)


def write(path: Path, url: str, token: str, *, ca_data: str | None = None) -> Path:
    return write_private(path, render(url, token, ca_data=ca_data))


def write_private(path: Path, text: str) -> Path:
    """Write a kubeconfig atomically with mode 0600 (it holds a credential): a client that polls
    for the file never reads it half-written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return path
