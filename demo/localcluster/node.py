"""The node agent (`localcluster node`): a kubelet of ours for any API server, over HTTP. It
registers a Node and keeps it Ready (a Lease renewed every 10 s, a status heartbeat), binds
unscheduled Pods to itself through `pods/binding` as a scheduler would, and runs the Pods bound
to it with the same Kubelet decisions and runners as localcluster's in-process node
(demo/localcluster/kubelet.py), reporting status through `pods/status` (keeping the conditions others
wrote, such as the Eviction API's DisruptionTarget), and evicts the Pods the `evict-attempts`
annotation names through `pods/eviction`. It serves the kubelet's log
endpoint (HTTPS) that the API server proxies `kubectl logs` to.

`RemoteHost` is the Kubelet's host here: two informers (Pods with `spec.nodeName=NODE`, and
unbound ones) keep a cache, and a status manager (as the kubelet's) writes the last status
decided for each Pod, then deletes a deleting Pod with grace 0 once its containers stopped. Two
more informers keep the Secrets and ConfigMaps a container's env reads (`secretKeyRef`,
`configMapKeyRef`); they have listed once before the first Pod is looked at, so an existing
Secret is never reported missing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import platform
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from k8s_dispatch.demo.localcluster import logstream, podstatus, tls
from k8s_dispatch.demo.localcluster.apiclient import JSON_PATCH, MERGE_PATCH, ApiClient, ApiStatusError
from k8s_dispatch.demo.localcluster.execrunner import ExecRunner
from k8s_dispatch.demo.localcluster.kubelet import Key, Kubelet
from k8s_dispatch.demo.localcluster.podstatus import HOST_IP, ContainerResult
from k8s_dispatch.demo.localcluster.registry import is_terminal_pod
from k8s_dispatch.demo.localcluster.simrunner import SimRunner
from k8s_dispatch.demo.localcluster.timestamps import now, rfc3339

log = logging.getLogger("localcluster.node")

KUBELET_VERSION = "v1.36.3-localcluster"
LEASE_NAMESPACE = "kube-node-lease"
LEASE_DURATION = 40
LEASE_RENEW = 10.0
STATUS_HEARTBEAT = 60.0
WATCH_TIMEOUT = 300
LIST_PAGE = 500
SCHEDULER = "default-scheduler"
CAPACITY = {"cpu": "128", "memory": "512Gi", "pods": "10000", "ephemeral-storage": "1Ti"}
RETRY_MAX = 10.0
_REACH_ERRORS = (aiohttp.ClientError, TimeoutError, ConnectionError)


def micro_time(ts: float) -> str:
    """metav1.MicroTime, as a Lease's renewTime is written."""
    return rfc3339(ts)[:-1] + f".{int(ts * 1_000_000) % 1_000_000:06d}Z"


def _key(obj: dict[str, Any]) -> Key:
    meta = obj.get("metadata") or {}
    return meta.get("namespace", ""), meta.get("name", "")


async def _healthz(request: web.Request) -> web.Response:
    """A coroutine: aiohttp warns of (and will refuse) a plain function as a handler."""
    return web.Response(text="ok")


def _uid(obj: dict[str, Any]) -> str:
    uid: str = (obj.get("metadata") or {}).get("uid", "")
    return uid


def schedulable(pod: dict[str, Any]) -> bool:
    """Whether a scheduler of the default name binds this unbound Pod now (pure)."""
    spec = pod.get("spec") or {}
    return (
        not spec.get("nodeName")
        and spec.get("schedulerName", SCHEDULER) in ("", SCHEDULER)
        and not spec.get("schedulingGates")
        and not (pod.get("metadata") or {}).get("deletionTimestamp")
    )


def node_status(*, log_port: int, heartbeat: float, started: float, mode: str) -> dict[str, Any]:
    """The Node's status as this agent reports it (pure)."""

    def cond(kind: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
        return {
            "type": kind,
            "status": "True" if ok else "False",
            "lastHeartbeatTime": rfc3339(heartbeat),
            "lastTransitionTime": rfc3339(started),
            "reason": reason,
            "message": message,
        }

    return {
        "capacity": dict(CAPACITY),
        "allocatable": dict(CAPACITY),
        "conditions": [
            cond("MemoryPressure", False, "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
            cond("DiskPressure", False, "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
            cond("PIDPressure", False, "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
            cond("Ready", True, "KubeletReady", "kubelet is posting ready status"),
        ],
        # localhost, not the machine's name: the API server dials the Hostname address first
        # (its default --kubelet-preferred-address-types) and the log endpoint listens on loopback
        "addresses": [{"type": "InternalIP", "address": HOST_IP}, {"type": "Hostname", "address": "localhost"}],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": log_port}},
        "nodeInfo": {
            "machineID": "",
            "systemUUID": "",
            "bootID": "",
            "kernelVersion": platform.release(),
            "osImage": f"localcluster node ({mode} mode)",
            "containerRuntimeVersion": f"localcluster://{mode}",
            "kubeletVersion": KUBELET_VERSION,
            "kubeProxyVersion": "",
            "operatingSystem": "linux",
            "architecture": {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine()),
        },
    }


def log_slice(data: bytes, *, tail_lines: int | None, limit_bytes: int | None) -> bytes:
    """A container log as `tailLines` and `limitBytes` cut it (pure)."""
    if tail_lines is not None:
        data = b"".join(data.splitlines(keepends=True)[-tail_lines:]) if tail_lines > 0 else b""
    if limit_bytes is not None and limit_bytes >= 0:
        data = data[:limit_bytes]
    return data


class RemoteHost:
    """The Kubelet's host over the API: the informers' cache, the bindings, the status manager."""

    def __init__(
        self, api: ApiClient, *, node_name: str, loop: asyncio.AbstractEventLoop, concurrency: int = 16
    ) -> None:
        self.api = api
        self.node_name = node_name
        self._loop = loop
        self.kubelet: Kubelet | None = None
        self._bound: dict[Key, dict[str, Any]] = {}
        self._unbound: dict[Key, dict[str, Any]] = {}
        self._reported: dict[str, dict[str, Any]] = {}  # uid -> status last decided here
        self._sent: dict[str, dict[str, Any]] = {}  # uid -> status the server acknowledged
        self._keys: dict[str, Key] = {}  # uid -> key of the Pods reported on
        self._binding: set[str] = set()
        self._confirmed: set[str] = set()  # uids deleted with grace 0 by us
        self._syncing: dict[str, asyncio.Task[None]] = {}
        self._again: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._limit = asyncio.Semaphore(concurrency)
        self._sources: dict[str, dict[Key, dict[str, Any]]] = {"Secret": {}, "ConfigMap": {}}
        self.synced = asyncio.Event()  # both informers have listed once

    # --- PodHost ---------------------------------------------------------------------

    def keys(self) -> list[Key]:
        return list(self._bound)

    def pod(self, key: Key) -> dict[str, Any] | None:
        obj = self._bound.get(key) or self._unbound.get(key)
        if obj is None:
            return None
        status = self._reported.get(_uid(obj))
        return (
            obj if status is None else {**obj, "status": podstatus.with_foreign_conditions(status, obj.get("status"))}
        )

    def bind(self, pod: dict[str, Any]) -> None:
        uid = _uid(pod)
        if uid not in self._binding and schedulable(pod):
            self._binding.add(uid)
            self._spawn(self._bind(pod))
        return None

    def report(self, pod: dict[str, Any], status: dict[str, Any]) -> None:
        uid = _uid(pod)
        self._reported[uid] = status
        self._keys[uid] = _key(pod)
        self._sync_soon(uid)

    def evict(self, pod: dict[str, Any]) -> None:
        self._spawn(self._evict(pod))

    def env_source(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self._sources[kind].get((namespace, name))

    # --- informers -------------------------------------------------------------------

    async def inform(self, *, bound: bool, ready: asyncio.Event) -> None:
        """LIST then WATCH one selection of Pods (`_list_and_watch`): this node's, or the unbound."""
        selector = f"spec.nodeName={self.node_name}" if bound else "spec.nodeName="

        def on_event(kind: str, obj: dict[str, Any]) -> None:
            self._event(kind, obj, bound=bound)

        await self._list_and_watch(
            "/api/v1/pods", selector, on_list=lambda items: self._relisted(items, bound=bound), on_event=on_event,
            ready=ready, what=f"pod watch ({selector})",
        )  # fmt: skip

    async def inform_sources(self, kind: str, *, ready: asyncio.Event) -> None:
        """LIST then WATCH every Secret or ConfigMap (`kind`), as `inform` does Pods: the cache
        `env_source` reads; each one written tells the Kubelet, whose waiting Pods may start."""
        kubelet = self.kubelet
        assert kubelet is not None
        cache = self._sources[kind]

        def on_list(items: list[dict[str, Any]]) -> None:
            cache.clear()
            cache.update({_key(o): o for o in items})
            for key in cache:
                kubelet.source_changed(kind, *key)

        def on_event(event_kind: str, obj: dict[str, Any]) -> None:
            if event_kind == "DELETED":
                cache.pop(_key(obj), None)
            elif event_kind in ("ADDED", "MODIFIED"):
                cache[_key(obj)] = obj
                kubelet.source_changed(kind, *_key(obj))

        path = "/api/v1/secrets" if kind == "Secret" else "/api/v1/configmaps"
        await self._list_and_watch(path, "", on_list=on_list, on_event=on_event, ready=ready, what=f"{kind} watch")

    async def _list_and_watch(
        self,
        path: str,
        selector: str,
        *,
        on_list: Callable[[list[dict[str, Any]]], None],
        on_event: Callable[[str, dict[str, Any]], None],
        ready: asyncio.Event,
        what: str,
    ) -> None:
        """client-go's ListAndWatch: LIST (`on_list`, then `ready` set), then WATCH from its
        resourceVersion (`on_event` for each event but bookmarks), resuming from the last version
        seen, listing again on 410 Gone, reconnecting with backoff on errors; for ever."""
        rv: str | None = None
        backoff = 0.2
        while True:
            try:
                if rv is None:
                    items, rv = await self._list(selector, path)
                    on_list(items)
                    ready.set()
                params = {"resourceVersion": rv, "allowWatchBookmarks": "true"}
                if selector:
                    params["fieldSelector"] = selector
                opened, events = self._loop.time(), 0
                async for event in self.api.watch(path, params=params, timeout=WATCH_TIMEOUT):
                    obj = event.get("object") or {}
                    rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                    if event.get("type") != "BOOKMARK":
                        events += 1
                        on_event(str(event.get("type", "")), obj)
                # A server ending every watch at once is not asked again at once. A watch that ended
                # soon after events is resumed at once: the API server may end a node's watch within
                # a second in a burst of its Pods' changes, and waiting then would hold this node's
                # Pods back for the whole backoff (Pods bound here waited Pending, 10 s at a time).
                if self._loop.time() - opened < 1.0 and not events:
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, RETRY_MAX)
                else:
                    backoff = 0.2
            except ApiStatusError as e:
                if e.code == 410:
                    rv = None
                    continue
                log.warning("%s: %s", what, e)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, RETRY_MAX)
            except _REACH_ERRORS as e:
                log.warning("%s: %s: %s", what, type(e).__name__, e)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, RETRY_MAX)

    async def _list(self, selector: str, path: str = "/api/v1/pods") -> tuple[list[dict[str, Any]], str]:
        items: list[dict[str, Any]] = []
        params: dict[str, Any] = {"fieldSelector": selector, "limit": str(LIST_PAGE)}
        while True:
            page = await self.api.request("GET", path, params=params)
            items.extend(page.get("items") or [])
            meta = page.get("metadata") or {}
            if not meta.get("continue"):
                return items, meta.get("resourceVersion", "")
            params = {"fieldSelector": selector, "limit": str(LIST_PAGE), "continue": meta["continue"]}

    def _relisted(self, items: list[dict[str, Any]], *, bound: bool) -> None:
        cache = self._bound if bound else self._unbound
        fresh = {_key(o): o for o in items if bound or schedulable(o)}
        for key, old in list(cache.items()):
            new = fresh.get(key)
            if new is None or _uid(new) != _uid(old):
                self._event("DELETED", old, bound=bound)
        for obj in fresh.values():
            self._event("MODIFIED", obj, bound=bound)

    def _event(self, kind: str, obj: dict[str, Any], *, bound: bool) -> None:
        assert self.kubelet is not None
        key, uid = _key(obj), _uid(obj)
        cache = self._bound if bound else self._unbound
        if kind == "DELETED" or (not bound and not schedulable(obj)):
            old = cache.pop(key, None)
            if bound:
                self._gone(uid)
                if old is not None and _uid(old) != uid:
                    self._gone(_uid(old))
            else:
                self._binding.discard(uid)
            self.kubelet.mark(key)
            return
        old = cache.get(key)
        cache[key] = obj
        if bound and old is not None and _uid(old) != uid:
            self._gone(_uid(old))
        if bound and (obj.get("metadata") or {}).get("deletionTimestamp"):
            self._sync_soon(uid)  # a terminated Pod being deleted: confirm it
        self.kubelet.mark(key)

    def _gone(self, uid: str) -> None:
        assert self.kubelet is not None
        self.kubelet.forget(uid)
        for d in (self._reported, self._sent, self._keys):
            d.pop(uid, None)
        self._confirmed.discard(uid)

    # --- writes ----------------------------------------------------------------------

    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _retrying(self, what: str, call: Callable[[], Any]) -> None:
        """Run `call` until it is done or refused (a 4xx is the caller's to read), with backoff."""
        backoff = 0.2
        while True:
            try:
                async with self._limit:
                    await call()
                return
            except ApiStatusError as e:
                if not e.transient:
                    raise
                log.warning("%s: %s", what, e)
            except _REACH_ERRORS as e:
                log.warning("%s: %s: %s", what, type(e).__name__, e)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, RETRY_MAX)

    async def _bind(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        ns, name = meta.get("namespace", ""), meta["name"]
        binding = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": name, "namespace": ns, "uid": meta.get("uid")},
            "target": {"apiVersion": "v1", "kind": "Node", "name": self.node_name},
        }
        try:
            await self._retrying(
                f"bind {ns}/{name}",
                lambda: self.api.request("POST", f"/api/v1/namespaces/{ns}/pods/{name}/binding", body=binding),
            )
        except ApiStatusError as e:  # bound elsewhere, deleted, or replaced: nothing to do
            log.info("bind %s/%s: %s", ns, name, e)

    async def _evict(self, pod: dict[str, Any]) -> None:
        """POST pods/NAME/eviction (policy/v1): the API server writes the DisruptionTarget
        condition and deletes the Pod; its deletion reaches the kubelet through the watch."""
        meta = pod["metadata"]
        ns, name = meta.get("namespace", ""), meta["name"]
        body = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": ns},
            "deleteOptions": {"preconditions": {"uid": meta.get("uid")}},
        }
        try:
            await self._retrying(
                f"evict {ns}/{name}",
                lambda: self.api.request("POST", f"/api/v1/namespaces/{ns}/pods/{name}/eviction", body=body),
            )
        except ApiStatusError as e:  # gone or replaced meanwhile, or refused by a disruption budget
            log.info("evict %s/%s: %s", ns, name, e)

    def _sync_soon(self, uid: str) -> None:
        if uid in self._syncing:
            self._again.add(uid)
            return
        self._syncing[uid] = self._spawn(self._sync_loop(uid))

    async def _sync_loop(self, uid: str) -> None:
        try:
            while True:
                self._again.discard(uid)
                await self._sync_status(uid)
                if uid not in self._again:
                    return
        finally:
            self._syncing.pop(uid, None)

    async def _sync_status(self, uid: str) -> None:
        """Write the last status decided for this Pod (a JSON patch that first tests its uid);
        then, if the Pod is being deleted and its containers are done, delete it with grace 0."""
        key = self._keys.get(uid)
        server = self._bound.get(key) if key else None
        if key is None:
            server = next((o for o in self._bound.values() if _uid(o) == uid), None)
            key = _key(server) if server is not None else None
        if key is None:
            return
        ns, name = key
        status = self._reported.get(uid)
        if status is not None and self._sent.get(uid) is not status:
            patch = [
                {"op": "test", "path": "/metadata/uid", "value": uid},
                {"op": "replace", "path": "/status", "value": status},
            ]
            try:
                await self._retrying(
                    f"status {ns}/{name}",
                    lambda: self.api.request(
                        "PATCH", f"/api/v1/namespaces/{ns}/pods/{name}/status", body=patch, content_type=JSON_PATCH
                    ),
                )
            except ApiStatusError as e:  # gone (404) or another Pod of that name (422): the watch says so
                log.info("status %s/%s: %s", ns, name, e)
                return
            if self._reported.get(uid) is status:
                self._sent[uid] = status
        server = self._bound.get(key)
        if server is None or _uid(server) != uid or uid in self._confirmed:
            return
        meta = server["metadata"]
        done = status if status is not None else server.get("status") or {}
        if (
            meta.get("deletionTimestamp")
            and is_terminal_pod({"status": done})
            and meta.get("deletionGracePeriodSeconds") != 0
        ):
            self._confirmed.add(uid)
            body = {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0, "preconditions": {"uid": uid}}
            try:
                await self._retrying(
                    f"delete {ns}/{name}",
                    lambda: self.api.request("DELETE", f"/api/v1/namespaces/{ns}/pods/{name}", body=body),
                )
            except ApiStatusError as e:
                log.info("delete %s/%s: %s", ns, name, e)

    async def flush(self, timeout: float) -> None:
        """Wait for the writes in flight (status reports, deletions) to end, at most `timeout`."""
        deadline = self._loop.time() + timeout
        while self._syncing and self._loop.time() < deadline:
            await asyncio.wait(list(self._syncing.values()), timeout=max(0.0, deadline - self._loop.time()))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)

    # --- logs ------------------------------------------------------------------------

    def find(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.pod((namespace, name)) if (namespace, name) in self._bound else None


class NodeAgent:
    """The whole agent on the running loop: `await start()`, then `await close()` on the way out."""

    def __init__(
        self,
        api: ApiClient,
        *,
        mode: str,
        name: str,
        workdir: Path | None = None,
        log_port: int = 0,
        max_running: int | None = None,
        lease_renew: float = LEASE_RENEW,
        status_heartbeat: float = STATUS_HEARTBEAT,
    ) -> None:
        if mode not in ("exec", "simulate"):
            raise ValueError(f"mode must be exec or simulate, got {mode!r}")
        self.api = api
        self.mode = mode
        self.name = name
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="localcluster-node-"))
        self.log_port = log_port
        self._max_running = max_running
        self._lease_renew = lease_renew
        self._status_heartbeat = status_heartbeat
        self.host: RemoteHost | None = None
        self.kubelet: Kubelet | None = None
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._informers: list[asyncio.Task[None]] = []
        self._started = now()
        self._node_uid = ""
        self._registered = False  # the Node is ours to delete on the way out

    # the runner reports to the kubelet (the runner is built before it)
    def started(self, uid: str, started_at: float, container_id: str) -> None:
        if self.kubelet is not None:
            self.kubelet.started(uid, started_at, container_id)

    def finished(self, uid: str, result: ContainerResult) -> None:
        if self.kubelet is not None:
            self.kubelet.finished(uid, result)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        await self._serve_logs()
        await self._register()
        runner: ExecRunner | SimRunner
        if self.mode == "exec":
            runner = ExecRunner(
                self,
                loop=loop,
                workdir=self.workdir / "pods",
                max_running=self._max_running or max(2, 2 * (os.cpu_count() or 1)),
            )
        else:
            runner = SimRunner(self, loop=loop)
        self.host = RemoteHost(self.api, node_name=self.name, loop=loop)
        self.kubelet = self.host.kubelet = Kubelet(self.host, runner, loop=loop)
        listed = [asyncio.Event(), asyncio.Event()]
        self._informers = [
            loop.create_task(self.host.inform_sources("Secret", ready=listed[0])),
            loop.create_task(self.host.inform_sources("ConfigMap", ready=listed[1])),
        ]
        try:  # Secrets and ConfigMaps listed once: a Pod's env reads them when it is first looked at
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in listed)), 30)
        except TimeoutError:
            log.warning("node %s: the first list of Secrets has not come back in 30 s; still trying", self.name)
        ready = [asyncio.Event(), asyncio.Event()]
        self._informers += [
            loop.create_task(self.host.inform(bound=True, ready=ready[0])),
            loop.create_task(self.host.inform(bound=False, ready=ready[1])),
        ]
        self._tasks = [loop.create_task(self._keep_lease()), loop.create_task(self._heartbeat())]
        try:  # both informers listed once: the Pods bound here before a restart are known
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in ready)), 30)
        except TimeoutError:
            log.warning("node %s: the first list of Pods has not come back in 30 s; still trying", self.name)

    # --- node and lease --------------------------------------------------------------

    def _status(self) -> dict[str, Any]:
        return node_status(log_port=self.log_port, heartbeat=now(), started=self._started, mode=self.mode)

    async def _register(self) -> None:
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.name,
                "labels": {
                    "kubernetes.io/hostname": self.name,
                    "kubernetes.io/os": "linux",
                    "localcluster.k8s-dispatch.io/mode": self.mode,
                },
            },
            "spec": {},
            "status": self._status(),
        }
        try:
            created = await self.api.request("POST", "/api/v1/nodes", body=node)
        except ApiStatusError as e:
            if e.code != 409:
                raise
            created = await self.api.request("GET", f"/api/v1/nodes/{self.name}")
        self._node_uid = _uid(created)
        self._registered = True
        await self._post_status()
        await self._renew_lease()

    async def _post_status(self) -> None:
        await self.api.request(
            "PATCH", f"/api/v1/nodes/{self.name}/status", body={"status": self._status()}, content_type=MERGE_PATCH
        )

    async def _renew_lease(self) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases/{self.name}"
        spec = {"renewTime": micro_time(now())}
        try:
            await self.api.request("PATCH", path, body={"spec": spec}, content_type=MERGE_PATCH)
        except ApiStatusError as e:
            if e.code != 404:
                raise
            lease = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {
                    "name": self.name,
                    "namespace": LEASE_NAMESPACE,
                    "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": self.name, "uid": self._node_uid}],
                },
                "spec": {"holderIdentity": self.name, "leaseDurationSeconds": LEASE_DURATION, **spec},
            }
            await self.api.request(
                "POST", f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases", body=lease
            )

    async def _every(self, interval: float, what: str, call: Callable[[], Any]) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await call()
            except (ApiStatusError, *_REACH_ERRORS) as e:
                log.warning("%s: %s", what, e)

    async def _keep_lease(self) -> None:
        await self._every(self._lease_renew, "lease", self._renew_lease)

    async def _heartbeat(self) -> None:
        await self._every(self._status_heartbeat, "node status", self._post_status)

    # --- the log endpoint ------------------------------------------------------------

    async def _serve_logs(self) -> None:
        files = tls.ensure_certificate(self.workdir / "tls", [HOST_IP])
        app = web.Application()
        app.router.add_get("/healthz", _healthz)
        app.router.add_get("/containerLogs/{namespace}/{pod}/{container}", self._container_logs)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, HOST_IP, self.log_port, ssl_context=files.server_context())
        await site.start()
        self.log_port = self._runner.addresses[0][1]

    async def _container_logs(self, request: web.Request) -> web.StreamResponse:
        """GET /containerLogs/NS/POD/CONTAINER (tailLines, limitBytes, follow; timestamps ignored)."""
        ns, name, container = (request.match_info[k] for k in ("namespace", "pod", "container"))
        assert self.host is not None and self.kubelet is not None
        host = self.host
        pod = host.find(ns, name)
        if pod is None:
            return web.Response(status=404, text=f'pod "{ns}/{name}" not found on node "{self.name}"')
        containers = [c.get("name") for c in (pod.get("spec") or {}).get("containers") or []]
        if container not in containers:
            return web.Response(status=400, text=f"container {container} is not valid for pod {name}")
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        state = (statuses[0].get("state") or {}) if statuses else {}
        if not statuses or ("waiting" in state and not statuses[0].get("lastState")):
            reason = (state.get("waiting") or {}).get("reason", "ContainerCreating")
            return web.Response(
                status=400, text=f'container "{container}" in pod "{name}" is waiting to start: {reason}'
            )
        try:
            tail = int(request.query["tailLines"]) if "tailLines" in request.query else None
            limit = int(request.query["limitBytes"]) if "limitBytes" in request.query else None
        except ValueError:
            return web.Response(status=400, text="tailLines and limitBytes must be integers")
        uid = _uid(pod)
        runner = self.kubelet.runner
        data = log_slice(runner.logs(uid), tail_lines=tail, limit_bytes=limit)
        if request.query.get("follow", "").lower() not in ("true", "1"):
            return web.Response(body=data, content_type="text/plain")

        def done() -> bool:
            current = host.find(ns, name)
            return current is None or _uid(current) != uid or is_terminal_pod(current)

        return await logstream.follow(request, data, read=lambda: runner.logs(uid), done=done)

    # --- shutdown --------------------------------------------------------------------

    async def close(self) -> None:
        """Stop taking Pods, stop the containers (their Pods fail as in a node shutdown), write the
        last statuses, then remove the Lease and the Node."""
        for task in self._informers:
            task.cancel()
        if self.kubelet is not None and self.host is not None:
            # within 20 s in all (grace periods are capped at 10 s): what a supervisor waits before SIGKILL
            await self.kubelet.shutdown(timeout=12)
            await self.host.flush(timeout=5)
        for task in self._tasks:
            task.cancel()
        for path in (
            (
                f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases/{self.name}",
                f"/api/v1/nodes/{self.name}",
            )
            if self._registered
            else ()
        ):
            try:
                await self.api.request("DELETE", path)
            except (ApiStatusError, *_REACH_ERRORS) as e:
                log.warning("delete %s: %s", path, e)
        if self.host is not None:
            await self.host.close()
        if self.kubelet is not None:
            await self.kubelet.close()
        if self._runner is not None:
            await self._runner.cleanup()
        await asyncio.gather(*self._informers, *self._tasks, return_exceptions=True)
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
