"""The Kubernetes adapter: the one module that imports `kubernetes` and talks to the API.

Calls return plain dicts in the API's own camelCase JSON shape: responses are read raw
(`_preload_content=False`) and json-decoded, far cheaper than the client's model
deserialisation on big lists. The hot single-object writes (create a Job, patch its
finalizers) skip the generated methods altogether (`_request`): the body is serialised once
and sent through the ApiClient's own urllib3 pool, with its auth header. Every call has a
timeout, and every failure is mapped onto `core.errors` (raised `from` the client's
exception), so no caller sees a `kubernetes` type. Every request waits for the process's API
budget first (`workers/budget.py`), honours a 429's `Retry-After` (the whole process waits it
out, then the request is sent again) and is timed (`workers/kube_metrics.py`).
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import quote

import orjson
import pydantic
import urllib3
import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from k8s_dispatch.core.errors import (
    AlreadyExists,
    ApiRejected,
    ApiUnavailable,
    AuthorizationNotReady,
    ConfigError,
    Conflict,
    DispatchError,
    InvalidManifest,
    NotFound,
    QuotaExceeded,
)
from k8s_dispatch.workers import budget as api_budget
from k8s_dispatch.workers import watch_stream
from k8s_dispatch.workers.budget import Budget
from k8s_dispatch.workers.kube_metrics import METRICS, KubeMetrics

if TYPE_CHECKING:
    from k8s_dispatch.core.settings import Settings

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0  # one request, connect + read; lists of a page of Jobs fit well inside
DEFAULT_PAGE_SIZE = 500
PATCH_ATTEMPTS = 5  # re-reads of a Job whose finalizers moved under a test-guarded patch
LIST_RESTARTS = 3  # re-listings from scratch after a 410 Expired continue token
# urllib3 retries a refused or reset connection twice, quickly; it does NOT retry on HTTP status
# or sleep for Retry-After (its default would, up to three times, inside a worker's thread):
# a 429/5xx becomes ApiUnavailable at once and the task retries with backoff and jitter.
CONNECTION_RETRIES = urllib3.Retry(
    total=2, connect=2, read=0, redirect=0, status=0, respect_retry_after_header=False, backoff_factor=0.1
)

# `_request` runs the config's token refresh hook at most this often: the hook rebuilds the
# config each time (a tenth of a create's CPU), and kubeconfig's refreshes a token minutes
# before it expires, the in-cluster one a minute after the token file is rotated.
AUTH_REFRESH_S = 1.0
# A 429 with a Retry-After is sent again after waiting it out, this many times at most, each
# wait cut to RETRY_AFTER_MAX_S: then it is ApiUnavailable, and the task's backoff takes over.
RETRY_AFTER_ATTEMPTS = 3
RETRY_AFTER_MAX_S = 10.0
JOBS_PATH = "/apis/batch/v1/namespaces/{namespace}/jobs"
SECRETS_PATH = "/api/v1/namespaces/{namespace}/secrets"
JOB_PATH = JOBS_PATH + "/{name}"
POD_PATH = "/api/v1/namespaces/{namespace}/pods/{name}"

JsonDict = dict[str, Any]
# (verb, answer): what `on_request` is told of each request; the answer is the HTTP status code,
# or "error" when none came (refused, reset, timed out).
RequestObserver = Callable[[str, str], None]
_HTTP_VERBS = {"GET": "get", "POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}
NO_ANSWER = "error"  # the code of a request that got no answer


# A watch slice ends after this long without a byte from the server: it has sent what it had
# (the watch cache replays the events after a version at once), so the slice is caught up.
WATCH_QUIET_S = 0.08
# A slice of a kept stream ends after this long without an event: what it waits for is only
# what is on its way from the socket, not the server's replay of what it has.
KEPT_QUIET_S = 0.01
# How many requests one task thread may have in flight at once (a completion's releases of its
# batch's Jobs, `delivery.complete`): the connection pool is sized for it.
REQUESTS_PER_THREAD = 4
# A watch's reads wait at most its lifetime and this much more: the server ends it by then.
WATCH_READ_SLACK_S = 5.0


@dataclass(frozen=True)
class Hold:
    """How long a watch stream may be kept between slices (`KubeClient.watch_jobs`): at most
    `lifetime_s` in all (the watch's timeoutSeconds), and `idle_s` without a slice reading it.
    `on_event`, if any, is called by the stream's reader thread with each event as it arrives
    (`watch_stream.WatchStream`): what lets a poll run as soon as there is something to read."""

    lifetime_s: float
    idle_s: float
    on_event: Callable[[JsonDict], object] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class WatchSlice:
    """What one bounded slice of a watch read: its events in order (BOOKMARKs among them),
    and whether the server said the version was too old to resume from (LIST again)."""

    events: list[JsonDict]
    expired: bool


class _Expired(Exception):
    """A paginated list's continue token expired (410): private, `iter_jobs` restarts on it."""


class KubeClient:
    """Jobs and Pods over one connection pool; safe to share between threads."""

    def __init__(
        self,
        kubeconfig: Path | str | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        pool_size: int = 16,
        budget: Budget | None = None,
        metrics: KubeMetrics = METRICS,
        on_request: RequestObserver | None = None,
    ) -> None:
        """Load the cluster config: `kubeconfig` if given, else in-cluster, else ~/.kube/config.

        `pool_size` should cover every thread that shares the client (task threads, poll,
        sweep): a smaller urllib3 pool drops and re-opens connections under load. `budget`:
        the requests' rate limit, by default the process's one (`budget.shared()`), which
        every client of the process draws from. `on_request` is told of every request sent
        (the worker's metrics count them); it must not raise.

        Raises:
            ConfigError: the config cannot be read or names no usable cluster.
        """
        self._timeout = timeout_s
        self._budget = budget if budget is not None else api_budget.shared()
        self._metrics = metrics
        self._on_request = on_request
        configuration = _load_configuration(kubeconfig)
        configuration.retries = CONNECTION_RETRIES
        configuration.connection_pool_maxsize = pool_size
        self._configuration = configuration
        self._api_client = k8s.ApiClient(configuration)
        # What the client's REST layer builds per request from `_request_timeout`, built once.
        self._request_timeout = urllib3.Timeout(total=timeout_s)
        self._auth: tuple[str, str] | None = None
        self._auth_due = -math.inf
        self._batch = k8s.BatchV1Api(self._api_client)
        self._core = k8s.CoreV1Api(self._api_client)
        # Watch streams kept between slices, and the version each watch's last slice reached,
        # by (namespace, label selector): `watch_jobs`.
        self._watch_lock = threading.Lock()
        self._held: dict[tuple[str, str], watch_stream.WatchStream] = {}
        self._reached: dict[tuple[str, str], str] = {}
        self.host: str = configuration.host
        base = urllib3.util.parse_url(configuration.host)
        self._origin = (base.host or "", base.port, base.scheme or "https")  # for the pool of `_request`
        self._base_path = (base.path or "").rstrip("/")  # a host URL may carry a path prefix

    @classmethod
    def from_settings(cls, settings: Settings, *, on_request: RequestObserver | None = None) -> KubeClient:
        # Task threads (each with up to REQUESTS_PER_THREAD at once) plus the poll and sweep beside them.
        return cls(
            settings.kubeconfig,
            timeout_s=settings.kube_timeout_s,
            pool_size=settings.worker_concurrency * REQUESTS_PER_THREAD + 4,
            budget=api_budget.shared(settings.kube_qps, settings.kube_burst),
            on_request=on_request,
        )

    def close(self) -> None:
        with self._watch_lock:
            held, self._held = list(self._held.values()), {}
        for stream in held:
            stream.close()
        self._api_client.close()  # type: ignore[no-untyped-call]  # py.typed, but kubernetes leaves it unannotated

    def __enter__(self) -> KubeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- Jobs -------------------------------------------------------------------------------

    def create_job(self, namespace: str, body: JsonDict) -> JsonDict:
        """Create a Job. Raises AlreadyExists (409) when a Job of that name exists."""
        return self._request(
            f"create job in {namespace}", "POST", JOBS_PATH, body, schema=k8s.V1Job, namespace=namespace
        )

    def create_secret(self, namespace: str, body: JsonDict) -> JsonDict:
        """Create a Secret (a secret input's, `workers.manifest.input_secret`). Raises
        AlreadyExists (409) when a Secret of that name exists. Nothing of the body is logged."""
        return self._request(
            f"create secret in {namespace}", "POST", SECRETS_PATH, body, schema=k8s.V1Secret, namespace=namespace
        )

    def get_secret_owners(self, namespace: str, name: str) -> list[str]:
        """The uids of the owners of a Secret (its data is read and dropped here). Raises NotFound."""
        secret = self._call(f"get secret {namespace}/{name}", self._core.read_namespaced_secret, name, namespace)
        return [str(ref.get("uid", "")) for ref in (secret.get("metadata") or {}).get("ownerReferences") or []]

    def get_job(self, namespace: str, name: str) -> JsonDict:
        """Read one Job. Raises NotFound."""
        return self._call(f"get job {namespace}/{name}", self._batch.read_namespaced_job, name, namespace)

    def list_jobs_page(
        self,
        namespace: str,
        *,
        label_selector: str,
        limit: int = DEFAULT_PAGE_SIZE,
        continue_token: str | None = None,
    ) -> JsonDict:
        """One page of a Job LIST: the JobList dict (`items`, `metadata.continue`).

        Raises:
            ApiUnavailable: reason "Expired" when the continue token is too old (410): list
                again from the start.
        """
        try:
            return self._list_jobs_raw(
                namespace, label_selector=label_selector, limit=limit, continue_token=continue_token
            )
        except _Expired as e:
            raise ApiUnavailable(f"list jobs in {namespace}: continue token expired", reason="Expired") from e

    def iter_jobs(
        self,
        namespace: str,
        *,
        label_selector: str,
        page_size: int = DEFAULT_PAGE_SIZE,
        on_version: Callable[[str], None] | None = None,
    ) -> Iterator[list[JsonDict]]:
        """Yield the matching Jobs page by page (one LIST per page, memory bounded by a page).
        `on_version` is told the listing's resourceVersion (its first page's) before that page
        is yielded.

        A 410 Expired continue token restarts the listing from scratch, so after a restart a
        Job may be yielded twice: consumers must be idempotent (ours are).
        """
        restarts = 0
        token: str | None = None
        while True:
            try:
                page = self._list_jobs_raw(
                    namespace, label_selector=label_selector, limit=page_size, continue_token=token
                )
            except _Expired as e:
                restarts += 1
                if restarts > LIST_RESTARTS:
                    raise ApiUnavailable(
                        f"list jobs in {namespace}: continue token expired {restarts} times", reason="Expired"
                    ) from e
                log.info("list of jobs in %s expired mid-way; listing again from the start", namespace)
                token = None
                continue
            if token is None and on_version is not None:
                on_version(str((page.get("metadata") or {}).get("resourceVersion") or ""))
            yield page.get("items") or []
            token = (page.get("metadata") or {}).get("continue") or None
            if token is None:
                return

    def watch_jobs(
        self,
        namespace: str,
        *,
        label_selector: str,
        resource_version: str,
        bound_s: float,
        quiet_s: float = WATCH_QUIET_S,
        hold: Hold | None = None,
    ) -> WatchSlice:
        """One bounded slice of a Job watch from `resource_version` (with bookmarks): the events
        the server sent until caught up (`quiet_s` without one, a kept stream's KEPT_QUIET_S; or
        a BOOKMARK and what is already queued behind it), or `bound_s` in all, whichever comes first.

        Without `hold` the stream is closed after the slice. With it, the stream is kept for the
        next slice of the same watch, when that one starts where this one ended: it is read from
        the kept stream, without a new request. A stream is kept once two slices of this process
        follow each other (so that replicas taking turns do not each keep a stream nobody reads),
        for at most `hold.lifetime_s`, and dropped when no slice read it for `hold.idle_s`. A kept
        stream that has ended or broken is replaced in the same slice by a new watch from where
        it ended (if that fails, the slice fails as any watch's does).

        A slice never loses an event: what it did not read, the next one (from the last version
        read) reads. `expired` is set when the server says the version is too old (410 Gone or
        Expired, as the HTTP status or an ERROR event): LIST again.

        Raises:
            ApiUnavailable: the watch could not be opened or broke off (an ERROR event other
                than 410 included); the caller falls back to a LIST.
        """
        key = (namespace, label_selector)
        with self._watch_lock:
            stream = self._held.pop(key, None)
            follows = self._reached.get(key) == resource_version
        if stream is not None and not (stream.usable and stream.reached == resource_version):
            stream.close()
            stream = None
        kept = stream is not None
        deadline = time.monotonic() + bound_s
        events: list[JsonDict] = []
        version = resource_version
        while True:
            if stream is None:
                stream = self._open_watch(namespace, label_selector, version, bound_s=bound_s, hold=hold)
                if stream is None:
                    return WatchSlice(events=events, expired=True)
            try:
                # A kept stream's events are already here (its thread read them as they came):
                # the slice takes what has arrived, and does not wait out a replay's quiet.
                quiet = min(quiet_s, KEPT_QUIET_S) if kept else quiet_s
                got = stream.slice(bound_s=max(0.0, deadline - time.monotonic()), quiet_s=quiet)
            except ApiUnavailable:
                stream.close()
                if not kept:
                    raise
                got = watch_stream.Slice([], expired=False, ended=True)
            events += got.events
            self._metrics.watch_events.labels(resource="jobs").inc(len(got.events))
            if got.expired:
                stream.close()
                return WatchSlice(events=events, expired=True)
            if got.ended and kept and deadline > time.monotonic():
                # It ended (its lifetime) or broke since the last slice: what came after the
                # events it had is read in this slice from a new stream, not left for the next
                # poll (a poll interval late).
                log.info("%s: the kept stream had ended; opening a new one from %s", stream.what, stream.reached)
                version, stream, kept = stream.reached, None, False  # once: a new stream's end or error stands
                continue
            break
        done: watch_stream.WatchStream | None = stream
        with self._watch_lock:
            self._reached[key] = stream.reached
            if hold is not None and not got.ended and (kept or follows):
                done, self._held[key] = self._held.get(key), stream  # one kept per watch: the newer
        if done is not None:
            done.close()
        return WatchSlice(events=events, expired=False)

    def _open_watch(
        self, namespace: str, label_selector: str, version: str, *, bound_s: float, hold: Hold | None
    ) -> watch_stream.WatchStream | None:
        """A Job watch from `version`, read by its own thread; None when the server answers 410."""
        what = f"watch jobs in {namespace} from {version}"
        lifetime_s = hold.lifetime_s if hold is not None else bound_s
        for attempt in range(RETRY_AFTER_ATTEMPTS + 1):
            self._metrics.waited(self._budget.acquire())  # a watch is a request like any other
            started = time.perf_counter()
            try:
                response = self._batch.list_namespaced_job(
                    namespace,
                    label_selector=label_selector,
                    watch=True,
                    allow_watch_bookmarks=True,
                    resource_version=version,
                    timeout_seconds=max(1, math.ceil(lifetime_s)),
                    _preload_content=False,
                    # (connect, each read): a read waiting longer than the watch lasts means
                    # a connection that died without a word (the stream is then over)
                    _request_timeout=(self._timeout, lifetime_s + WATCH_READ_SLACK_S),
                )
                stream = cast(urllib3.BaseHTTPResponse, response)  # raw: _preload_content=False
            except ApiException as e:
                self._done("watch", str(e.status), started)
                e.with_traceback(None)
                if e.status == 410:
                    return None
                if attempt < RETRY_AFTER_ATTEMPTS and self._waited_out(e.status, e.headers, what):
                    continue
                raise _mapped(e, what) from e
            except (urllib3.exceptions.HTTPError, OSError) as e:
                self._done("watch", NO_ANSWER, started)
                raise ApiUnavailable(f"{what}: {type(e).__name__}: {e}") from e
            self._done("watch", str(stream.status), started)  # its latency: until the stream opened
            idle_s = hold.idle_s if hold is not None else lifetime_s
            on_event = hold.on_event if hold is not None else None
            return watch_stream.WatchStream(
                stream, what=what, version=version, idle_s=idle_s, decode=_decoded, on_event=on_event
            )
        raise AssertionError("unreachable: the last attempt returns, raises or breaks")

    def remove_finalizer(self, namespace: str, name: str, finalizer: str) -> bool:
        """Remove one finalizer from a Job; True if this call removed it (see `release_job`)."""
        return self.release_job(namespace, name, finalizer=finalizer)

    def release_job(
        self,
        namespace: str,
        name: str,
        *,
        finalizer: str,
        label: tuple[str, str] | None = None,
        snapshot: Mapping[str, Any] | None = None,
    ) -> bool:
        """Remove `finalizer` from a Job and set `label` on it, in one JSON patch; True if this
        call changed the Job.

        The patch `test`s the Job's uid and the finalizer at the index it removes, so a Job
        re-created under the same name is never touched, and a finalizer list changed by
        someone else in between is never cut at the wrong place. `snapshot` is the Job as last
        read (a LIST's item will do: only uid, finalizers and labels are used); with it the
        patch needs no GET first. A failed `test` (422 Invalid, or 409) reads the Job again and
        retries, unless its uid changed. Nothing to do, absent Job or another uid: False.
        """
        what = f"release job {namespace}/{name} (finalizer {finalizer}, label {label})"
        job = snapshot
        uid = ((snapshot or {}).get("metadata") or {}).get("uid")
        for _ in range(PATCH_ATTEMPTS):
            if job is None:
                try:
                    job = self.get_job(namespace, name)
                except NotFound:
                    return False
            metadata = job.get("metadata") or {}
            if uid is not None and metadata.get("uid") != uid:
                return False  # re-created under the same name: not the Job we were asked about
            patch = release_patch(metadata, finalizer=finalizer, label=label)
            if not patch:
                return False
            try:
                self._request(
                    what,
                    "PATCH",
                    JOB_PATH,
                    patch,
                    content_type="application/json-patch+json",
                    namespace=namespace,
                    name=name,
                )
                return True
            except NotFound:
                return False
            except (Conflict, ApiRejected) as e:
                # A failed `test` op is 422 Invalid (or 409 on some servers): the Job moved.
                if isinstance(e, ApiRejected) and e.reason != "Invalid":
                    raise
                log.info("%s: the job changed under the patch (%s); reading it again", what, e.reason)
                uid, job = metadata.get("uid"), None
        raise Conflict(f"{what}: the job kept changing over {PATCH_ATTEMPTS} attempts")

    def label_job(self, namespace: str, name: str, *, label: tuple[str, str], snapshot: Mapping[str, Any]) -> bool:
        """Set one label on the Job `snapshot` shows, in one JSON patch that `test`s its uid (a Job
        re-created under the same name is never touched); True if this call changed the Job.
        Already labelled so, gone, or another uid: False."""
        patch = release_patch(snapshot.get("metadata") or {}, finalizer="", label=label)
        if not patch:
            return False
        what = f"label job {namespace}/{name} ({label[0]}={label[1]})"
        try:
            self._request(
                what,
                "PATCH",
                JOB_PATH,
                patch,
                content_type="application/json-patch+json",
                namespace=namespace,
                name=name,
            )
        except (NotFound, Conflict):
            return False
        except ApiRejected as e:
            if e.reason != "Invalid":  # a failed uid `test` (422, or 409 on some servers): re-created since
                raise
            return False
        return True

    def delete_job(self, namespace: str, name: str, *, propagation: str = "Background", uid: str | None = None) -> bool:
        """Delete a Job (its Pods by `propagation`); False if it was already gone, or (with
        `uid`, a precondition) if the Job of that name is another one.

        With finalizers left on it the Job is only marked for deletion.
        """
        # With a body kube-apiserver reads the options from it alone (the query's propagationPolicy
        # is ignored, and a batch/v1 Job's default orphans its Pods): the policy goes in the body too.
        extra: dict[str, Any] = (
            {"body": k8s.V1DeleteOptions(preconditions=k8s.V1Preconditions(uid=uid), propagation_policy=propagation)}
            if uid
            else {}
        )
        try:
            self._call(
                f"delete job {namespace}/{name}",
                self._batch.delete_namespaced_job,
                name,
                namespace,
                propagation_policy=propagation,
                **extra,
            )
        except NotFound:
            return False
        except Conflict:
            if uid is None:
                raise
            return False  # re-created under the same name: not the Job we were asked about
        return True

    def delete_jobs(self, namespace: str, *, label_selector: str, propagation: str = "Background") -> list[JsonDict]:
        """Delete every Job the selector matches with ONE request (deletecollection), their Pods
        by `propagation`; the Jobs the API listed as deleted or marked for deletion (with their
        finalizers: one a finalizer holds is still there)."""
        deleted = self._call(
            f"delete jobs in {namespace} matching {label_selector}",
            self._batch.delete_collection_namespaced_job,
            namespace,
            label_selector=label_selector,
            propagation_policy=propagation,
        )
        return list(deleted.get("items") or [])

    # --- Pods -------------------------------------------------------------------------------

    def list_pods(self, namespace: str, *, label_selector: str) -> list[JsonDict]:
        """All Pods matching the selector (a Job's Pods: `batch.kubernetes.io/job-name=NAME`)."""
        return [pod for page in self.iter_pods(namespace, label_selector=label_selector) for pod in page]

    def iter_pods(
        self,
        namespace: str,
        *,
        label_selector: str,
        field_selector: str | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> Iterator[list[JsonDict]]:
        """Yield the Pods matching the selectors page by page (one LIST per page)."""
        extra: dict[str, Any] = {"field_selector": field_selector} if field_selector else {}
        return self._pages(
            f"list pods in {namespace}", self._core.list_namespaced_pod, namespace,
            page_size=page_size, label_selector=label_selector, **extra,
        )  # fmt: skip

    def release_pod(
        self, namespace: str, pod: Mapping[str, Any], *, finalizer: str, label: tuple[str, str] | None = None
    ) -> bool:
        """Remove `finalizer` from a Pod as a LIST read it, and put `label` on it, in one JSON patch
        that `test`s its uid and the finalizer's index (as `release_job`'s); True if this call
        changed the Pod.

        No GET and no retry (Pods are only ever listed): a Pod gone, or whose finalizers moved
        under the patch, is left as it is (False), for the sweep's next LIST of Pods.
        """
        metadata = pod.get("metadata") or {}
        name = str(metadata.get("name", ""))
        patch = release_patch(metadata, finalizer=finalizer, label=label)
        if not patch:
            return False
        what = f"release pod {namespace}/{name} (finalizer {finalizer})"
        try:
            self._request(
                what,
                "PATCH",
                POD_PATH,
                patch,
                content_type="application/json-patch+json",
                namespace=namespace,
                name=name,
            )
        except NotFound:
            return False
        except (Conflict, ApiRejected) as e:
            if isinstance(e, ApiRejected) and e.reason != "Invalid":
                raise
            log.info("%s: the pod changed under the patch (%s); left for the next sweep", what, e.reason)
            return False
        return True

    def read_pod_log(self, namespace: str, name: str, *, container: str, tail_lines: int, limit_bytes: int) -> bytes:
        """The end of a container's log as the kubelet serves it (pods/log with `tailLines` and
        `limitBytes`: the last lines, at most that many bytes of them). Raises NotFound."""
        return self._call_bytes(
            f"read the log of pod {namespace}/{name}",
            self._core.read_namespaced_pod_log,
            name,
            namespace,
            container=container,
            tail_lines=tail_lines,
            limit_bytes=limit_bytes,
        )

    # --- Events -----------------------------------------------------------------------------

    def iter_events(
        self, namespace: str, *, field_selector: str, page_size: int = DEFAULT_PAGE_SIZE
    ) -> Iterator[list[JsonDict]]:
        """Yield the namespace's core/v1 Events matching the field selector, page by page."""
        return self._pages(
            f"list events in {namespace}", self._core.list_namespaced_event, namespace,
            page_size=page_size, field_selector=field_selector,
        )  # fmt: skip

    def _pages(
        self, what: str, method: Callable[..., Any], namespace: str, *, page_size: int, **selectors: Any
    ) -> Iterator[list[JsonDict]]:
        """One paginated LIST: a request per page, each page's items yielded as it arrives."""
        token: str | None = None
        while True:
            page = self._call(what, method, namespace, limit=page_size, _continue=token, **selectors)
            yield page.get("items") or []
            token = (page.get("metadata") or {}).get("continue") or None
            if token is None:
                return

    # --- the seams every call goes through (`_call`, `_request`) ----------------------------

    def _list_jobs_raw(
        self, namespace: str, *, label_selector: str, limit: int, continue_token: str | None
    ) -> JsonDict:
        what = f"list jobs in {namespace}"
        try:
            return self._call(
                what,
                self._batch.list_namespaced_job,
                namespace,
                label_selector=label_selector,
                limit=limit,
                _continue=continue_token,
                _raw_errors=True,
            )
        except ApiException as e:
            if e.status == 410 and continue_token is not None:
                raise _Expired(what) from e
            raise _mapped(e, what) from e

    def _call(
        self, what: str, method: Callable[..., Any], *args: Any, _raw_errors: bool = False, **kwargs: Any
    ) -> JsonDict:
        """Call one API method raw and decode its JSON body, mapping every failure."""
        return _decoded(self._call_bytes(what, method, *args, _raw_errors=_raw_errors, **kwargs), what)

    def _call_bytes(
        self, what: str, method: Callable[..., Any], *args: Any, _raw_errors: bool = False, **kwargs: Any
    ) -> bytes:
        """Call one API method raw: its body's bytes, every failure mapped."""
        verb = _verb_of(method)
        for attempt in range(RETRY_AFTER_ATTEMPTS + 1):
            self._metrics.waited(self._budget.acquire())
            started = time.perf_counter()
            try:
                response = method(*args, _preload_content=False, _request_timeout=self._timeout, **kwargs)
            except ApiException as e:
                self._done(verb, str(e.status), started)
                # The client's frames in its traceback hold the raw HTTP response, and with it the
                # connection's socket, for as long as the error lives (a chained error can live
                # long): keep status, reason and body, drop those frames.
                e.with_traceback(None)
                if attempt < RETRY_AFTER_ATTEMPTS and self._waited_out(e.status, e.headers, what):
                    continue
                if _raw_errors:
                    raise
                raise _mapped(e, what) from e
            except (urllib3.exceptions.HTTPError, OSError) as e:  # refused, reset, timed out
                self._done(verb, NO_ANSWER, started)
                raise ApiUnavailable(f"{what}: {type(e).__name__}: {e}") from e
            except pydantic.ValidationError as e:
                # The client checks bodies against its models before sending (unknown fields,
                # a number where a quantity string belongs): nothing reached the server.
                raise InvalidManifest(f"{what}: refused by the client's schema check: {e}") from e
            try:
                raw: bytes = response.data
            except (urllib3.exceptions.HTTPError, OSError) as e:
                self._done(verb, NO_ANSWER, started)
                raise ApiUnavailable(f"{what}: reading the response: {type(e).__name__}: {e}") from e
            finally:
                response.release_conn()
            self._done(verb, str(response.status), started)
            return raw
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _request(
        self,
        what: str,
        method: str,
        path: str,
        body: Any,
        *,
        content_type: str = "application/json",
        schema: type[pydantic.BaseModel] | None = None,
        **path_params: str,
    ) -> JsonDict:
        """One request with a JSON body, straight through the ApiClient's urllib3 pool (its TLS,
        client certificate, proxy, retries and size), with its auth header: what the generated
        method sends, without its per-call argument validation, model round trip and
        re-serialisation, which cost more CPU than the request itself on the create path.

        `body` is sent as it is, so it must be in the API's own JSON shape (camelCase keys).
        `schema`, the client's model of the body, keeps the generated method's check before
        sending (a model validation, cheap: the body is not rebuilt from the model). Errors map
        as `_call`'s do, an error answer through the same `ApiException`.
        """
        configuration = self._configuration
        path = path.format_map(
            {k: quote(v, safe=configuration.safe_chars_for_path_param) for k, v in path_params.items()}
        )
        headers = {**self._api_client.default_headers, "Accept": "application/json", "Content-Type": content_type}
        auth = self._auth_header()
        if auth is not None:
            headers[auth[0]] = auth[1]
        try:
            if schema is not None:
                schema.model_validate(body)
            data = orjson.dumps(body)
        except pydantic.ValidationError as e:  # as `_call`'s: nothing reached the server
            raise InvalidManifest(f"{what}: refused by the client's schema check: {e}") from e
        except TypeError as e:  # orjson.JSONEncodeError: not JSON (sets, bytes, non-string keys...)
            raise InvalidManifest(f"{what}: the body is not JSON: {e}") from e
        verb = _HTTP_VERBS.get(method, method.lower())
        for attempt in range(RETRY_AFTER_ATTEMPTS + 1):
            self._metrics.waited(self._budget.acquire())
            started = time.perf_counter()
            try:
                pool_manager = self._api_client.rest_client.pool_manager
                if isinstance(pool_manager, urllib3.ProxyManager):  # a plain-HTTP proxy rewrites each request
                    response = pool_manager.request(
                        method, configuration.host + path, body=data, headers=headers, timeout=self._request_timeout
                    )
                else:  # the host's pool itself: what PoolManager.request ends in, without its per-call URL work
                    response = pool_manager.connection_from_host(*self._origin).urlopen(
                        method, self._base_path + path, body=data, headers=headers, timeout=self._request_timeout,
                        assert_same_host=False, redirect=False,
                    )  # fmt: skip
            except (urllib3.exceptions.HTTPError, OSError) as e:  # refused, reset, timed out, TLS
                self._done(verb, NO_ANSWER, started)
                raise ApiUnavailable(f"{what}: {type(e).__name__}: {e}") from e
            self._done(verb, str(response.status), started)
            if 200 <= response.status <= 299:
                return _decoded(response.data, what)
            if attempt < RETRY_AFTER_ATTEMPTS and self._waited_out(response.status, response.headers, what):
                continue
            error = ApiException(
                status=response.status, reason=response.reason, body=response.data.decode("utf-8", "replace")
            )
            raise _mapped(error, what) from error
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _waited_out(self, status: int | None, headers: Mapping[str, str] | None, what: str) -> bool:
        """For a 429 with a Retry-After: pause the process's budget that long (at most
        RETRY_AFTER_MAX_S) and True, to send again; else False, and the error stands."""
        delay = retry_after_s(status, headers)
        if delay is None:
            return False
        log.info("%s: 429, Retry-After %.3g s: waiting, then sending again", what, delay)
        self._metrics.retry_after.inc()
        self._budget.pause(delay)
        return True

    def _done(self, verb: str, code: str, started: float) -> None:
        """A request answered (`code`, or NO_ANSWER): its latency observed, `on_request` told."""
        self._metrics.request_done(verb, code, time.perf_counter() - started)
        if self._on_request is not None:
            self._on_request(verb, code)

    def _auth_header(self) -> tuple[str, str] | None:
        """The client's auth header, read again (its `refresh_api_key_hook` run, if the config
        has one) at most every AUTH_REFRESH_S; a config without a hook is read once."""
        now = time.monotonic()
        if now >= self._auth_due:
            auth = self._configuration.auth_settings().get("BearerToken")  # runs the hook
            # An empty token: no header (the generated client would send the value None).
            self._auth = (auth["key"], auth["value"]) if auth and auth["value"] is not None else None
            self._auth_due = now + AUTH_REFRESH_S if self._configuration.refresh_api_key_hook else math.inf
        return self._auth


def retry_after_s(status: int | None, headers: Mapping[str, str] | None) -> float | None:
    """The seconds a 429 asks to wait (its Retry-After in seconds, cut to RETRY_AFTER_MAX_S);
    None for another status, or a Retry-After that is missing or not a number of seconds
    (an HTTP date would need our clock to agree with the server's: the task's backoff instead)."""
    if status != 429 or not headers:
        return None
    value = headers.get("Retry-After")
    try:
        seconds = float(value) if value is not None else math.nan
    except ValueError:
        return None
    if not math.isfinite(seconds) or seconds < 0:
        return None
    return min(seconds, RETRY_AFTER_MAX_S)


def _verb_of(method: Callable[..., Any]) -> str:
    """The API verb of a generated client method: `list_namespaced_job` -> "list",
    `read_...` -> "get", `delete_collection_...` -> "deletecollection"."""
    action = getattr(method, "__name__", "call").split("_namespaced")[0]
    return {"read": "get", "delete_collection": "deletecollection"}.get(action, action)


def _load_configuration(kubeconfig: Path | str | None) -> k8s.Configuration:
    configuration = k8s.Configuration()
    try:
        if kubeconfig is not None:
            k8s_config.load_kube_config(  # type: ignore[no-untyped-call]  # py.typed, but kubernetes leaves it unannotated
                config_file=str(kubeconfig), client_configuration=configuration, persist_config=False
            )
            return configuration
        try:
            k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]  # py.typed, but kubernetes leaves it unannotated
        except k8s_config.ConfigException:
            k8s_config.load_kube_config(client_configuration=configuration, persist_config=False)  # type: ignore[no-untyped-call]  # py.typed, but kubernetes leaves it unannotated
    except (k8s_config.ConfigException, yaml.YAMLError, OSError, ValueError, TypeError, KeyError) as e:
        # The loader raises its own ConfigException, but also raw file and YAML errors.
        source = str(kubeconfig) if kubeconfig is not None else "in-cluster config or ~/.kube/config"
        raise ConfigError(f"cannot load the Kubernetes config from {source}: {type(e).__name__}: {e}") from e
    return configuration


def _decoded(raw: bytes, what: str) -> JsonDict:
    """An answer's JSON object; anything else means the API is not answering as one. orjson:
    decoding LIST pages was a third of a busy worker's CPU with the standard library's."""
    try:
        decoded = orjson.loads(raw)
    except ValueError as e:
        raise ApiUnavailable(f"{what}: the API answered with something that is not JSON") from e
    if not isinstance(decoded, dict):
        raise ApiUnavailable(f"{what}: the API answered with JSON that is not an object")
    return decoded


def _mapped(e: ApiException, what: str) -> DispatchError:
    """The engine error for one API error response, keeping the API's message and reason."""
    status = e.status or 0
    api_reason, api_message = _status_of(e)
    message = f"{what}: {status} {api_reason or e.reason}: {api_message or e.reason}"
    if status == 404:
        return NotFound(message)
    if status == 409:
        return AlreadyExists(message) if api_reason == "AlreadyExists" else Conflict(message)
    if status == 429 or status >= 500 or status == 0:
        return ApiUnavailable(message)
    if status == 410:  # Expired outside a paginated list: a stale read, list again
        return ApiUnavailable(message, reason="Expired")
    if status == 403 and any(words in (api_message or "") for words in _QUOTA_WAITS):
        return QuotaExceeded(message)
    if status == 403 and _RBAC_NOT_READ.search(api_message or ""):
        return AuthorizationNotReady(message)
    # 400 BadRequest, 401 Unauthorized, 403 Forbidden, 422 Invalid and the rest of 4xx.
    return ApiRejected(message, reason=api_reason or _REASON_BY_STATUS.get(status, "ApiRejected"))


_REASON_BY_STATUS = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 422: "Invalid"}
# A 403 from the quota admission that passes: "exceeded quota: NAME, requested: ..., used: ...,
# limited: ...", and "status unknown for quota" (the quota controller has not counted yet).
# Its other 403s ("failed quota: NAME: must specify limits.cpu") need a changed spec: permanent.
_QUOTA_WAITS = ("exceeded quota", "status unknown for quota")
# The RBAC authorizer's own note of an object it could not find ("... RBAC: clusterrole.rbac.
# authorization.k8s.io "system:basic-user" not found"): its cache is not filled yet, or a
# binding names a Role still to come. A plain "cannot create resource" 403 stays permanent.
_RBAC_NOT_READ = re.compile(r"RBAC: (cluster)?role(binding)?\.rbac\.authorization\.k8s\.io \"[^\"]*\" not found")


def _status_of(e: ApiException) -> tuple[str | None, str | None]:
    """(reason, message) from the API's Status body, when the body is one."""
    try:
        body = json.loads(e.body) if e.body else None
    except ValueError:
        return None, None
    if not isinstance(body, dict):
        return None, None
    reason, message = body.get("reason"), body.get("message")
    return (reason if isinstance(reason, str) and reason else None, message if isinstance(message, str) else None)


def release_patch(metadata: Mapping[str, Any], *, finalizer: str, label: tuple[str, str] | None) -> list[JsonDict]:
    """The JSON patch that takes `finalizer` off a Job (or a Pod) and puts `label` on it, guarded
    by `test`s of the uid and of the finalizer's index (pure); [] when there is nothing to change.
    An empty `finalizer` only sets the label."""
    ops: list[JsonDict] = []
    finalizers = metadata.get("finalizers") or []
    if finalizer and finalizer in finalizers:
        index = finalizers.index(finalizer)
        ops += [
            {"op": "test", "path": f"/metadata/finalizers/{index}", "value": finalizer},
            {"op": "remove", "path": f"/metadata/finalizers/{index}"},
        ]
    labels = metadata.get("labels")
    if label is not None and (labels or {}).get(label[0]) != label[1]:
        if labels:
            ops.append({"op": "add", "path": f"/metadata/labels/{_pointer(label[0])}", "value": label[1]})
        else:
            ops.append({"op": "add", "path": "/metadata/labels", "value": {label[0]: label[1]}})
    if not ops:
        return []
    uid = metadata.get("uid")
    return ([{"op": "test", "path": "/metadata/uid", "value": uid}] if uid else []) + ops


def _pointer(key: str) -> str:
    """A map key as one JSON pointer token (RFC 6901): `~` is `~0`, `/` is `~1`."""
    return key.replace("~", "~0").replace("/", "~1")
