"""Which API calls clients made: as RBAC sees them, and counted as a real API server counts them.

Two records, both cheap enough to keep on every request. The set of (API group,
resource[/subresource], RBAC verb) triples, read through the authenticated
`GET /localcluster/audit` endpoint: the project's test of its Role (deploy/rbac.yaml) compares it
against the Role's rules. And `apiserver_request_total`, the kube-apiserver's request counter with
its labels (verb as the server reports it: GET, LIST, WATCH, POST, PUT, PATCH, DELETE, a
collection's delete a DELETE of scope namespace or cluster as there; group, version, resource,
subresource, scope, component, code), and what the server sent back as kube-apiserver counts it:
the objects its LISTs returned (`apiserver_storage_list_returned_objects_total`, group and
resource) and the watch events it sent (`apiserver_watch_events_total`, group, version, resource),
served as Prometheus text on `GET /metrics`: what the benchmarks read to count requests and
objects read per Job. And when each of the last ANSWERS requests was answered, with its verb and
code (`time.monotonic()`, this process's clock; injected faults included), so a test can check a
client's rate limit over any window, and that it sent nothing while a 429's Retry-After was in force.
"""

from __future__ import annotations

import functools
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import NamedTuple

from k8s_dispatch.demo.localcluster.paths import Target
from k8s_dispatch.demo.localcluster.resources import Resource

Permission = tuple[str, str, str]  # (group, resource, verb), "" for the core group

METRIC = "apiserver_request_total"
COMPONENT = "apiserver"
# The verb the server's metrics report for each RBAC verb (k8s.io/apiserver endpoints/metrics).
METRIC_VERBS = {
    "get": "GET",
    "list": "LIST",
    "watch": "WATCH",
    "create": "POST",
    "update": "PUT",
    "patch": "PATCH",
    "delete": "DELETE",
    "deletecollection": "DELETE",  # kube-apiserver's metrics: a DELETE of scope namespace or cluster
}
LIST_OBJECTS = "apiserver_storage_list_returned_objects_total"
WATCH_EVENTS = "apiserver_watch_events_total"
LABEL_NAMES = ("verb", "group", "version", "resource", "subresource", "scope", "component", "code")
ANSWERS = 100_000  # answers kept (a few MB at most)


class RequestLabels(NamedTuple):
    """The labels of one request in `apiserver_request_total`, but its response code."""

    verb: str
    group: str
    version: str
    resource: str
    subresource: str
    scope: str  # resource (one named object, or a create), namespace, cluster


class Answer(NamedTuple):
    at: float  # time.monotonic() when it was answered
    verb: str  # as the metrics name it: "POST", "LIST"...
    code: int


@dataclass(frozen=True, slots=True)
class RequestCount:
    """How many requests with these labels got this code (a dataclass: a tuple's `count` is taken)."""

    labels: RequestLabels
    code: int
    count: int


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


def scope(method: str, target: Target) -> str:
    """As the server's route installer sets it: a named object or a create is "resource", a
    collection in one namespace "namespace", any other collection "cluster"."""
    if target.name is not None or method == "POST":
        return "resource"
    return "namespace" if target.namespace is not None else "cluster"


def request_labels(method: str, target: Target, *, watch: bool) -> RequestLabels:
    rbac_verb = verb(method, target, watch=watch)
    resource = target.resource
    return RequestLabels(
        verb=METRIC_VERBS.get(rbac_verb, method.upper()),
        group=resource.group,
        version=resource.version,
        resource=resource.plural,
        subresource=target.subresource or "",
        scope=scope(method, target),
    )


@functools.lru_cache(maxsize=512)
def _classified(
    method: str, resource: Resource, in_namespace: bool, named: bool, subresource: str | None, watch: bool
) -> tuple[Permission, RequestLabels]:
    """Both records' keys for a kind of request (a few dozen kinds: cached, so the hook stays cheap)."""
    target = Target(resource, "" if in_namespace else None, "" if named else None, subresource, False)
    return permission(method, target, watch=watch), request_labels(method, target, watch=watch)


class Audit:
    """The permissions exercised (`clear()` starts a new record) and the request counters (never
    reset: Prometheus counters only grow, readers take differences)."""

    def __init__(self) -> None:
        self._seen: set[Permission] = set()
        self._requests: Counter[tuple[RequestLabels, int]] = Counter()
        self._listed: Counter[tuple[str, str]] = Counter()  # (group, resource): objects LISTs returned
        self._watched: Counter[tuple[str, str, str]] = Counter()  # (group, version, resource): events sent
        self._answers: deque[Answer] = deque(maxlen=ANSWERS)

    def record(self, method: str, target: Target, *, watch: bool) -> RequestLabels:
        """Note a request's permission as it arrives; its labels, for `count` once it is answered."""
        entry, labels = _classified(
            method, target.resource, target.namespace is not None, target.name is not None, target.subresource, watch
        )
        self._seen.add(entry)
        return labels

    def count(self, labels: RequestLabels, code: int) -> None:
        self._requests[(labels, code)] += 1
        self._answers.append(Answer(time.monotonic(), labels.verb, code))

    def answers(self) -> list[Answer]:
        """The last ANSWERS requests answered, oldest first."""
        return list(self._answers)

    def listed(self, resource: Resource, objects: int) -> None:
        """Count the objects one LIST (one page of it) returned."""
        self._listed[(resource.group, resource.plural)] += objects

    def watched(self, resource: Resource, events: int) -> None:
        """Count watch events sent to a client (bookmarks too, as kube-apiserver does)."""
        self._watched[(resource.group, resource.version, resource.plural)] += events

    def objects_read(self) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str, str], int]]:
        """(objects LISTs returned by (group, resource), watch events sent by (group, version, resource))."""
        return dict(self._listed), dict(self._watched)

    def seen(self) -> list[Permission]:
        return sorted(self._seen)

    def clear(self) -> None:
        self._seen.clear()

    def request_counts(self) -> list[RequestCount]:
        return [RequestCount(labels, code, n) for (labels, code), n in sorted(self._requests.items())]

    def metrics_text(self) -> str:
        """The counters in the Prometheus text format (version 0.0.4), as /metrics serves them."""
        lines = [
            f"# HELP {METRIC} [STABLE] Counter of apiserver requests broken out for each verb, group, version, "
            "resource, scope, component, and HTTP response code.",
            f"# TYPE {METRIC} counter",
        ]
        for row in self.request_counts():
            values = (*row.labels, COMPONENT, str(row.code))
            text = ",".join(f'{name}="{value}"' for name, value in zip(LABEL_NAMES, values, strict=True))
            lines.append(f"{METRIC}{{{text}}} {row.count}")
        lines += [
            f"# HELP {LIST_OBJECTS} [ALPHA] Number of objects returned for a LIST request from storage",
            f"# TYPE {LIST_OBJECTS} counter",
            *(f'{LIST_OBJECTS}{{group="{g}",resource="{r}"}} {n}' for (g, r), n in sorted(self._listed.items())),
            f"# HELP {WATCH_EVENTS} [ALPHA] Number of events sent in watch clients",
            f"# TYPE {WATCH_EVENTS} counter",
            *(
                f'{WATCH_EVENTS}{{group="{g}",resource="{r}",version="{v}"}} {n}'
                for (g, v, r), n in sorted(self._watched.items())
            ),
        ]
        return "\n".join(lines) + "\n"
