"""A container's environment and command line as the kubelet builds them (pure): env `value`s,
`valueFrom.fieldRef` (downward API) and `$(VAR)` expansion in env, command and args.
"""

from __future__ import annotations

import re
from typing import Any

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


def container_env(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
    """The variables the container declares, in order, each able to refer to the ones before."""
    env: dict[str, str] = {}
    for var in container.get("env") or []:
        name = var.get("name", "")
        source = var.get("valueFrom") or {}
        if "fieldRef" in source:
            env[name] = field_ref(pod, (source["fieldRef"] or {}).get("fieldPath", ""))
        elif source:
            env[name] = ""  # secrets, config maps and resources do not exist locally
        else:
            env[name] = _expand(var.get("value") or "", env)
    return env


def command_line(container: dict[str, Any], env: dict[str, str]) -> list[str]:
    return [_expand(a, env) for a in (container.get("command") or []) + (container.get("args") or [])]
