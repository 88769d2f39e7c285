"""Which API calls clients made, as RBAC sees them: (API group, resource[/subresource], verb).

Kept as a set, so it is cheap to record on every request; read through the authenticated
`GET /localcluster/audit` endpoint. The project's test of its Role (deploy/rbac.yaml) compares
this record against the Role's rules: a verb the code uses must be granted, and a granted
verb the code never uses should not be.
"""

from __future__ import annotations

from localcluster.paths import Target

Permission = tuple[str, str, str]  # (group, resource, verb), "" for the core group


def verb(method: str, target: Target, *, watch: bool) -> str:
    """The RBAC verb of one request, as the real API server derives it."""
    if watch:
        return "watch"
    if method == "GET":
        return "get" if target.name is not None else "list"
    if method == "POST":
        return "create"
    if method == "PUT":
        return "update"
    if method == "PATCH":
        return "patch"
    if method == "DELETE":
        return "delete" if target.name is not None else "deletecollection"
    return method.lower()


def permission(method: str, target: Target, *, watch: bool) -> Permission:
    resource = target.resource.plural + (f"/{target.subresource}" if target.subresource else "")
    return (target.resource.group, resource, verb(method, target, watch=watch))


class Audit:
    """The set of permissions exercised so far; `clear()` starts a new record."""

    def __init__(self) -> None:
        self._seen: set[Permission] = set()

    def record(self, entry: Permission) -> None:
        self._seen.add(entry)

    def seen(self) -> list[Permission]:
        return sorted(self._seen)

    def clear(self) -> None:
        self._seen.clear()
