"""The HTTP face of the cluster (aiohttp): authentication, fault injection, discovery, OpenAPI,
and the REST verbs on Jobs, Pods, Namespaces and Events — get, list (selectors, pagination, Table
output), watch (streamed, with bookmarks and 410s), create, update, patch, delete,
deletecollection, the status subresource, pods/binding, pods/eviction and pods/log (proxied to an external
node's log endpoint when no kubelet runs in process) — answering errors as `Status` objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from typing import Any

import aiohttp
import yaml
from aiohttp import web
from aiohttp.typedefs import Handler
from multidict import CIMultiDict

from k8s_dispatch.demo.localcluster import apierrors, audit, discovery, eviction, logstream, openapi, paths, tables
from k8s_dispatch.demo.localcluster.apierrors import ApiError
from k8s_dispatch.demo.localcluster.core import ClusterCore
from k8s_dispatch.demo.localcluster.kubelet import Kubelet
from k8s_dispatch.demo.localcluster.paging import Page
from k8s_dispatch.demo.localcluster.registry import PATCH_TYPES, DeleteOptions, DeleteResult, is_terminal_pod
from k8s_dispatch.demo.localcluster.resources import NODES, PODS, Resource
from k8s_dispatch.demo.localcluster.selectors import (
    SelectorError,
    fields_match,
    parse_field_selector,
    parse_label_selector,
)
from k8s_dispatch.demo.localcluster.store import ADDED, Entry, Gone, Watcher, dumps, loads
from k8s_dispatch.demo.localcluster.timestamps import now

PUBLIC_PATHS = frozenset({"/healthz", "/livez", "/readyz", "/version", "/version/"})
NO_FAULT_PATHS = frozenset({"/healthz", "/livez", "/readyz", "/metrics"})
JSON = "application/json"
DEFAULT_WATCH_TIMEOUT = 1800
BOOKMARK_INTERVAL = 5.0
PRE_TIMEOUT_BOOKMARK_S = 2.0
FAULTS_PATH = "/localcluster/faults"
AUDIT_PATH = "/localcluster/audit"
METRICS_PATH = "/metrics"
# set on each resource request, counted once answered
REQUEST_LABELS = web.RequestKey("request_labels", audit.RequestLabels)

CORE_KEY = web.AppKey("core", ClusterCore)
TOKEN_KEY = web.AppKey("token", str)


def _response(
    body: bytes,
    *,
    status: int = 200,
    warnings: list[str] | None = None,
    headers: dict[str, str] | None = None,
    content_type: str = JSON,
) -> web.Response:
    hdrs: CIMultiDict[str] = CIMultiDict(headers or {})
    hdrs["Content-Type"] = content_type
    for w in warnings or []:
        hdrs.add("Warning", f"299 - {json.dumps(w)}")
    return web.Response(body=body, status=status, headers=hdrs)


def error_response(e: ApiError) -> web.Response:
    return _response(dumps(e.status()), status=e.code, headers=e.headers)


def _truthy(value: str | None) -> bool:
    return value is not None and value.lower() in ("true", "1", "yes")


def _int(query: Any, name: str) -> int | None:
    value = query.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise apierrors.bad_request(f"invalid value for {name}: {value!r}") from None


def _wants_table(request: web.Request) -> bool:
    accept = request.headers.get("Accept", "")
    for part in accept.split(","):
        if "as=Table" in part.replace(" ", ""):
            return True
        if part.strip().split(";")[0] in ("application/json", "*/*", "application/*"):
            return False
    return False


# --- middleware ------------------------------------------------------------------------


@web.middleware
async def api_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    core = request.app[CORE_KEY]
    path = request.path
    try:
        if path not in PUBLIC_PATHS:
            header = request.headers.get("Authorization", "")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), request.app[TOKEN_KEY].encode()
            ):
                raise apierrors.unauthorized()
        if path not in NO_FAULT_PATHS and not path.startswith("/localcluster/"):
            if core.faults.latency_ms:
                await asyncio.sleep(core.faults.latency_ms / 1000.0)
            fault = core.faults.draw()
            if fault is not None:
                target = paths.parse(path)
                if target is not None:  # an injected error is counted as any other answer
                    request[REQUEST_LABELS] = audit.request_labels(
                        request.method, target, watch=_watching(request, target)
                    )
                raise fault
        response = await handler(request)
    except ApiError as e:
        response = error_response(e)
    labels = request.get(REQUEST_LABELS)
    if labels is not None:
        core.audit.count(labels, response.status)
    return response


# --- discovery and health ---------------------------------------------------------------


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok", content_type="text/plain")


async def version(request: web.Request) -> web.Response:
    return _response(dumps(discovery.KUBE_VERSION))


async def openapi_index(request: web.Request) -> web.Response:
    return _response(dumps(openapi.index()))


async def openapi_document(request: web.Request) -> web.Response:
    body = openapi.document_bytes(request.match_info["path"].strip("/"))
    if body is None:
        raise apierrors.path_not_found()
    return _response(body)


async def faults_endpoint(request: web.Request) -> web.Response:
    core = request.app[CORE_KEY]
    if request.method == "POST":
        try:
            body = await request.json()
            core.faults.set(
                float(body.get("rate", core.faults.rate)), int(body.get("latency_ms", core.faults.latency_ms))
            )
        except (ValueError, TypeError, AttributeError) as e:
            raise apierrors.bad_request(f"invalid fault settings: {e}") from e
    return _response(
        dumps({"rate": core.faults.rate, "latency_ms": core.faults.latency_ms, "injected": core.faults.injected})
    )


async def metrics_endpoint(request: web.Request) -> web.Response:
    """`apiserver_request_total` in the Prometheus text format (what `kubectl get --raw /metrics` reads)."""
    text = request.app[CORE_KEY].audit.metrics_text()
    return web.Response(
        text=text, content_type="text/plain", charset="utf-8", headers={"X-Content-Type-Options": "nosniff"}
    )


async def audit_endpoint(request: web.Request) -> web.Response:
    """GET: the (group, resource, verb) triples requested so far; DELETE: start afresh."""
    core = request.app[CORE_KEY]
    if request.method == "DELETE":
        core.audit.clear()
    return _response(dumps({"permissions": [list(p) for p in core.audit.seen()]}))


# --- resources --------------------------------------------------------------------------


async def _read_body(request: web.Request) -> Any:
    raw = await request.read()
    if not raw:
        return None
    ctype = request.content_type or JSON
    if "protobuf" in ctype or "cbor" in ctype:
        raise apierrors.unsupported_media_type(ctype)
    try:
        if "yaml" in ctype:
            return yaml.safe_load(raw)
        return loads(raw)
    except (ValueError, yaml.YAMLError) as e:
        raise apierrors.bad_request(f"the body of the request could not be decoded: {e}") from e


def _list_meta(rv: int, page: Page | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"resourceVersion": str(rv)}
    if page is not None and page.continue_token:
        meta["continue"] = page.continue_token
        meta["remainingItemCount"] = page.remaining
    return meta


def _selectors(resource: Resource, query: Any) -> Any:
    try:
        labels = parse_label_selector(query.get("labelSelector"))
        fields = parse_field_selector(query.get("fieldSelector"), set(resource.fields({"metadata": {}})))
    except SelectorError as e:
        raise apierrors.bad_request(str(e)) from e

    if labels.empty and not fields:
        return lambda entry: True

    def predicate(entry: Entry) -> bool:
        obj = entry.obj
        return labels.matches(obj["metadata"].get("labels")) and (
            not fields or fields_match(fields, resource.fields(obj))
        )

    return predicate


def _discovery(request: web.Request) -> web.Response:
    """/api, /api/v1, /apis, /apis/batch, /apis/batch/v1 (GET only)."""
    segs = [s for s in request.path.split("/") if s]
    doc: dict[str, Any] | None = None
    if request.method == "GET":
        if segs == ["api"]:
            doc = discovery.api_versions(request.host)
        elif len(segs) == 2 and segs[0] == "api":
            doc = discovery.resource_list("", segs[1])
        elif segs == ["apis"]:
            doc = discovery.api_group_list()
        elif len(segs) == 2 and segs[0] == "apis":
            doc = discovery.api_group(segs[1])
        elif len(segs) == 3 and segs[0] == "apis":
            doc = discovery.resource_list(segs[1], segs[2])
    if doc is None:
        raise apierrors.path_not_found()
    return _response(dumps(doc))


async def resource_handler(request: web.Request) -> web.StreamResponse:
    target = paths.parse(request.path)
    if target is None:
        return _discovery(request)
    core = request.app[CORE_KEY]
    method = request.method
    query = request.query
    watching = _watching(request, target)
    request[REQUEST_LABELS] = core.audit.record(method, target, watch=watching)
    if watching:
        if method != "GET":
            raise apierrors.method_not_allowed()
        return await _watch(request, core, target)
    if target.subresource == "log":
        if method != "GET":
            raise apierrors.method_not_allowed()
        if core.kubelet is None:
            return await _node_log(request, core, target)
        return await _pod_log(request, core, target, kubelet=core.kubelet)
    if target.subresource == "binding":
        if method != "POST" or target.name is None:
            raise apierrors.method_not_allowed()
        core.registry.bind(target.namespace or "", target.name, await _read_body(request))
        return _response(
            dumps({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}), status=201
        )
    if target.subresource == "eviction":
        if method != "POST" or target.name is None:
            raise apierrors.method_not_allowed()
        eviction.evict(core.registry, target.namespace or "", target.name, await _read_body(request))
        return _response(
            dumps({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}), status=201
        )
    ns = target.namespace or ""
    if target.name is None:
        if method == "GET":
            return _list(request, core, target)
        if method == "POST" and (not target.resource.namespaced or target.namespace is not None):
            return await _create(request, core, target)
        if method == "DELETE" and (target.namespace is not None or not target.resource.namespaced):
            return await _delete_collection(request, core, target)
        raise apierrors.method_not_allowed()
    if method == "GET":
        entry = core.registry.get(target.resource, ns, target.name)
        return _object_response(request, core, target.resource, entry)
    if method == "PUT":
        body = await _read_body(request)
        entry, warnings = core.registry.update(
            target.resource,
            ns,
            target.name,
            body,
            subresource=target.subresource,
            field_validation=query.get("fieldValidation"),
        )
        return _object_response(request, core, target.resource, entry, warnings=warnings)
    if method == "PATCH":
        ctype = request.content_type
        if ctype == "application/apply-patch+yaml":
            raise ApiError(
                415, "UnsupportedMediaType", "server-side apply is not supported by localcluster; use client-side apply"
            )
        if ctype not in PATCH_TYPES:
            raise apierrors.unsupported_media_type(ctype)
        body = await _read_body(request)
        entry, warnings = core.registry.patch(
            target.resource,
            ns,
            target.name,
            ctype,
            body,
            subresource=target.subresource,
            field_validation=query.get("fieldValidation"),
        )
        return _object_response(request, core, target.resource, entry, warnings=warnings)
    if method == "DELETE" and target.subresource is None:
        options = await _delete_options(request)
        result = core.registry.delete(target.resource, ns, target.name, options)
        return _delete_response(request, core, result)
    raise apierrors.method_not_allowed()


def _watching(request: web.Request, target: paths.Target) -> bool:
    return target.watch_path or (
        request.method == "GET" and _truthy(request.query.get("watch")) and target.subresource is None
    )


def _object_response(
    request: web.Request,
    core: ClusterCore,
    resource: Resource,
    entry: Entry,
    *,
    status: int = 200,
    warnings: list[str] | None = None,
) -> web.Response:
    if _wants_table(request):
        table = tables.table(
            resource,
            [entry.obj],
            now(),
            list_meta={"resourceVersion": entry.meta["resourceVersion"]},
            include_object=request.query.get("includeObject", "Metadata"),
        )
        return _response(dumps(table), status=status, warnings=warnings)
    return _response(entry.raw, status=status, warnings=warnings)


async def _create(request: web.Request, core: ClusterCore, target: paths.Target) -> web.Response:
    body = await _read_body(request)
    if body is None:
        raise apierrors.bad_request("the body of the request was empty")
    dry = bool(request.query.get("dryRun"))
    created, warnings = core.registry.create(
        target.resource,
        target.namespace or "",
        body,
        field_validation=request.query.get("fieldValidation"),
        dry_run=dry,
    )
    if isinstance(created, dict):
        return _response(dumps(created), status=201, warnings=warnings)
    return _object_response(request, core, target.resource, created, status=201, warnings=warnings)


def _list(request: web.Request, core: ClusterCore, target: paths.Target) -> web.Response:
    query = request.query
    resource = target.resource
    limit = _int(query, "limit")
    token = query.get("continue")
    if token:
        page = core.pager.next(token, limit)
    else:
        predicate = _selectors(resource, query)
        entries = core.store.list(resource, target.namespace)
        items = [e for e in entries if predicate(e)]
        page = core.pager.first(items, core.store.rv, limit)
    core.audit.listed(resource, len(page.items))
    meta = _list_meta(page.rv, page)
    if _wants_table(request):
        table = tables.table(
            resource,
            [e.obj for e in page.items],
            now(),
            list_meta=meta,
            include_object=query.get("includeObject", "Metadata"),
        )
        return _response(dumps(table))
    head = (
        b'{"kind":"'
        + resource.list_kind.encode()
        + b'","apiVersion":"'
        + resource.api_version.encode()
        + b'","metadata":'
        + dumps(meta)
        + b',"items":['
    )
    return _response(head + b",".join(e.raw for e in page.items) + b"]}")


async def _delete_options(request: web.Request) -> DeleteOptions:
    body = await _read_body(request) or {}
    if not isinstance(body, dict):
        raise apierrors.bad_request("DeleteOptions must be an object")
    query = request.query
    policy = body.get("propagationPolicy") or query.get("propagationPolicy")
    orphan = body.get("orphanDependents")
    if orphan is None and "orphanDependents" in query:
        orphan = _truthy(query.get("orphanDependents"))
    if policy is None and orphan is not None:
        policy = "Orphan" if orphan else "Background"
    grace = body.get("gracePeriodSeconds")
    if grace is None:
        grace = _int(query, "gracePeriodSeconds")
    dry = body.get("dryRun") or query.get("dryRun")
    return DeleteOptions(
        propagation_policy=policy,
        grace_period_seconds=grace,
        preconditions=body.get("preconditions") or {},
        dry_run=bool(dry),
    )


def _delete_response(request: web.Request, core: ClusterCore, result: DeleteResult) -> web.Response:
    entry = result.entry
    if result.removed and entry.resource is not PODS:
        status = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Success",
            "details": {
                "name": entry.name,
                **({"group": entry.resource.group} if entry.resource.group else {}),
                "kind": entry.resource.plural,
                "uid": entry.uid,
            },
        }
        return _response(dumps(status), warnings=result.warnings)
    return _object_response(request, core, entry.resource, entry, warnings=result.warnings)


async def _delete_collection(request: web.Request, core: ClusterCore, target: paths.Target) -> web.Response:
    options = await _delete_options(request)
    predicate = _selectors(target.resource, request.query)
    deleted = []
    warnings: list[str] = []
    for entry in core.store.list(target.resource, target.namespace):
        if not predicate(entry):
            continue
        try:
            result = core.registry.delete(target.resource, entry.namespace, entry.name, options)
        except ApiError as e:
            if e.code == 404:
                continue
            raise
        deleted.append(result.entry)
        warnings = result.warnings
    resource = target.resource
    head = (
        b'{"kind":"'
        + resource.list_kind.encode()
        + b'","apiVersion":"'
        + resource.api_version.encode()
        + b'","metadata":'
        + dumps({"resourceVersion": str(core.store.rv)})
        + b',"items":['
    )
    return _response(head + b",".join(e.raw for e in deleted) + b"]}", warnings=warnings)


# --- watch ------------------------------------------------------------------------------


def _event_bytes(kind: str, obj_bytes: bytes) -> bytes:
    return b'{"type":"' + kind.encode() + b'","object":' + obj_bytes + b"}\n"


async def _watch(request: web.Request, core: ClusterCore, target: paths.Target) -> web.StreamResponse:
    query = request.query
    resource = target.resource
    predicate = _selectors(resource, query)
    if target.name is not None:
        by_name = predicate
        name = target.name
        predicate = lambda e: e.name == name and by_name(e)  # noqa: E731
    timeout = _int(query, "timeoutSeconds") or DEFAULT_WATCH_TIMEOUT
    bookmarks = _truthy(query.get("allowWatchBookmarks"))
    send_initial = query.get("sendInitialEvents")
    as_table = _wants_table(request)
    include_object = query.get("includeObject", "Metadata")
    rv_text = query.get("resourceVersion", "")
    store = core.store

    initial: list[Entry] = []
    gone: int | None = None
    watcher: Watcher | None = None  # None: `since` predates the event log (Gone)
    if rv_text in ("", "0") or _truthy(send_initial):
        initial = [e for e in store.list(resource, target.namespace) if predicate(e)]
        watcher = store.watch(resource, target.namespace, predicate)
    else:
        try:
            since = int(rv_text)
        except ValueError:
            raise apierrors.bad_request(f"invalid resource version: {rv_text!r}") from None
        try:
            watcher = store.watch(resource, target.namespace, predicate, since=since)
        except Gone:
            gone = since

    response = web.StreamResponse(status=200, headers={"Content-Type": JSON, "Cache-Control": "no-cache, private"})
    response.enable_chunked_encoding()
    await response.prepare(request)

    def encode(kind: str, entry: Entry, *, headers: bool) -> bytes:
        if as_table:
            table = tables.table(
                resource,
                [entry.obj],
                now(),
                list_meta={"resourceVersion": entry.meta["resourceVersion"]},
                include_object=include_object,
                headers=headers,
            )
            return _event_bytes(kind, dumps(table))
        return _event_bytes(kind, entry.raw)

    if watcher is None:
        err = apierrors.gone(f"too old resource version: {gone} ({store.compacted_rv + 1})")
        await response.write(_event_bytes("ERROR", dumps(err.status())))
        await response.write_eof()
        return response

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    first = True
    try:
        chunk: list[bytes] = []
        core.audit.watched(resource, len(initial))
        for entry in initial:
            chunk.append(encode(ADDED, entry, headers=first))
            first = False
            if len(chunk) >= 500:
                await response.write(b"".join(chunk))
                chunk = []
        if chunk:
            await response.write(b"".join(chunk))
        if _truthy(send_initial) and bookmarks:
            core.audit.watched(resource, 1)
            await response.write(_bookmark(resource, store.rv, initial_end=True))
        last_sent = loop.time()
        # kube-apiserver's watch cache sends a bookmark this long before a watch's timeout (so
        # that the client resumes close to now; it sends none while nothing changed): so does
        # this server, changes or not
        pre_timeout: float | None = deadline - PRE_TIMEOUT_BOOKMARK_S if bookmarks else None
        if pre_timeout is not None and pre_timeout <= loop.time():
            pre_timeout = None
        while not watcher.closed or watcher.queue:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            wait = min(remaining, BOOKMARK_INTERVAL)
            if pre_timeout is not None:
                wait = max(0.0, min(wait, pre_timeout - loop.time()))
            await watcher.wait(wait)
            if watcher.queue:
                out: list[bytes] = []
                while watcher.queue and len(out) < 1000:
                    kind, entry = watcher.queue.popleft()
                    out.append(encode(kind, entry, headers=first))
                    first = False
                core.audit.watched(resource, len(out))
                await response.write(b"".join(out))
                last_sent = loop.time()
            else:
                pre_timeout_due = pre_timeout is not None and loop.time() >= pre_timeout
                if pre_timeout_due or (bookmarks and loop.time() - last_sent >= BOOKMARK_INTERVAL):
                    if pre_timeout_due:
                        pre_timeout = None
                    core.audit.watched(resource, 1)
                    await response.write(_bookmark(resource, store.rv))
                    last_sent = loop.time()
        if watcher.overflowed:
            err = apierrors.gone("the watch fell too far behind; restart it from a new list")
            await response.write(_event_bytes("ERROR", dumps(err.status())))
        elif watcher.error is not None:  # broken off on purpose (`Store.break_watches`)
            await response.write(_event_bytes("ERROR", dumps(watcher.error)))
    except ConnectionError:  # the client closed its watch (a bounded slice, a stopped informer): normal
        return response
    finally:
        store.unwatch(watcher)
    with contextlib.suppress(ConnectionError):
        await response.write_eof()
    return response


def _bookmark(resource: Resource, rv: int, *, initial_end: bool = False) -> bytes:
    meta: dict[str, Any] = {"resourceVersion": str(rv)}
    if initial_end:
        meta["annotations"] = {"k8s.io/initial-events-end": "true"}
    obj = {"kind": resource.kind, "apiVersion": resource.api_version, "metadata": meta}
    return _event_bytes("BOOKMARK", dumps(obj))


# --- logs -------------------------------------------------------------------------------


def _log_slice(data: bytes, query: Any) -> bytes:
    tail = _int(query, "tailLines")
    if tail is not None:
        lines = data.splitlines(keepends=True)
        data = b"".join(lines[-tail:]) if tail > 0 else b""
    limit = _int(query, "limitBytes")
    if limit is not None and limit >= 0:
        data = data[:limit]
    return data


async def _pod_log(
    request: web.Request, core: ClusterCore, target: paths.Target, *, kubelet: Kubelet
) -> web.StreamResponse:
    ns, name = target.namespace or "", target.name or ""
    entry = core.registry.get(PODS, ns, name)
    containers = [c.get("name") for c in (entry.obj.get("spec") or {}).get("containers") or []]
    container = request.query.get("container") or (containers[0] if containers else "")
    if container not in containers:
        raise apierrors.bad_request(f"container {container} is not valid for pod {name}")
    statuses = (entry.obj.get("status") or {}).get("containerStatuses") or []
    state = (statuses[0].get("state") or {}) if statuses else {}
    if not statuses or ("waiting" in state and not statuses[0].get("lastState")):
        reason = (state.get("waiting") or {}).get("reason", "ContainerCreating")
        raise apierrors.bad_request(f'container "{container}" in pod "{name}" is waiting to start: {reason}')
    data = _log_slice(kubelet.logs(entry), request.query)
    if not _truthy(request.query.get("follow")):
        return _response(data, content_type="text/plain")
    uid = entry.uid

    def done() -> bool:
        current = core.store.get(PODS, ns, name)
        return current is None or current.uid != uid or is_terminal_pod(current.obj)

    return await logstream.follow(request, data, read=lambda: kubelet.logs(entry), done=done)


async def _node_log(request: web.Request, core: ClusterCore, target: paths.Target) -> web.StreamResponse:
    """No kubelet in process: proxy to the Pod's node's log endpoint, as kube-apiserver does (the
    node's InternalIP and kubeletEndpoint port; its serving certificate is not verified, as
    without --kubelet-certificate-authority). The node's errors come back as Status errors."""
    ns, name = target.namespace or "", target.name or ""
    entry = core.registry.get(PODS, ns, name)
    containers = [c.get("name") for c in (entry.obj.get("spec") or {}).get("containers") or []]
    container = request.query.get("container") or (containers[0] if containers else "")
    if container not in containers:
        raise apierrors.bad_request(f"container {container} is not valid for pod {name}")
    node_name = (entry.obj.get("spec") or {}).get("nodeName")
    node = core.store.get(NODES, "", node_name) if node_name else None
    if node is None:
        raise apierrors.bad_request(
            f"pod {name} does not have a host assigned" if not node_name else f'nodes "{node_name}" not found'
        )
    status = node.obj.get("status") or {}
    addresses = {a.get("type"): a.get("address") for a in status.get("addresses") or []}
    host = addresses.get("InternalIP") or addresses.get("Hostname") or "127.0.0.1"
    port = ((status.get("daemonEndpoints") or {}).get("kubeletEndpoint") or {}).get("Port") or 10250
    query = {
        k: v for k, v in request.query.items() if k in ("tailLines", "limitBytes", "follow", "timestamps", "previous")
    }
    url = f"https://{host}:{port}/containerLogs/{ns}/{name}/{container}"
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        try:
            async with session.get(url, params=query, ssl=False) as upstream:
                if upstream.status != 200:
                    text = (await upstream.content.read(4096)).decode(errors="replace").strip()
                    reason = {400: "BadRequest", 404: "NotFound"}.get(upstream.status, "InternalError")
                    raise ApiError(upstream.status, reason, text)
                response = web.StreamResponse(status=200, headers={"Content-Type": "text/plain"})
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        except aiohttp.ClientError as e:
            raise ApiError(500, "InternalError", f'Get "{url}": {e}') from e


# --- app --------------------------------------------------------------------------------


def build_app(core: ClusterCore, token: str) -> web.Application:
    app = web.Application(middlewares=[api_middleware], client_max_size=16 * 1024 * 1024)
    app[CORE_KEY] = core
    app[TOKEN_KEY] = token
    # the API paths first: they are nearly every request
    app.router.add_route("*", "/apis/{tail:.*}", resource_handler)
    app.router.add_route("*", "/api/{tail:.*}", resource_handler)
    app.router.add_route("*", "/apis", resource_handler)
    app.router.add_route("*", "/api", resource_handler)
    for path in ("/healthz", "/livez", "/readyz"):
        app.router.add_get(path, healthz)
    app.router.add_get("/version", version)
    app.router.add_get("/version/", version)
    app.router.add_get("/openapi/v3", openapi_index)
    app.router.add_get("/openapi/v3/", openapi_index)
    app.router.add_get("/openapi/v3/{path:.+}", openapi_document)
    app.router.add_route("*", FAULTS_PATH, faults_endpoint)
    app.router.add_route("*", AUDIT_PATH, audit_endpoint)
    app.router.add_get(METRICS_PATH, metrics_endpoint)

    async def on_shutdown(app: web.Application) -> None:
        app[CORE_KEY].store.close_watchers()

    app.on_shutdown.append(on_shutdown)
    return app
