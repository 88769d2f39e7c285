"""A container's environment and command line as the kubelet builds them (pure): env `value`s,
`valueFrom.fieldRef` (downward API), `valueFrom.secretKeyRef` and `configMapKeyRef` (read through
a look-up the node gives: its store or its informers' cache) and `$(VAR)` expansion in env,
command and args. A Secret, ConfigMap or key that is missing and not `optional` is a
`ConfigError` worded as the kubelet's: the node keeps the container waiting
(CreateContainerConfigError) until it exists.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable
from typing import Any

Source = tuple[str, str, str]  # (kind, namespace, name): a Secret or ConfigMap an env var reads
Lookup = Callable[[str, str, str], dict[str, Any] | None]  # (kind, namespace, name) -> the object or None

_REF = re.compile(r"\$\$|\$\(([-._a-zA-Z][-._a-zA-Z0-9]*)\)")
_SUBSCRIPT = re.compile(r"^metadata\.(labels|annotations)\['(.+)'\]$")


def _expand(text: str, env: dict[str, str]) -> str:
    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)

    return _REF.sub(sub, text)


def field_ref(pod: dict[str, Any], path: str) -> str:
    meta = pod.get("metadata") or {}
    m = _SUBSCRIPT.match(path)
    if m:
        value: str = (meta.get(m.group(1)) or {}).get(m.group(2), "")
        return value
    if path in ("metadata.labels", "metadata.annotations"):
        items = meta.get(path.split(".")[1]) or {}
        return "\n".join(f'{k}="{v}"' for k, v in sorted(items.items()))
    simple: dict[str, str] = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": (pod.get("spec") or {}).get("nodeName", ""),
        "spec.serviceAccountName": (pod.get("spec") or {}).get("serviceAccountName", ""),
        "status.hostIP": (pod.get("status") or {}).get("hostIP", "127.0.0.1"),
        "status.podIP": (pod.get("status") or {}).get("podIP", "127.0.0.1"),
    }
    return simple.get(path, "")


class ConfigError(Exception):
    """The container's env reads a Secret, ConfigMap or key that does not exist (the message is
    the kubelet's); `source` is what to wait for."""

    def __init__(self, message: str, source: Source) -> None:
        super().__init__(message)
        self.message = message
        self.source = source


def key_ref(namespace: str, value_from: dict[str, Any], lookup: Lookup) -> str | None:
    """The value of a `secretKeyRef` or `configMapKeyRef`, or None when an optional one is missing
    (the variable is then not set). Raises ConfigError for a required one that is missing."""
    if "secretKeyRef" in value_from:
        ref, kind, word = value_from["secretKeyRef"] or {}, "Secret", "secret"
    else:
        ref, kind, word = value_from["configMapKeyRef"] or {}, "ConfigMap", "configmap"
    name, key, optional = ref.get("name", ""), ref.get("key", ""), bool(ref.get("optional"))
    source = (kind, namespace, name)
    obj = lookup(*source)
    if obj is None:
        if optional:
            return None
        raise ConfigError(f'{word} "{name}" not found', source)
    data = obj.get("data") or {}
    if key not in data:
        if optional:
            return None
        raise ConfigError(f"couldn't find key {key} in {kind} {namespace}/{name}", source)
    if kind == "ConfigMap":
        return str(data[key])
    # Go's string(bytes): any bytes; surrogateescape hands invalid UTF-8 to the process unchanged
    return base64.b64decode(data[key]).decode("utf-8", "surrogateescape")


def container_env(pod: dict[str, Any], container: dict[str, Any], lookup: Lookup | None = None) -> dict[str, str]:
    """The variables the container declares, in order, each able to refer to the ones before (a
    value read from a Secret or ConfigMap is taken as is). Without `lookup`, such a value is empty."""
    env: dict[str, str] = {}
    namespace = (pod.get("metadata") or {}).get("namespace", "")
    for var in container.get("env") or []:
        name = var.get("name", "")
        source = var.get("valueFrom") or {}
        if "fieldRef" in source:
            env[name] = field_ref(pod, (source["fieldRef"] or {}).get("fieldPath", ""))
        elif lookup is not None and ("secretKeyRef" in source or "configMapKeyRef" in source):
            value = key_ref(namespace, source, lookup)
            if value is not None:
                env[name] = value
        elif source:
            env[name] = ""  # resources (and any reference with nothing to read it from)
        else:
            env[name] = _expand(var.get("value") or "", env)
    return env


def command_line(container: dict[str, Any], env: dict[str, str]) -> list[str]:
    return [_expand(a, env) for a in (container.get("command") or []) + (container.get("args") or [])]
