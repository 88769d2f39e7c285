"""What the API server counted, and who sent it: `apiserver_request_total` (and the objects LISTs
returned, the watch events sent, the time per request) from two scrapes of /metrics around a
window, and the real server's audit log split by sender (ours, the node's kubelet or agent,
kube-scheduler, each controller). Shared by api_load and the benchmarks built on its steady state."""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Iterable
from datetime import datetime
from typing import NamedTuple

from prometheus_client.parser import text_string_to_metric_families

from k8s_dispatch.lab.bench import services

Key = tuple[str, str, str, int]  # verb, resource, subresource, code
CREATED: Key = ("POST", "jobs", "", 201)
OURS, NODE, CONTROLLERS, BENCH, OTHER = "ours", "node", "controllers", "bench", "other"  # who sent a request
SCHEDULER = "scheduler"  # kube-scheduler (the kubelet node's; the node agent binds its own Pods)


def per_finished_job(requests: Counter[Key], finished: int) -> float:
    """1 per Job for its create (if these requests create Jobs at all), plus every other request
    / the Jobs finished (see `Window.per_job`)."""
    created = requests[CREATED]
    if not created:
        return sum(requests.values()) / finished
    return 1 + (sum(requests.values()) - created) / finished


# --- what the server counted -------------------------------------------------------------


METRIC = "apiserver_request_total"
# The real server's time per request (localcluster has none): its sum and count, by verb, resource, subresource.
DURATION = "apiserver_request_duration_seconds"
SCRAPE: Key = ("GET", "", "/metrics", 200)  # how the real server counts a scrape (localcluster does not)


# What the server sent back, as kube-apiserver (and localcluster) count it: objects LISTs returned
# (from etcd, or from the watch cache) and watch events sent, by resource.
LISTED = ("apiserver_storage_list_returned_objects_total", "apiserver_cache_list_returned_objects_total")
WATCHED = "apiserver_watch_events_total"


class Scrape(NamedTuple):
    requests: Counter[Key]  # apiserver_request_total
    at: float  # when the server read its counters
    seconds: defaultdict[Key, float]  # apiserver_request_duration_seconds_sum, code 0
    timed: defaultdict[Key, float]  # apiserver_request_duration_seconds_count, code 0
    objects: Counter[str]  # "LIST jobs": objects LISTs returned; "WATCH jobs": watch events sent


def scrape(cluster: services.Cluster) -> Scrape:
    """`apiserver_request_total` from the server's /metrics, by verb, resource, subresource, code
    (the bench's own scrapes left out), and when the server read it: as its answer's head
    arrives (the real server's body, every metric of it, takes a while longer); the real one's
    time spent answering, too."""
    conn = cluster.connection()
    try:
        conn.request("GET", "/metrics", headers=cluster.headers())
        response = conn.getresponse()
        at = time.time()
        body = response.read().decode()
    finally:
        conn.close()
    if response.status != 200:
        raise RuntimeError(f"GET /metrics answered {response.status}: {body[:200]}")
    wanted = "\n".join(
        line
        for line in body.splitlines()
        if line.startswith((METRIC, f"{DURATION}_sum", f"{DURATION}_count", *LISTED, WATCHED))
    )
    objects: Counter[str] = Counter()
    counts: Counter[Key] = Counter()
    seconds: defaultdict[Key, float] = defaultdict(float)  # sums of seconds: not counts
    timed: defaultdict[Key, float] = defaultdict(float)
    for family in text_string_to_metric_families(wanted):  # the rest (megabytes, on the real server) left unparsed
        for s in family.samples:
            labels = s.labels
            if s.name == METRIC:
                counts[(labels["verb"], labels["resource"], labels["subresource"], int(labels["code"]))] += int(s.value)
            elif s.name in LISTED or s.name == WATCHED:
                objects[f"{'WATCH' if s.name == WATCHED else 'LIST'} {labels['resource']}"] += int(s.value)
            elif s.name in (f"{DURATION}_sum", f"{DURATION}_count"):
                into = seconds if s.name.endswith("_sum") else timed
                into[(labels["verb"], labels["resource"], labels["subresource"], 0)] += s.value
    del counts[SCRAPE]
    return Scrape(counts, at, seconds, timed, objects)


# The audit log's verbs as apiserver_request_total spells them (a deletecollection is a DELETE there).
METRIC_VERBS = {"get": "GET", "list": "LIST", "watch": "WATCH", "create": "POST", "update": "PUT", "patch": "PATCH",
                "delete": "DELETE", "deletecollection": "DELETE"}  # fmt: skip


def actor(user: str, user_agent: str, *, admin: str) -> str:
    """Who sent a request, by its user: "node", a controller's ServiceAccount ("job-controller",
    "generic-garbage-collector", ...), "ours" (the admin's, the worker and beat) or "bench"
    (the admin's with the bench's user agent); any other user as it is (e.g. system:apiserver)."""
    if user.startswith("system:node:"):
        return NODE
    if user == "system:kube-scheduler":
        return SCHEDULER
    if user.startswith("system:serviceaccount:kube-system:"):
        return user.rsplit(":", 1)[1]
    if user == admin:
        return BENCH if user_agent.startswith(services.BENCH_USER_AGENT) else OURS
    return user


def actor_group(name: str) -> str:
    """OURS, NODE, BENCH, CONTROLLERS (a kube-system ServiceAccount or the controller manager
    itself) or OTHER."""
    if name in (OURS, NODE, BENCH, SCHEDULER):
        return name
    if name == "system:kube-controller-manager" or not name.startswith("system:"):
        return CONTROLLERS
    return OTHER


def audited(lines: Iterable[str], *, admin: str, leave_out: frozenset[str] = frozenset()) -> dict[str, Counter[Key]]:
    """The requests of the audit log's JSON `lines` that the server counted between the bench's
    last two scrapes of /metrics, by sender (`actor`) and verb, resource, subresource, code, as
    apiserver_request_total counts them: those answered after the first scrape was received and
    before the second was (the counter is read as a scrape arrives, a request counted once
    answered). Empty unless the two scrapes are in `lines`."""
    events, scrapes = [], []
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:  # the last line, half-written
            continue
        if event.get("stage") != "ResponseComplete":
            continue
        who = actor((event.get("user") or {}).get("username", ""), event.get("userAgent", ""), admin=admin)
        if who == BENCH and event.get("requestURI", "").startswith("/metrics"):
            scrapes.append(_time(event["requestReceivedTimestamp"]))
        events.append((who, event))
    out: dict[str, Counter[Key]] = {}
    if len(scrapes) < 2:
        return out
    since, until = scrapes[-2], scrapes[-1]
    for who, event in events:
        if not since < _time(event["stageTimestamp"]) <= until:
            continue
        ref, code = event.get("objectRef") or {}, int((event.get("responseStatus") or {}).get("code", 0))
        if ref.get("namespace") in leave_out:  # the bench's own Jobs there, and every request they cause
            continue
        if ref.get("resource"):
            key: Key = (METRIC_VERBS.get(event["verb"], event["verb"].upper()), ref["resource"], ref.get("subresource", ""),
                        code)  # fmt: skip
        else:  # a non-resource path (/healthz, /openapi/v3...)
            key = (event["verb"].upper(), "", urllib.parse.urlsplit(event.get("requestURI", "")).path, code)
        out.setdefault(who, Counter())[key] += 1
    return out


def _time(stamp: str) -> float:
    """An audit timestamp (RFC 3339, microseconds) as a Unix time."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def breakdown(requests: Counter[Key], *, seconds: float) -> str:
    """ "LIST jobs 12 (0.8/s), POST jobs 301 ..." for a note, largest first."""
    parts = []
    for (verb, resource, sub, code), n in requests.most_common():
        what = (
            f"{verb} {resource + ('/' + sub if sub else '') if resource else sub}{'' if code < 400 else f' [{code}]'}"
        )
        parts.append(f"{what} {n} ({n / seconds:.1f}/s)")
    return ", ".join(parts)


def server_ms(first: Scrape, last: Scrape) -> dict[str, float]:
    """The server's mean time per request between two scrapes, in ms, by "VERB resource[/sub]"
    (requests the window timed), slowest first; empty for localcluster, which does not time them."""
    out = {}
    for key, count in last.timed.items():
        n = count - first.timed[key]
        if n > 0:
            verb, resource, sub, _ = key
            name = f"{verb} {resource + ('/' + sub if sub else '') if resource else sub}"
            out[name] = round(1000 * (last.seconds[key] - first.seconds[key]) / n, 1)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def pods_behind(counts: Counter[Key]) -> int:
    """Jobs created so far (the server's counter, every sender's) that have no Pod created and bound
    yet: in a steady state only the last second or two of creates; many more while the real Job
    controller and node agent are still working through the first N."""
    pods = min(counts[("POST", "pods", "", 201)], counts[("POST", "pods", "binding", 201)])
    return max(0, counts[CREATED] - pods)


def _by_verb(requests: Counter[Key]) -> dict[str, int]:
    return {f"{v} {r + ('/' + s if s else '') if r else s} {c}": k for (v, r, s, c), k in requests.items()}
