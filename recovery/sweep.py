"""The recovery sweep: walks the cluster and the database page by page, and has the plan carried out.

(A) pages of our undelivered Jobs (this deployment's label: another deployment's Jobs in the
same namespace are never listed), each matched with its dispatches: categories 2, 3, 4, 6, and
5 for the created dispatches whose ids the page covers (the LIST is in name order); then our
finished Pods, for 4 (those an ended dispatch left with our finalizer; the open maps' Pods, which
only their hand-offs read, are left out of that LIST); then one bulk delete of
the delivered Jobs per namespace, whose answer lists what it matched: 8 for any labelled delivered
by hand with our finalizer on (`plan_held`); before that, Jobs made before the deployment label existed
are given ours when their dispatch is in our database, and only reported otherwise.
(B) pages of the other pending dispatches, checked with one `dispatch-id in (...)` LIST per
chunk: 1 and 5; (C) terminal dispatches the engine was not told about. (D) from the database, every sweep: the
dispatches ended FAILED or CANCELLED whose Job is not yet known stopped (their Jobs deleted,
their slots freed once gone), and those whose Job was found hand-edited (looked at by name
until they end: `JobTampered` past the grace). Actions run inline
through `delivery` (create, complete, cleanup); a page's finished Jobs are delivered together (one Pod LIST),
except those poll has handed to a queued completion.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import datetime
from typing import Any, TypeVar

import redis
import sqlalchemy as sa

from k8s_dispatch.core.errors import DispatchError
from k8s_dispatch.core.settings import OrphanPolicy, PollMode
from k8s_dispatch.delivery import cleanup, jobwatch
from k8s_dispatch.delivery.metrics import METRICS
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.recovery import start_checks
from k8s_dispatch.recovery.executor import Executor, job_or_none, stop_job, view_of, views_for_jobs
from k8s_dispatch.recovery.plan import (
    JOB_TAMPERED_REASON,
    CreateJob,
    DispatchView,
    NameOrder,
    Policy,
    ReportOrphan,
    StopStep,
    TamperedJob,
    holding_finalizer,
    name_dispatch_id,
    plan_dispatches,
    plan_held,
    plan_jobs,
    plan_pods,
    present_jobs,
    stop_step,
)
from k8s_dispatch.recovery.report import SweepReport
from k8s_dispatch.store import dispatches
from k8s_dispatch.store.db import database_now, transaction
from k8s_dispatch.store.models import STOPPING_STATES, TERMINAL_STATES, Dispatch, DispatchMap, DispatchState, utcnow
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.capability import StartPolicy

log = logging.getLogger(__name__)

# Dispatch ids per `dispatch-id in (...)` selector: 100 UUIDs make a query string of ~4 KB,
# well inside what API servers and proxies accept.
SELECTOR_CHUNK = 100
# Our Pods that have stopped: the only ones an ended dispatch can leave with our finalizer for
# long (a running one is stopped by its Job's deletion, then listed here).
FINISHED_PODS = "status.phase!=Pending,status.phase!=Running"
# Open maps a Pod LIST leaves out (`dispatch-id notin (...)`), the largest first: a selector of
# ~4 KB, as SELECTOR_CHUNK's. A map past them is only read as before.
EXCLUDED_MAPS = SELECTOR_CHUNK
SWEEPS_RUN = "sweeps_run"

# What a completion did that counts as the sweep acting: a terminal event, or a lost result run again.

T = TypeVar("T")


def run_sweep(rt: Runtime, *, dry_run: bool = False, now: datetime | None = None, watched: bool = False) -> SweepReport:
    """One full sweep of every namespace and every pending dispatch; never raises for one failure.

    Memory is bounded by a page (`poll_page_size` Jobs or rows), not by their number. Each
    action re-reads the state it depends on before its side effect, so a sweep racing normal
    work or another sweep changes nothing twice; the broker is never needed (it may have lost
    every message). `dry_run` plans and counts but changes nothing. `now` is the sweep's
    clock for grace periods (default: the database's, the clock the rows' times were written
    with, so a worker whose clock is off never shortens or stretches a grace period).
    Failures of single actions or listings are logged and counted in the report's errors;
    the next sweep tries again.

    `watched` (beat's sweep): in a namespace whose Jobs poll's watch follows (`delivery.jobwatch`)
    the Jobs are LISTed at most every `sweep_list_interval_s`, not every sweep; in between, the
    database side runs (scheduled dispatches, and the dispatches whose Job the watch saw leave
    undelivered). Every other sweep (at start-up, the CLI's) lists every namespace's Jobs.
    """
    report = SweepReport(dry_run=dry_run, started_at=utcnow())  # this process's clock: the duration
    now = now or _database_now(rt, report)
    policy = Policy.from_settings(rt.settings)
    report.namespaces = _namespaces(rt, report)
    with Executor(rt, report, dry_run=dry_run, concurrency=rt.settings.sweep_concurrency) as act:
        followed = [ns for ns in report.namespaces if watched and not dry_run and not _list_due(rt, ns)]
        listed = [ns for ns in report.namespaces if ns not in followed]
        matched = [ns for ns in listed if _sweep_jobs(rt, ns, act, now=now, policy=policy)]
        for namespace in followed:
            _sweep_gone(rt, namespace, act, now=now, policy=policy)
        _sweep_dispatches(rt, act, now=now, policy=policy, matched=[*matched, *followed], followed=followed)
        _sweep_tampered(rt, act)
        _sweep_stopping(rt, act, now=now, policy=policy)
        _sweep_unnotified(rt, act, now=now, policy=policy)
    report.finished_at = utcnow()
    METRICS.sweep_done(report)
    if not dry_run:
        rt.stats.incr(SWEEPS_RUN)
    log.info("%s in %.2fs", report.summary(), report.duration_s or 0.0)
    return report


def _database_now(rt: Runtime, report: SweepReport) -> datetime:
    """The database's clock; this process's if the database cannot say (the sweep's reads will
    fail the same way, and every action re-reads what it depends on anyway)."""
    try:
        with transaction(rt.sessions) as session:
            return database_now(session)
    except DispatchError as e:
        log.warning("sweep: reading the database's clock failed: %s: %s", e.reason, e)
        report.add_problem(f"reading the database's clock: {e.reason}: {e}")
        return utcnow()


def _namespaces(rt: Runtime, report: SweepReport) -> list[str]:
    """Where our Jobs may be: the config's namespaces, and any an open dispatch recorded, created
    or not yet (its namespace is fixed when it is scheduled, and its capability may have moved
    or gone since: its Job must still be found). One DISTINCT over the open dispatches, which
    `ix_dispatches_state` finds."""
    configured = set(rt.namespaces())
    try:
        with transaction(rt.sessions) as session:
            recorded = session.scalars(
                sa.select(Dispatch.job_namespace)
                .where(Dispatch.state.in_([DispatchState.SCHEDULED, DispatchState.CREATED]))
                .where(Dispatch.job_namespace.is_not(None))
                .distinct()
            ).all()
    except DispatchError as e:
        log.warning("sweep: reading recorded namespaces failed: %s: %s", e.reason, e)
        report.add_problem(f"reading recorded namespaces: {e.reason}: {e}")
        recorded = []
    return sorted(configured | {ns for ns in recorded if ns})


def _list_due(rt: Runtime, namespace: str) -> bool:
    """Whether this sweep LISTs the namespace's Jobs: always in LIST mode or while poll's watch
    of it is not healthy; otherwise once per `sweep_list_interval_s` since the last LIST that
    came whole (`_listed`: a Redis key's TTL, so the replicas' sweeps share it and no clocks are
    compared), and at once after a poll had to LIST (a gap in the watch removes the key).
    Redis unreachable: list."""
    settings = rt.settings
    if settings.poll_mode is not PollMode.WATCH:
        return True
    name = jobwatch.key(settings.key_prefix, settings.effective_deployment, namespace)
    try:
        if not jobwatch.is_healthy(rt.redis, settings.key_prefix, settings.effective_deployment, namespace):
            return True
        return not rt.redis.exists(jobwatch.listed_key(name))
    except redis.RedisError as e:
        log.warning("sweep: cannot tell whether the watch of %s is healthy (%s); listing its jobs", namespace, e)
        return True


def _listed(rt: Runtime, namespace: str) -> None:
    """Note a LIST of the namespace's Jobs that came whole: the next is due `sweep_list_interval_s`
    on (`_list_due`). Only then: a LIST that failed is due again at the next sweep."""
    settings = rt.settings
    if settings.poll_mode is not PollMode.WATCH:
        return
    name = jobwatch.key(settings.key_prefix, settings.effective_deployment, namespace)
    # A little under the interval, so that the sweep that falls due on it is not one late.
    ttl_ms = max(1, int(1000 * (settings.sweep_list_interval_s - settings.sweep_interval_s / 2)))
    try:
        rt.redis.set(jobwatch.listed_key(name), 1, px=ttl_ms)
    except redis.RedisError as e:  # the next sweep lists again
        log.warning("sweep: cannot note the LIST of jobs in %s (%s)", namespace, e)


def _sweep_gone(rt: Runtime, namespace: str, act: Executor, *, now: datetime, policy: Policy) -> None:
    """Where the watch is followed: the start checks of the Jobs poll's position holds as not
    started (their snapshots, as (A) would list them), category 8 for the finished ones it holds
    undelivered (a hand-edited Job is refused by every completion), and category 5 for the created
    dispatches whose Job the watch saw leave without being delivered (`jobwatch.gone`), each
    checked as (B) checks one (its Job looked up by label), forgotten once checked past the
    grace period, or ended and its Job not held (`_sweep_held`, one LIST when any has ended)."""
    settings = rt.settings
    name = jobwatch.key(settings.key_prefix, settings.effective_deployment, namespace)
    try:
        position = jobwatch.load(rt.redis, name)
        waiting = list(position.unstarted.values())
        for start in range(0, len(waiting), settings.poll_page_size):
            page = waiting[start : start + settings.poll_page_size]
            known = views_for_jobs(rt, page)
            actions = plan_jobs(page, known, now=now, policy=policy)
            act.starts(namespace, start_checks.due(page, actions, known, now=now, policy_for=_start_policy(rt)))
        # Finished Jobs poll keeps handing off: one hand-edited under an open dispatch's name is
        # refused by every completion, so category 8 takes it from here, not from the next LIST.
        finished = list(position.finished.values())
        for start in range(0, len(finished), settings.poll_page_size):
            page = finished[start : start + settings.poll_page_size]
            actions = plan_jobs(page, views_for_jobs(rt, page), now=now, policy=policy)
            act.all([a for a in actions if isinstance(a, TamperedJob)])
        ids = jobwatch.gone(rt.redis, name)
        if not ids:
            return
        query = sa.select(Dispatch).where(Dispatch.dispatch_id.in_(sorted(ids)))
        checked: set[str] = set(ids)
        ended: set[str] = set()
        for views in _pages(rt, query, lambda row: view_of(rt, row)):
            open_views = [v for v in views if v.state is DispatchState.CREATED and v.namespace == namespace]
            checked -= {v.dispatch_id for v in open_views if now - v.updated_at < policy.grace}
            act.report.dispatches_checked += len(open_views)
            act.all(plan_dispatches(open_views, _present_jobs(rt, open_views), now=now, policy=policy))
            ended |= {v.dispatch_id for v in views if v.terminal and v.namespace == namespace}
        if ended:
            # An ended dispatch's Job left labelled delivered: by its release, as a rule, or by a
            # hand, its finalizer still on (`_sweep_held`). Kept to check again until it is let go.
            held = _sweep_held(rt, namespace, act, now=now, policy=policy)
            checked -= ended if held is None else held & ended
        jobwatch.forget_gone(rt.redis, name, checked)
    except (DispatchError, redis.RedisError) as e:
        log.warning("sweep: checking the jobs the watch of %s saw leave failed: %s", namespace, e)
        act.report.add_problem(f"jobs gone from {namespace}: {e}")


# --- (A) the Jobs: categories 2, 3, 4, 6 ------------------------------------------------------


def _sweep_jobs(rt: Runtime, namespace: str, act: Executor, *, now: datetime, policy: Policy) -> bool:
    """Plan and act on the namespace's undelivered Jobs page by page, then remove every
    delivered one with one bulk delete (those released here and any a completion left).

    The next page is fetched while the current one is matched with the database. Returns True
    when the listing came whole and in name order: then its pages were also matched with the
    namespace's CREATED dispatches (category 5, see `_LostJobs`), and (B) skips those.
    """
    report = act.report
    _adopt_unlabelled(rt, namespace, act, now=now, policy=policy)
    lost = _LostJobs(rt, namespace, act, now=now, policy=policy)
    selector = job_labels.undelivered_selector(rt.settings.effective_deployment)
    position = _Position(rt, namespace)  # read before the LIST: see `_Position.check`
    try:
        for page in _prefetched(
            rt.kube.iter_jobs(
                namespace, label_selector=selector, page_size=rt.settings.poll_page_size, on_version=position.listed
            )
        ):
            report.jobs_listed += len(page)
            views = views_for_jobs(rt, page)
            actions = plan_jobs(page, views, now=now, policy=policy)
            act.all(actions)
            act.starts(namespace, start_checks.due(page, actions, views, now=now, policy_for=_start_policy(rt)))
            lost.page(page)
        lost.end()
        if not act.dry_run:
            position.check()
        if not act.dry_run and not lost.unnoted:
            _listed(rt, namespace)
    except DispatchError as e:  # the LIST, or the page's dispatches: the next sweep starts over
        log.warning("sweep: going through the jobs in %s stopped: %s: %s", namespace, e.reason, e)
        report.add_problem(f"jobs in {namespace}: {e.reason}: {e}")
    _sweep_pods(rt, namespace, act)
    if act.dry_run:
        _sweep_held(rt, namespace, act, now=now, policy=policy)
    else:
        try:
            deleted = cleanup.delete_delivered(rt, namespace)
        except DispatchError as e:
            log.warning("sweep: the bulk delete of delivered jobs in %s failed: %s: %s", namespace, e.reason, e)
            report.add_problem(f"deleting delivered jobs in {namespace}: {e.reason}: {e}")
        else:
            _sweep_held(rt, namespace, act, now=now, policy=policy, deleted=deleted)
    return lost.matched


def _sweep_held(
    rt: Runtime,
    namespace: str,
    act: Executor,
    *,
    now: datetime,
    policy: Policy,
    deleted: list[dict[str, Any]] | None = None,
) -> set[str] | None:
    """Category 8 for the Jobs labelled delivered by hand that still hold our finalizer
    (`plan_held`), found in the answer of the bulk delete (`deleted`: it lists what it matched,
    finalizers and all), or else by one LIST of the namespace's delivered Jobs. The ids of the
    dispatches whose Job was found held (None: the LIST or the database failed, the next sweep
    tries again)."""
    selector = job_labels.delivered_selector(rt.settings.effective_deployment)
    found: set[str] = set()
    try:
        pages = rt.kube.iter_jobs(namespace, label_selector=selector, page_size=rt.settings.poll_page_size)
        for page in pages if deleted is None else [deleted]:
            if deleted is None:
                act.report.jobs_listed += len(page)
            if held := holding_finalizer(page):  # as a rule none: no database read
                found |= {i for i in map(name_dispatch_id, held) if i is not None}
                act.all(plan_held(held, views_for_jobs(rt, held), now=now, policy=policy))
    except DispatchError as e:
        log.warning("sweep: going through the delivered jobs in %s stopped: %s: %s", namespace, e.reason, e)
        act.report.add_problem(f"delivered jobs in {namespace}: {e.reason}: {e}")
        return None
    return found


class _Position:
    """Poll's watch position of a namespace against a LIST of its Jobs (watch poll only). Read
    before the LIST, a position legitimately stands at or behind the LIST's version; one ahead of
    it comes from before the cluster's store was restored or replaced (`jobwatch.ahead`), and is
    dropped so that the next poll LISTs: until then its watch would see nothing."""

    def __init__(self, rt: Runtime, namespace: str) -> None:
        self.rt, self.namespace = rt, namespace
        settings = rt.settings
        self.name = jobwatch.key(settings.key_prefix, settings.effective_deployment, namespace)
        self.stored: str | None = None
        self.version = ""
        if settings.poll_mode is PollMode.WATCH:
            try:
                self.stored = jobwatch.stored_version(rt.redis, self.name)
            except redis.RedisError as e:  # then nothing is checked this sweep
                log.warning("sweep: cannot read the watch position of %s (%s)", namespace, e)

    def listed(self, version: str) -> None:
        self.version = version

    def check(self) -> None:
        if not jobwatch.ahead(self.stored, self.version):
            return
        assert self.stored is not None
        try:
            dropped = jobwatch.drop(self.rt.redis, self.name, self.stored)
        except redis.RedisError as e:
            log.warning("sweep: cannot drop the watch position of %s (%s)", self.namespace, e)
            return
        if dropped:
            log.warning(
                "sweep: poll's watch of jobs in %s stood at version %s, ahead of the cluster's %s (its store "
                "restored or replaced): dropped, the next poll lists them", self.namespace, self.stored, self.version,
            )  # fmt: skip


def _start_policy(rt: Runtime) -> Callable[[str], StartPolicy]:
    """A capability's start clocks; the defaults for one gone from the config."""
    return lambda capability: rt.resolver.spec(capability).start_policy if capability in rt.resolver else StartPolicy()


def _adopt_unlabelled(rt: Runtime, namespace: str, act: Executor, *, now: datetime, policy: Policy) -> None:
    """Jobs made before the deployment label existed, by this deployment or by another sharing
    the namespace: one whose dispatch is in our database, with labels that agree, is ours and
    gets our label (one patch), so the listing that follows handles it like any other; any
    other is reported and never deleted, whatever `ORPHAN_POLICY` says: it may be another
    deployment's own."""
    report = act.report
    report_only = replace(policy, orphan_policy=OrphanPolicy.REPORT)
    try:
        for page in rt.kube.iter_jobs(
            namespace, label_selector=job_labels.unlabelled_selector(), page_size=rt.settings.poll_page_size
        ):
            report.jobs_listed += len(page)
            actions = plan_jobs(page, views_for_jobs(rt, page), now=now, policy=report_only)
            act.all([a for a in actions if isinstance(a, ReportOrphan)])
            # A refused Job under an open dispatch's name is not labelled either: `TamperedJob`
            # finds it by name (category 5's look-up).
            ours = [job for job, a in zip(page, actions, strict=True) if not isinstance(a, (ReportOrphan, TamperedJob))]
            act.label_all(namespace, ours)
    except DispatchError as e:  # the LIST, or the page's dispatches: the next sweep tries again
        log.warning("sweep: going through unlabelled jobs in %s stopped: %s: %s", namespace, e.reason, e)
        report.add_problem(f"unlabelled jobs in {namespace}: {e.reason}: {e}")


def _sweep_pods(rt: Runtime, namespace: str, act: Executor) -> None:
    """Category 4 for Pods: free every finished Pod of ours that an ended dispatch left with our
    finalizer, page by page (one LIST per page, each page's dispatches read with one query).

    The Pods of the namespace's open maps are left out of the LIST (`_open_maps`): `plan_pods`
    frees only an ended dispatch's Pods, and a running map's finished Pods, one or more per item
    it has run, are its hand-offs' to read and free (`delivery.items`). A map that ends after
    the query is left out of this sweep only: its end frees its Pods, and the next sweep lists
    them if that end stopped half way."""
    try:
        selector = job_labels.selector(rt.settings.effective_deployment)
        if open_maps := _open_maps(rt, namespace):
            selector += f",{job_labels.DISPATCH_ID_KEY} notin ({','.join(open_maps)})"
        pages = rt.kube.iter_pods(
            namespace, label_selector=selector, field_selector=FINISHED_PODS, page_size=rt.settings.poll_page_size
        )
        for page in pages:
            act.all(plan_pods(page, views_for_jobs(rt, page), releasing=act.releasing))
    except DispatchError as e:
        log.warning("sweep: going through the pods in %s stopped: %s: %s", namespace, e.reason, e)
        act.report.add_problem(f"pods in {namespace}: {e.reason}: {e}")


def _open_maps(rt: Runtime, namespace: str) -> list[str]:
    """The ids of the maps not ended whose Jobs are in `namespace` (or not placed yet), the
    largest first, at most EXCLUDED_MAPS (one query)."""
    query = (
        sa.select(Dispatch.dispatch_id)
        .join(DispatchMap, DispatchMap.dispatch_id == Dispatch.dispatch_id)
        .where(
            Dispatch.state.not_in(TERMINAL_STATES),
            sa.or_(Dispatch.job_namespace == namespace, Dispatch.job_namespace.is_(None)),
        )
        .order_by(DispatchMap.items.desc(), Dispatch.dispatch_id)
        .limit(EXCLUDED_MAPS)
    )
    with transaction(rt.sessions) as session:
        return [str(dispatch_id) for dispatch_id in session.scalars(query)]


_END = object()


def _prefetched(pages: Iterator[T]) -> Iterator[T]:
    """`pages`, the next one fetched on a thread while the caller works on the current one, so
    that the LIST's round trips overlap the database's; at most two pages are held."""
    with ThreadPoolExecutor(1, thread_name_prefix="sweep-list") as pool:
        ahead = pool.submit(next, pages, _END)
        while True:
            page = ahead.result()  # the LIST's errors are raised here, in the caller
            if page is _END:
                return
            ahead = pool.submit(next, pages, _END)
            yield page  # type: ignore[misc]


class _LostJobs:
    """Category 5 for one namespace, matched while its Jobs stream by (see `NameOrder`): after
    each page, the CREATED dispatches whose ids that page covers, and whose Job it does not
    hold, with one query: past the grace period acted on, inside it noted for the watched
    sweeps (`jobwatch.note_gone`). No LIST per dispatch; memory stays a page.

    A listing out of name order (restarted, or a server that does not sort) stops the
    matching: `matched` stays False and (B) looks those dispatches' Jobs up by label instead.
    """

    def __init__(self, rt: Runtime, namespace: str, act: Executor, *, now: datetime, policy: Policy) -> None:
        self.rt, self.namespace, self.act, self.now, self.policy = rt, namespace, act, now, policy
        self._order: NameOrder | None = NameOrder()
        self.matched = False
        self.unnoted = False  # a dispatch to check again could not be noted: the LIST is due again

    def page(self, jobs: Sequence[dict[str, Any]]) -> None:
        if self._order is None:
            return
        names = [(job.get("metadata") or {}).get("name", "") for job in jobs]
        order = self._order.advance(names)
        if order is None:
            log.info("sweep: jobs in %s did not list in name order; looking dispatches up by label", self.namespace)
        elif order.last_id != self._order.last_id:
            self._act(after=self._order.last_id, upto=order.last_id, names=names)
        self._order = order

    def end(self) -> None:
        if self._order is not None:
            self._act(after=self._order.last_id, upto=None, names=[])
            self.matched = True

    def _act(self, *, after: str | None, upto: str | None, names: Sequence[str]) -> None:
        query = sa.select(Dispatch).where(
            Dispatch.state == DispatchState.CREATED,
            Dispatch.job_namespace == self.namespace,
        )
        if upto is not None:
            query = query.where(Dispatch.dispatch_id <= upto)
        if names:
            query = query.where(Dispatch.job_name.not_in(names))
        present = {(self.namespace, name) for name in names}
        for views in _pages(self.rt, query, lambda row: view_of(self.rt, row), after=after):
            self.act.report.dispatches_checked += len(views)
            self.act.all(plan_dispatches(views, present, now=self.now, policy=self.policy))
            # Missing inside the grace: not acted on now, and this LIST stands for the namespace
            # until the next one (`_listed`), so they are noted for the watched sweeps to check
            # once the grace is over, as if poll had seen their Jobs leave.
            young = [v.dispatch_id for v in views if self.now - v.updated_at < self.policy.grace]
            if young and not self.act.dry_run and self.rt.settings.poll_mode is PollMode.WATCH:
                settings = self.rt.settings
                name = jobwatch.key(settings.key_prefix, settings.effective_deployment, self.namespace)
                try:
                    jobwatch.note_gone(self.rt.redis, name, young)
                except redis.RedisError as e:  # then this LIST stands for nothing: the next one is due
                    log.warning("sweep: cannot note %d dispatches of %s to check again (%s)", len(young), name, e)
                    self.unnoted = True


# --- (B) the dispatches without a Job: categories 1 and 5 -----------------------------------


def _sweep_dispatches(
    rt: Runtime,
    act: Executor,
    *,
    now: datetime,
    policy: Policy,
    matched: Sequence[str] = (),
    followed: Sequence[str] = (),
) -> None:
    """Scheduled dispatches, and created ones outside the `matched` namespaces (whose Job
    listings (A) matched them with already), each page's Jobs looked up by label. In the
    `followed` namespaces (no LIST of their Jobs this sweep) a scheduled dispatch whose Job
    exists is adopted here, as (A) would (its create answers 409 and adopts the Job)."""
    report = act.report
    query = sa.select(Dispatch).where(
        sa.or_(
            Dispatch.state == DispatchState.SCHEDULED,
            sa.and_(
                Dispatch.state == DispatchState.CREATED,
                sa.or_(Dispatch.job_namespace.is_(None), Dispatch.job_namespace.not_in(matched)),
            ),
        ),
        Dispatch.updated_at <= now - policy.grace,
    )
    try:
        for views in _pages(rt, query, lambda row: view_of(rt, row)):
            report.dispatches_checked += len(views)
            waits = [(now - v.updated_at).total_seconds() for v in views if v.state == DispatchState.SCHEDULED]
            report.oldest_scheduled_s = max([report.oldest_scheduled_s, *waits])
            try:
                present = _present_jobs(rt, views)
            except DispatchError as e:
                log.warning("sweep: looking up jobs for %d dispatches failed: %s: %s", len(views), e.reason, e)
                report.add_problem(f"looking up jobs for {len(views)} dispatches: {e.reason}: {e}")
                continue
            act.all(plan_dispatches(views, present, now=now, policy=policy))
            act.all(
                [
                    CreateJob(dispatch_id=v.dispatch_id, namespace=v.namespace, job_name=v.job_name)
                    for v in views
                    if v.state is DispatchState.SCHEDULED
                    and v.namespace in followed
                    and (v.namespace, v.job_name) in present
                ]
            )
    except DispatchError as e:  # the database: the next sweep starts over
        log.warning("sweep: reading dispatches stopped: %s: %s", e.reason, e)
        report.add_problem(f"reading dispatches: {e.reason}: {e}")


def _present_jobs(rt: Runtime, views: Sequence[DispatchView]) -> set[tuple[str, str]]:
    """(namespace, name) of the undelivered Jobs that exist for these dispatches: one LIST per
    namespace and chunk. A Job labelled delivered by hand is out of poll's and the sweep's
    selectors: its dispatch is then looked up by name (category 5's `TamperedJob`)."""
    by_namespace: dict[str, list[str]] = {}
    for view in views:
        by_namespace.setdefault(view.namespace, []).append(view.dispatch_id)
    present: set[tuple[str, str]] = set()
    for namespace, ids in sorted(by_namespace.items()):
        for start in range(0, len(ids), SELECTOR_CHUNK):
            chunk = ids[start : start + SELECTOR_CHUNK]
            ours = job_labels.undelivered_selector(rt.settings.effective_deployment)
            selector = f"{ours},{job_labels.DISPATCH_ID_KEY} in ({','.join(chunk)})"
            for page in rt.kube.iter_jobs(namespace, label_selector=selector, page_size=rt.settings.poll_page_size):
                present |= present_jobs(page)
    return present


def _pages(
    rt: Runtime, query: sa.Select[Dispatch], convert: Callable[[Dispatch], T], *, after: str | None = None
) -> Iterator[list[T]]:
    """Keyset pages of `query` by dispatch_id (those after `after`), each read in its own
    short transaction.

    No transaction stays open while the caller acts on a page: on SQLite every transaction
    takes the write lock, and the actions write.
    """
    size = rt.settings.poll_page_size
    while True:
        with transaction(rt.sessions) as session:
            rows = dispatches.dispatch_page(session, query, after=after, batch=size)
            converted = [convert(row) for row in rows]
        if converted:
            yield converted
        if len(rows) < size:
            return
        after = rows[-1].dispatch_id


# --- (D) from the database: ended dispatches' Jobs, hand-edited Jobs -------------------------


def _sweep_stopping(rt: Runtime, act: Executor, *, now: datetime, policy: Policy) -> None:
    """Category 7: the dispatches ended FAILED or CANCELLED whose Job is not yet known stopped
    (`ix_dispatches_stopping`), each page's Jobs looked up with one LIST per namespace and chunk:
    a Job still running (a lost `cancel`, a delete that met a 5xx) is deleted; one seen finished
    or gone is recorded stopped, which frees its dispatch's slot. Every sweep, LIST or not."""
    query = sa.select(Dispatch).where(Dispatch.job_stopped_at.is_(None), Dispatch.state.in_(sorted(STOPPING_STATES)))
    try:
        for views in _pages(rt, query, lambda row: view_of(rt, row)):
            act.stop_all(views, _ended_jobs(rt, views), now=now, grace=policy.grace)
    except DispatchError as e:  # the database or a LIST: the next sweep starts over
        log.warning("sweep: stopping the jobs of ended dispatches stopped: %s: %s", e.reason, e)
        act.report.add_problem(f"jobs of ended dispatches: {e.reason}: {e}")


def _ended_jobs(rt: Runtime, views: Sequence[DispatchView]) -> dict[tuple[str, str], Mapping[str, Any]]:
    """(namespace, name) -> the Job, delivered or not, of each of these dispatches that has one:
    one LIST per namespace and chunk by the dispatch-id label, and a GET by name for a dispatch
    failed `JobTampered` (its labels may say anything)."""
    by_namespace: dict[str, list[str]] = {}
    for view in views:
        by_namespace.setdefault(view.namespace, []).append(view.dispatch_id)
    jobs: dict[tuple[str, str], Mapping[str, Any]] = {}
    ours = job_labels.selector(rt.settings.effective_deployment)
    for namespace, ids in sorted(by_namespace.items()):
        for start in range(0, len(ids), SELECTOR_CHUNK):
            selector = f"{ours},{job_labels.DISPATCH_ID_KEY} in ({','.join(ids[start : start + SELECTOR_CHUNK])})"
            for page in rt.kube.iter_jobs(namespace, label_selector=selector, page_size=rt.settings.poll_page_size):
                for job in page:
                    metadata = job.get("metadata") or {}
                    jobs[(metadata.get("namespace", namespace), metadata.get("name", ""))] = job
    for view in views:
        where = (view.namespace, view.job_name)
        if view.reason == JOB_TAMPERED_REASON and where not in jobs:
            found = job_or_none(rt, *where)
            if found is not None:
                jobs[where] = found
    return jobs


def mark_stopped(rt: Runtime, dispatch_ids: Sequence[str], *, stop: bool = False) -> set[str]:
    """Of these dispatches, those ended FAILED or CANCELLED whose Job is seen finished or gone,
    recorded stopped (their slots free); the ids marked. With `stop`, a Job still running is
    stopped first (`stop_job`), else it is left to the sweep (category 7). What a worker runs
    right after recording ends, so that a failure read from a finished Job, or a cancel, frees
    its slot at once, not a sweep later.

    Raises:
        DispatchError: the database or the API failed (the sweep marks them later).
    """
    wanted = sorted(set(dispatch_ids))
    views: list[DispatchView] = []
    with transaction(rt.sessions) as session:
        for start in range(0, len(wanted), SELECTOR_CHUNK):  # `ix_dispatches_stopping`: a completion's are none
            query = sa.select(Dispatch).where(
                Dispatch.dispatch_id.in_(wanted[start : start + SELECTOR_CHUNK]),
                Dispatch.job_stopped_at.is_(None),
                Dispatch.state.in_(sorted(STOPPING_STATES)),
            )
            views += [view_of(rt, row) for row in session.scalars(query)]
        now = database_now(session) if views else None
    if not views or now is None:
        return set()
    jobs = _ended_jobs(rt, views)
    grace = Policy.from_settings(rt.settings).grace
    ids: list[str] = []
    for v in views:
        job = jobs.get((v.namespace, v.job_name))
        step = stop_step(v, job, now=now, grace=grace)
        if step is StopStep.MARK or (stop and step is StopStep.STOP and job is not None and stop_job(rt, v, job)):
            ids.append(v.dispatch_id)
    if not ids:
        return set()
    with transaction(rt.sessions) as session:
        return dispatches.mark_jobs_stopped(session, ids)


def _sweep_tampered(rt: Runtime, act: Executor) -> None:
    """Category 8 from the database: the dispatches whose Job was found hand-edited before
    (`ix_dispatches_tampered`), each looked at again by name until it ends or its Job agrees."""
    query = sa.select(Dispatch).where(Dispatch.job_tampered_at.is_not(None))
    try:
        for views in _pages(rt, query, lambda row: view_of(rt, row)):
            act.all(
                [
                    TamperedJob(v.dispatch_id, v.namespace, v.job_name)
                    for v in views
                    if v.dispatch_id not in act.tampered
                ]
            )
    except DispatchError as e:
        log.warning("sweep: reading the dispatches of hand-edited jobs stopped: %s: %s", e.reason, e)
        act.report.add_problem(f"dispatches of hand-edited jobs: {e.reason}: {e}")


# --- (C) terminal dispatches the engine was not told about -----------------------------------


def _sweep_unnotified(rt: Runtime, act: Executor, *, now: datetime, policy: Policy) -> None:
    report = act.report
    if rt.notifier is None:
        return  # this process cannot reach the engine; one that can will notify
    query = sa.select(Dispatch).where(
        Dispatch.notified_at.is_(None),
        Dispatch.state.in_(sorted(TERMINAL_STATES)),
        Dispatch.finished_at <= now - policy.grace,
    )
    try:
        for ids in _pages(rt, query, lambda row: row.dispatch_id):
            act.renotify_all(ids)
    except DispatchError as e:
        log.warning("sweep: reading unnotified dispatches stopped: %s: %s", e.reason, e)
        report.add_problem(f"reading unnotified dispatches: {e.reason}: {e}")
