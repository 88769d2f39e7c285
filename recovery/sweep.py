"""The recovery sweep's executor: walks the cluster and the database page by page, acts on the plan.

(A) pages of our undelivered Jobs (this deployment's label: another deployment's Jobs in the
same namespace are never listed), each matched with its dispatches: categories 2, 3, 4, 6, and
5 for the created dispatches whose ids the page covers (the LIST is in name order); then our
finished Pods, for 4 (those an ended dispatch left with our finalizer); then one bulk delete of
the delivered Jobs per namespace; before that, Jobs made before the deployment label existed
are given ours when their dispatch is in our database, and only reported otherwise.
(B) pages of the other pending dispatches, checked with one `dispatch-id in (...)` LIST per
chunk: 1 and 5; (C) terminal dispatches the engine was not told about. (D) from the database, every sweep: the
dispatches ended FAILED or CANCELLED whose Job is not yet known stopped (their Jobs deleted,
their slots freed once gone), and those whose Job was found hand-edited (looked at by name
until they end: `JobTampered` past the grace). Actions run inline
through `delivery.delivery`; a page's finished Jobs are delivered together (one Pod LIST),
except those poll has handed to a queued completion.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import datetime, timedelta
from enum import Enum
from functools import partial
from typing import Any, TypeVar

import redis
import sqlalchemy as sa

from k8s_dispatch.core.errors import DispatchError, NotFound
from k8s_dispatch.core.settings import OrphanPolicy, PollMode
from k8s_dispatch.delivery import delivery, handoff, jobwatch, statelog
from k8s_dispatch.delivery.crashpoints import Point, crashpoint
from k8s_dispatch.delivery.metrics import METRICS
from k8s_dispatch.delivery.reconstruct import DispatchRecord
from k8s_dispatch.delivery.runtime import Runtime
from k8s_dispatch.recovery import start_checks
from k8s_dispatch.recovery.plan import (
    JOB_TAMPERED_REASON,
    Action,
    Category,
    CleanUpJob,
    CompleteJob,
    CreateJob,
    DispatchView,
    FailJobLost,
    FreePod,
    NameOrder,
    Policy,
    RecreateJob,
    ReportOrphan,
    ReportRunning,
    StopStep,
    TamperedJob,
    TamperStep,
    hidden,
    name_dispatch_id,
    named_dispatch_ids,
    plan_dispatches,
    plan_jobs,
    plan_pods,
    present_jobs,
    refusal,
    stop_step,
    tamper_step,
)
from k8s_dispatch.recovery.report import Counts, SweepReport
from k8s_dispatch.store import dispatches
from k8s_dispatch.store.db import database_now, transaction
from k8s_dispatch.store.models import STOPPING_STATES, TERMINAL_STATES, Dispatch, DispatchState, EventType, utcnow
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.capability import StartPolicy
from k8s_dispatch.workers.pod_health import assess

log = logging.getLogger(__name__)

# Dispatch ids per `dispatch-id in (...)` selector: 100 UUIDs make a query string of ~4 KB,
# well inside what API servers and proxies accept.
SELECTOR_CHUNK = 100
# Our Pods that have stopped: the only ones an ended dispatch can leave with our finalizer for
# long (a running one is stopped by its Job's deletion, then listed here).
FINISHED_PODS = "status.phase!=Pending,status.phase!=Running"
ORPHANS_REPORTED = "orphans_reported"  # a Redis stats counter, cluster-wide (see delivery.stats)
SWEEPS_RUN = "sweeps_run"

# What a completion did that counts as the sweep acting: a terminal event, or a lost result run again.
_COMPLETE_ACTED = (delivery.CompleteOutcome.COMPLETED, delivery.CompleteOutcome.RERUN)
_CREATE_ACTED = (delivery.CreateOutcome.CREATED, delivery.CreateOutcome.ADOPTED, delivery.CreateOutcome.FAILED)

T = TypeVar("T")
Deferrable = TypeVar("Deferrable", CompleteJob, CleanUpJob)  # a Job a queued completion may be handling


class _Outcome(Enum):
    ACTED = "acted"
    SKIPPED = "skipped"  # a fresh read showed it was no longer needed
    NOTHING = "nothing"  # a finding that asks for no side effect (a running Job)
    FAILED = "failed"  # could not be done now (counted as an error); the next sweep retries


def _decided(outcome: _Outcome) -> _Outcome:
    """An outcome known already, for `Executor._count` (which otherwise carries an action out)."""
    return outcome


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
    compared). Redis unreachable: list."""
    settings = rt.settings
    if settings.poll_mode is not PollMode.WATCH:
        return True
    name = jobwatch.key(settings.key_prefix, settings.effective_deployment, namespace)
    try:
        if not jobwatch.is_healthy(rt.redis, settings.key_prefix, settings.effective_deployment, namespace):
            return True
        return not rt.redis.exists(f"{name}:sweep-listed")
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
        rt.redis.set(f"{name}:sweep-listed", 1, px=ttl_ms)
    except redis.RedisError as e:  # the next sweep lists again
        log.warning("sweep: cannot note the LIST of jobs in %s (%s)", namespace, e)


def _sweep_gone(rt: Runtime, namespace: str, act: Executor, *, now: datetime, policy: Policy) -> None:
    """Where the watch is followed: the start checks of the Jobs poll's position holds as not
    started (their snapshots, as (A) would list them), category 8 for the finished ones it holds
    undelivered (a hand-edited Job is refused by every completion), and category 5 for the created
    dispatches whose Job the watch saw leave without being delivered (`jobwatch.gone`), each
    checked as (B) checks one (its Job looked up by label), forgotten once checked past the
    grace period, or ended."""
    settings = rt.settings
    name = jobwatch.key(settings.key_prefix, settings.effective_deployment, namespace)
    try:
        position = jobwatch.load(rt.redis, name)
        unstarted = list(position.unstarted.values())
        for start in range(0, len(unstarted), settings.poll_page_size):
            page = unstarted[start : start + settings.poll_page_size]
            known = _views_for_jobs(rt, page)
            actions = plan_jobs(page, known, now=now, policy=policy)
            act.starts(namespace, start_checks.due(page, actions, known, now=now, policy_for=_start_policy(rt)))
        # Finished Jobs poll keeps handing off: one hand-edited under an open dispatch's name is
        # refused by every completion, so category 8 takes it from here, not from the next LIST.
        finished = list(position.finished.values())
        for start in range(0, len(finished), settings.poll_page_size):
            page = finished[start : start + settings.poll_page_size]
            actions = plan_jobs(page, _views_for_jobs(rt, page), now=now, policy=policy)
            act.all([a for a in actions if isinstance(a, TamperedJob)])
        ids = jobwatch.gone(rt.redis, name)
        if not ids:
            return
        query = sa.select(Dispatch).where(Dispatch.dispatch_id.in_(sorted(ids)))
        checked: set[str] = set(ids)
        for views in _pages(rt, query, lambda row: _view(rt, row)):
            open_views = [v for v in views if v.state is DispatchState.CREATED and v.namespace == namespace]
            checked -= {v.dispatch_id for v in open_views if now - v.updated_at < policy.grace}
            act.report.dispatches_checked += len(open_views)
            act.all(plan_dispatches(open_views, _present_jobs(rt, open_views), now=now, policy=policy))
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
    try:
        for page in _prefetched(
            rt.kube.iter_jobs(namespace, label_selector=selector, page_size=rt.settings.poll_page_size)
        ):
            report.jobs_listed += len(page)
            views = _views_for_jobs(rt, page)
            actions = plan_jobs(page, views, now=now, policy=policy)
            act.all(actions)
            act.starts(namespace, start_checks.due(page, actions, views, now=now, policy_for=_start_policy(rt)))
            lost.page(page)
        lost.end()
        if not act.dry_run:
            _listed(rt, namespace)
    except DispatchError as e:  # the LIST, or the page's dispatches: the next sweep starts over
        log.warning("sweep: going through the jobs in %s stopped: %s: %s", namespace, e.reason, e)
        report.add_problem(f"jobs in {namespace}: {e.reason}: {e}")
    _sweep_pods(rt, namespace, act)
    if not act.dry_run:
        try:
            delivery.delete_delivered(rt, namespace)
        except DispatchError as e:
            log.warning("sweep: the bulk delete of delivered jobs in %s failed: %s: %s", namespace, e.reason, e)
            report.add_problem(f"deleting delivered jobs in {namespace}: {e.reason}: {e}")
    return lost.matched


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
            actions = plan_jobs(page, _views_for_jobs(rt, page), now=now, policy=report_only)
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
    finalizer, page by page (one LIST per page, each page's dispatches read with one query)."""
    try:
        pages = rt.kube.iter_pods(
            namespace,
            label_selector=job_labels.selector(rt.settings.effective_deployment),
            field_selector=FINISHED_PODS,
            page_size=rt.settings.poll_page_size,
        )
        for page in pages:
            act.all(plan_pods(page, _views_for_jobs(rt, page), releasing=act.releasing))
    except DispatchError as e:
        log.warning("sweep: going through the pods in %s stopped: %s: %s", namespace, e.reason, e)
        act.report.add_problem(f"pods in {namespace}: {e.reason}: {e}")


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
    each page, the CREATED dispatches past the grace period whose ids that page covers, and
    whose Job it does not hold, with one query. No LIST per dispatch; memory stays a page.

    A listing out of name order (restarted, or a server that does not sort) stops the
    matching: `matched` stays False and (B) looks those dispatches' Jobs up by label instead.
    """

    def __init__(self, rt: Runtime, namespace: str, act: Executor, *, now: datetime, policy: Policy) -> None:
        self.rt, self.namespace, self.act, self.now, self.policy = rt, namespace, act, now, policy
        self._order: NameOrder | None = NameOrder()
        self.matched = False

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
            Dispatch.updated_at <= self.now - self.policy.grace,
        )
        if upto is not None:
            query = query.where(Dispatch.dispatch_id <= upto)
        if names:
            query = query.where(Dispatch.job_name.not_in(names))
        present = {(self.namespace, name) for name in names}
        for views in _pages(self.rt, query, lambda row: _view(self.rt, row), after=after):
            self.act.report.dispatches_checked += len(views)
            self.act.all(plan_dispatches(views, present, now=self.now, policy=self.policy))


def _views_for_jobs(rt: Runtime, jobs: Sequence[dict[str, Any]]) -> dict[str, DispatchView]:
    """The dispatches the Jobs' (or Pods') labels name, read with one query per page of them
    (the labels are checked by the plan, which reports a Job whose labels do not hold up), and
    the dispatches the Jobs' names stand for (a Job hand-edited is still its dispatch's)."""
    ids = {dispatch_id for job in jobs for dispatch_id in named_dispatch_ids(job)}
    ids |= {dispatch_id for job in jobs if (dispatch_id := name_dispatch_id(job)) is not None}
    with transaction(rt.sessions) as session:
        rows = dispatches.dispatch_rows(session, ids)
        return {dispatch_id: _view(rt, row) for dispatch_id, row in rows.items()}


def _view(rt: Runtime, row: Dispatch | sa.Row[Any]) -> DispatchView:
    record = DispatchRecord.from_row(row)
    namespace, _ = delivery.job_location(rt, record)
    return DispatchView(
        record=record,
        namespace=namespace,
        created_at=row.created_at,
        updated_at=row.updated_at,
        job_created_at=row.job_created_at,
        finished_at=row.finished_at,
        job_tampered_at=row.job_tampered_at,
        reason=row.reason,
    )


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
        for views in _pages(rt, query, lambda row: _view(rt, row)):
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
        for views in _pages(rt, query, lambda row: _view(rt, row)):
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
            found = _job_or_none(rt, *where)
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
            views += [_view(rt, row) for row in session.scalars(query)]
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
        for views in _pages(rt, query, lambda row: _view(rt, row)):
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


# --- carrying actions out ------------------------------------------------------------------


class Executor:
    """Carries out planned actions through `delivery.delivery`, counting each in the report.

    An action may be stale by the time it runs (planned from a page read a moment ago):
    each one re-reads what it depends on and is counted `skipped` when there is nothing
    left to do. Errors are counted, logged and never raised.
    """

    def __init__(self, rt: Runtime, report: SweepReport, *, dry_run: bool, concurrency: int = 1) -> None:
        self.rt = rt
        self.report = report
        self.dry_run = dry_run
        # The actions of one page run on these threads; the next page waits for them, so
        # memory stays bounded by a page.
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="sweep") if concurrency > 1 else None
        self._lock = threading.Lock()  # the report's counts
        self._handoff_unreadable = False  # Redis failed a marker check (logged once per sweep)
        # (namespace, name) of the recorded Jobs category 4 met (`CleanUpJob`): their own
        # clean-up (or a queued completion) frees their Pods, the pass over Pods leaves them.
        self.releasing: set[tuple[str, str]] = set()
        # Dispatches whose hand-edited Job this sweep has looked at (found by the LIST, by name,
        # or noted before): each is decided once per sweep.
        self.tampered: set[str] = set()

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def all(self, actions: Sequence[Action]) -> None:
        """Carry out a page of actions (at once, on the pool) and return when all are done.

        Running Jobs, most of a sweep's, ask for nothing: they are only counted, here. Finished
        Jobs (`CompleteJob` with the LIST's snapshot) that poll handed to a queued completion
        are left to it (`_deferred`); the others of each namespace are delivered in one call,
        which lists their Pods once, where the other actions stand. So are recorded Jobs still
        there (`CleanUpJob`) that a completion is releasing now: with about 80 Jobs finishing a
        second, a sweep reading 5,000 met a hundred, and each cost a patch that found no Job.
        """
        running = 0
        together: dict[tuple[type, str], list[Any]] = {}  # (CompleteJob or CleanUpJob, namespace)
        calls: list[Callable[[], None]] = []
        for action in actions:
            if isinstance(action, ReportRunning) and not action.adopt:
                running += 1
            elif isinstance(action, (CompleteJob, CleanUpJob)) and action.job is not None:
                if isinstance(action, CleanUpJob):
                    self.releasing.add((action.namespace, action.job_name))
                key = (type(action), action.namespace)
                if key not in together:
                    together[key] = []
                    carry_out = self._complete_all if isinstance(action, CompleteJob) else self._clean_up_all
                    calls.append(partial(carry_out, action.namespace, together[key]))  # the list fills below
                together[key].append(action)
            else:
                calls.append(partial(self.one, action))
        with self._lock:
            self.report.categories[Category.RUNNING].found += running
        self._run(calls)

    def stop_all(
        self,
        views: Sequence[DispatchView],
        jobs: Mapping[tuple[str, str], Mapping[str, Any]],
        *,
        now: datetime,
        grace: timedelta,
    ) -> None:
        """Category 7 for a page of ended dispatches: each Job still there and running (or held
        by our finalizer) released and deleted, on the pool; then every dispatch whose Job is
        seen finished or gone (deleted just now included) recorded stopped in one transaction,
        and admission told (`Runtime.on_ended`): their slots are free."""
        counts = self.report.categories[Category.STOPPING]
        steps = [(v, jobs.get((v.namespace, v.job_name))) for v in views]
        decided = [(v, job, stop_step(v, job, now=now, grace=grace)) for v, job in steps]
        acting = [(v, job, step) for v, job, step in decided if step is not StopStep.WAIT]
        with self._lock:
            counts.found += len(acting)
        if self.dry_run or not acting:
            return
        gone = [v.dispatch_id for v, _, step in acting if step is StopStep.MARK]
        stopping = [(v, job) for v, job, step in acting if step is StopStep.STOP and job is not None]

        def stop(view: DispatchView, job: Mapping[str, Any]) -> _Outcome:
            if self._stop(view, job):
                with self._lock:
                    gone.append(view.dispatch_id)
                return _Outcome.NOTHING  # counted as acted once marked, below
            return _Outcome.SKIPPED

        self._run([partial(self._count, counts, view, partial(stop, view, job)) for view, job in stopping])
        if not gone:
            return
        with transaction(self.rt.sessions) as session:
            marked = dispatches.mark_jobs_stopped(session, gone)
        with self._lock:
            counts.acted += len(marked)
            counts.skipped += len(gone) - len(marked)
        if marked and self.rt.on_ended is not None:
            self.rt.on_ended(sorted(marked))  # their slots are free: admission may run

    def _stop(self, view: DispatchView, job: Mapping[str, Any]) -> bool:
        """Release and delete an ended dispatch's Job (exact by its uid), its Pods freed first;
        True once a GET finds it gone. Released with the delivered label, so that a DELETE that
        fails leaves it to the bulk delete."""
        log.warning(
            "dispatch %s ended %s (%s) while its job %s/%s may still run; deleting it",
            view.dispatch_id, view.state, view.reason, view.namespace, view.job_name,
        )  # fmt: skip
        return stop_job(self.rt, view, job)

    def _tampered(self, action: TamperedJob) -> _Outcome:
        """Category 8, decided by `tamper_step` under the dispatch's guard claim with its row read
        again: the Job refused for a time past the tampered grace fails its dispatch `JobTampered`
        and is removed; one only hidden is delivered once it has finished (the completion path
        takes the claim itself, so after this one is let go); the refused Job of an ended
        dispatch is removed. The first finding is recorded on the row (`job_tampered_at`): the
        grace's origin, on the database's clock, and what has later sweeps look at it by name."""
        rt = self.rt
        with self._lock:
            if action.dispatch_id in self.tampered:
                return _Outcome.SKIPPED  # looked at already in this sweep
            self.tampered.add(action.dispatch_id)
        job = action.job if action.job is not None else _job_or_none(rt, action.namespace, action.job_name)
        claim = rt.guard.claim(action.dispatch_id)
        if claim is None:
            return _Outcome.SKIPPED  # another replica is delivering it
        try:
            with transaction(rt.sessions) as session:
                row = dispatches.dispatch_rows(session, [action.dispatch_id]).get(action.dispatch_id)
                now = database_now(session)
            if row is None:
                return _Outcome.SKIPPED
            view = _view(rt, row)
            refused = refusal(job, view) if job is not None else None
            is_hidden = job is not None and hidden(job, rt.settings.effective_deployment)
            grace = Policy.from_settings(rt.settings).tampered_grace
            delete = rt.settings.orphan_policy is OrphanPolicy.DELETE
            step = tamper_step(
                view, job, refused=refused is not None, hidden=is_hidden, now=now, grace=grace, delete=delete
            )
            if step is TamperStep.FORGET:
                if view.job_tampered_at is not None:
                    with transaction(rt.sessions) as session:
                        dispatches.clear_job_tampered(session, view.dispatch_id)
                return _Outcome.SKIPPED
            assert job is not None  # every other step has a Job
            if step in (TamperStep.CLEAN, TamperStep.DELETE):
                if step is TamperStep.DELETE:
                    log.warning(
                        "dispatch %s: its job %s/%s was edited by hand (%s); deleting it (orphan policy), "
                        "the dispatch gets a job of its own", view.dispatch_id, action.namespace, action.job_name,
                        refused,
                    )  # fmt: skip
                self._remove(action.namespace, action.job_name, job)
                return _Outcome.ACTED
            noted = view.job_tampered_at is None
            if noted:
                with transaction(rt.sessions) as session:
                    view = replace(
                        view, job_tampered_at=dispatches.note_job_tampered(session, view.dispatch_id, now=now)
                    )
                why = f"{refused.reason}: {refused}" if refused is not None else "out of our selectors"
                log.warning(
                    "dispatch %s: its job %s/%s was edited by hand (%s); %s",
                    view.dispatch_id, action.namespace, action.job_name, why,
                    f"failing it JobTampered unless put right within {grace.total_seconds():.0f}s"
                    if refused is not None else "delivering it once it finishes",
                )  # fmt: skip
                step = tamper_step(
                    view, job, refused=refused is not None, hidden=is_hidden, now=now, grace=grace, delete=delete
                )
            if step is TamperStep.FAIL:
                assert refused is not None
                message = (
                    f"job {action.namespace}/{action.job_name} was edited by hand and disagreed with the "
                    f"dispatch for {(now - (view.job_tampered_at or now)).total_seconds():.0f}s: {refused}"
                )
                detail = {"namespace": action.namespace, "job": action.job_name, "refusal": refused.reason}
                won = delivery.fail_dispatch(
                    rt, view.dispatch_id, reason=JOB_TAMPERED_REASON, message=message, detail=detail
                )
                self._remove(action.namespace, action.job_name, job)
                return _Outcome.ACTED if won else _Outcome.SKIPPED
            if step is not TamperStep.DELIVER:
                return _Outcome.ACTED if noted else _Outcome.NOTHING  # WAIT, RUNS
        finally:
            rt.guard.release(claim)
        completed = delivery.complete_job(rt, action.namespace, action.job_name, snapshot=job, delete=False)
        if completed is delivery.CompleteOutcome.COMPLETED:
            # Released; the next cleanup's bulk delete removes it, if it carries our deployment
            # label (the selector names it); else it is deleted here.
            metadata = job.get("metadata") or {}
            if job_labels.deployment_of(metadata.get("labels")) == rt.settings.effective_deployment:
                delivery.delete_delivered_later(rt, action.namespace)
            else:
                rt.kube.delete_job(action.namespace, action.job_name, uid=metadata.get("uid"))
        return _Outcome.ACTED if completed in _COMPLETE_ACTED else _Outcome.SKIPPED

    def _remove(self, namespace: str, name: str, job: Mapping[str, Any]) -> None:
        """A hand-edited Job whose dispatch has ended: our finalizers off it and its Pods (no
        delivered label: no selector of ours may select it), then deleted, exact by its uid."""
        rt = self.rt
        delivery.release_pods(self.rt, namespace, delivery.pods_by_job(rt, namespace, [name])[name])
        delivery.release_job(rt, namespace, name, snapshot=job, delivered=False)
        rt.kube.delete_job(namespace, name, propagation="Background", uid=(job.get("metadata") or {}).get("uid"))

    def starts(self, namespace: str, checks: Sequence[start_checks.StartCheck]) -> None:
        """Category 3's Jobs with no container started, past the grace: their Pending Pods read
        with one LIST for the page, each Job judged against its capability's clocks
        (`pod_health.assess`); one given up is failed with its cause and deleted
        (`delivery.fail_unstarted`), counted as acted."""
        if self.dry_run or not checks:
            return
        counts = self.report.categories[Category.RUNNING]
        try:
            pods = delivery.pending_pods(self.rt, namespace, [check.dispatch_id for check in checks])
        except DispatchError as e:
            log.warning("sweep: listing the pending pods in %s failed: %s: %s", namespace, e.reason, e)
            with self._lock:
                counts.errors += 1
            return
        given_up = [check for check in checks if assess(check.job, pods, age=check.age, policy=check.policy).fail]
        self._run(
            [
                functools.partial(self._count, counts, check, functools.partial(self._give_up, check))
                for check in given_up
            ]
        )

    def _give_up(self, check: start_checks.StartCheck) -> _Outcome:
        verdict = delivery.fail_unstarted(
            self.rt,
            check.namespace,
            check.job_name,
            dispatch_id=check.dispatch_id,
            attempts=check.attempts,
            snapshot=check.job,
            decide=lambda pods, events: assess(check.job, pods, age=check.age, policy=check.policy, events=events),
        )
        return _Outcome.SKIPPED if verdict is None else _Outcome.ACTED

    def _complete_all(self, namespace: str, actions: Sequence[CompleteJob]) -> None:
        """Category 2 for finished Jobs of one namespace, as their LIST read them (`job` set):
        those not handed to a queued completion delivered with one `delivery.complete_jobs`
        call, each counted as `one` would count it."""
        counts = self.report.categories[Category.FINISHED_UNRECORDED]
        with self._lock:
            counts.found += len(actions)
        actions = self._deferred(namespace, actions)
        if self.dry_run or not actions:
            return
        try:
            done = delivery.complete_jobs(self.rt, namespace, _snapshots(actions), delete=False)
        except DispatchError as e:  # not a Transient one (those stop the batch, below): find its Job
            log.warning("sweep: completing %d jobs in %s failed (%s: %s); completing them one by one",
                        len(actions), namespace, e.reason, e)  # fmt: skip
            for action in actions:
                self._count(counts, action, partial(self._carry_out, action))
            return
        # A Transient error stops the batch: `outcomes` covers the Jobs before it, in order.
        for action, outcome in zip(actions[: len(done.outcomes)], done.outcomes, strict=True):
            acted = _Outcome.ACTED if outcome in _COMPLETE_ACTED else _Outcome.SKIPPED
            self._count(counts, action, partial(_decided, acted))
        if done.error is not None:  # the Jobs after the error were not tried: the next sweep does
            log.warning("sweep: completing jobs in %s stopped: %s: %s; %d left",
                        namespace, done.error.reason, done.error, len(done.unavailable))  # fmt: skip
            with self._lock:
                counts.errors += len(actions) - len(done.outcomes)

    def _clean_up_all(self, namespace: str, actions: Sequence[CleanUpJob]) -> None:
        """Category 4 for recorded Jobs of one namespace, as their LIST read them (`job` set):
        each released with its Pods (listed once for all) as `one` would, but for those a queued
        completion is releasing."""
        counts = self.report.categories[Category.CLEANUP]
        with self._lock:
            counts.found += len(actions)
        actions = self._deferred(namespace, actions)
        if self.dry_run or not actions:
            return
        try:
            pods = delivery.pods_by_job(self.rt, namespace, [action.job_name for action in actions])
        except DispatchError as e:
            log.warning("sweep: listing the pods of %d recorded jobs in %s failed: %s: %s",
                        len(actions), namespace, e.reason, e)  # fmt: skip
            with self._lock:
                counts.errors += len(actions)
            return
        for action in actions:
            self._count(counts, action, partial(self._clean_up, action, pods[action.job_name]))

    def _clean_up(self, action: CleanUpJob, pods: Sequence[Mapping[str, Any]]) -> _Outcome:
        # A terminal state is final: nothing to re-read; the release itself is idempotent and
        # exact (by the listed uids). The namespace's bulk delete follows its pages. Pods
        # first, as the completion path does: the Job's finalizer stands for what is left.
        delivery.release_pods(self.rt, action.namespace, pods)
        delivery.release_job(self.rt, action.namespace, action.job_name, snapshot=action.job)
        return _Outcome.ACTED

    def _deferred(self, namespace: str, actions: Sequence[Deferrable]) -> list[Deferrable]:
        """The actions to carry out: all but those whose Job poll handed to a queued completion
        (a live `delivery.handoff` marker), counted as deferred.

        Deferring never loses a Job: a marker only expires. When the queued message is lost (a
        broker flush), the marker is gone after its TTL (HANDOFF_MIN_TTL_S, or more poll
        intervals) and the next sweep delivers (or releases) the Job itself. When Redis cannot
        say, nothing is deferred: a second delivery is refused by the guard and the database,
        a missed one is not.
        """
        rt = self.rt
        try:
            queued = handoff.pending(rt.redis, rt.settings.key_prefix, namespace, _snapshots(actions))
        except redis.RedisError as e:
            with self._lock:
                first, self._handoff_unreadable = not self._handoff_unreadable, True
            if first:
                log.warning("sweep: hand-off markers unreadable (%s); delivering every finished job found", e)
            return list(actions)
        with self._lock:
            self.report.completions_deferred += sum(queued)
        return [action for action, is_queued in zip(actions, queued, strict=True) if not is_queued]

    def one(self, action: Action) -> None:
        counts = self.report.categories[action.category]
        with self._lock:
            counts.found += 1
        if isinstance(action, ReportOrphan):
            self._report_orphan(action)
        if self.dry_run:
            return
        self._count(counts, action, lambda: self._carry_out(action))

    def label_all(self, namespace: str, jobs: Sequence[Mapping[str, Any]]) -> None:
        """Give this deployment's label to Jobs of its own made before the label existed."""
        if self.dry_run:
            with self._lock:
                self.report.jobs_labelled += len(jobs)
            return
        self._run([partial(self._label, namespace, job) for job in jobs])

    def _label(self, namespace: str, job: Mapping[str, Any]) -> None:
        name = (job.get("metadata") or {}).get("name", "")
        try:
            labelled = delivery.label_deployment(self.rt, namespace, name, snapshot=job)
        except DispatchError as e:
            log.warning("sweep: labelling job %s/%s failed: %s: %s", namespace, name, e.reason, e)
            with self._lock:
                self.report.add_problem(f"labelling job {namespace}/{name}: {e.reason}: {e}")
            return
        if labelled:
            log.info("sweep: job %s/%s predates the deployment label; labelled as ours", namespace, name)
            with self._lock:
                self.report.jobs_labelled += 1

    def renotify_all(self, dispatch_ids: Sequence[str]) -> None:
        self._run([partial(self.renotify, dispatch_id) for dispatch_id in dispatch_ids])

    def renotify(self, dispatch_id: str) -> None:
        counts = self.report.unnotified
        with self._lock:
            counts.found += 1
        if not self.dry_run:
            self._count(counts, dispatch_id, lambda: self._renotify(dispatch_id))

    def _run(self, calls: Sequence[Callable[[], None]]) -> None:
        if self._pool is None or len(calls) < 2:
            for call in calls:
                call()
            return
        for future in [self._pool.submit(call) for call in calls]:
            future.result()  # a bug (not a DispatchError) surfaces here, as it would inline

    def _count(self, counts: Counts, what: object, carry_out: Callable[[], _Outcome]) -> None:
        try:
            outcome = carry_out()
        except DispatchError as e:
            log.warning("sweep: %r failed: %s: %s", what, e.reason, e)
            outcome = _Outcome.FAILED
        with self._lock:
            if outcome is _Outcome.ACTED:
                counts.acted += 1
            elif outcome is _Outcome.SKIPPED:
                counts.skipped += 1
            elif outcome is _Outcome.FAILED:
                counts.errors += 1
        if outcome is _Outcome.ACTED:
            crashpoint(Point.MID_SWEEP)

    def _carry_out(self, action: Action) -> _Outcome:
        rt = self.rt
        if isinstance(action, CreateJob):
            created = delivery.create_job_for(rt, action.dispatch_id)
            return _Outcome.SKIPPED if created is delivery.CreateOutcome.SKIPPED else _Outcome.ACTED
        if isinstance(action, CompleteJob):
            # The namespace's bulk delete follows its pages: none per Job.
            completed = delivery.complete_job(rt, action.namespace, action.job_name, snapshot=action.job, delete=False)
            return _Outcome.ACTED if completed in _COMPLETE_ACTED else _Outcome.SKIPPED
        if isinstance(action, ReportRunning):
            if not action.adopt:
                return _Outcome.NOTHING
            # The Job exists but the row was never marked created: adopt it (409 path).
            adopted = delivery.create_job_for(rt, action.dispatch_id)
            return _Outcome.ACTED if adopted is delivery.CreateOutcome.ADOPTED else _Outcome.SKIPPED
        if isinstance(action, CleanUpJob):
            return self._clean_up(
                action, delivery.pods_by_job(rt, action.namespace, [action.job_name])[action.job_name]
            )
        if isinstance(action, FreePod):
            freed = delivery.release_pods(rt, action.namespace, [action.pod])
            return _Outcome.ACTED if freed else _Outcome.SKIPPED
        if isinstance(action, (RecreateJob, FailJobLost)):
            found = _job_or_none(rt, action.namespace, action.job_name)
            if found is not None:
                # Not under our selector, yet there by its name: hidden, or hand-edited.
                return self._tampered(TamperedJob(action.dispatch_id, action.namespace, action.job_name, job=found))
            return self._job_lost(action)
        if isinstance(action, TamperedJob):
            return self._tampered(action)
        if isinstance(action, ReportOrphan):
            return self._delete_orphan(action) if action.delete else _Outcome.NOTHING
        raise AssertionError(f"unknown action {action!r}")

    def _job_lost(self, action: RecreateJob | FailJobLost) -> _Outcome:
        """Re-create the lost Job, or fail the dispatch as JobLost: once, however many sweeps run.

        Under the dispatch's guard claim (the completion path takes the same one), the row
        must still be CREATED with the attempts counted when planned, and the Job still absent.
        """
        rt = self.rt
        claim = rt.guard.claim(action.dispatch_id)
        if claim is None:
            return _Outcome.SKIPPED  # another replica is delivering or re-creating it
        try:
            record = delivery.load_record(rt, action.dispatch_id)
            if (
                record is None
                or record.state is not DispatchState.CREATED
                or record.attempts != action.attempts
                or _job_exists(rt, action.namespace, action.job_name)
            ):
                return _Outcome.SKIPPED
            if isinstance(action, RecreateJob):
                # Counted only by the Job it makes: a refused create (quota, 429, 5xx) or a crash
                # before the POST spends nothing, and the next sweep tries again.
                attempt = action.attempts + 1
                log.warning(
                    "dispatch %s: job %s/%s vanished without a result; creating it again (attempt %d)",
                    action.dispatch_id, action.namespace, action.job_name, attempt,
                )  # fmt: skip
                rerun = {action.dispatch_id: delivery.Rerun(action.attempts, attempt)}
                outcome = delivery.create_jobs_for(rt, [action.dispatch_id], reruns=rerun).get(action.dispatch_id)
                return _Outcome.ACTED if outcome in _CREATE_ACTED else _Outcome.SKIPPED
            payload = {
                "reason": action.reason,
                "message": f"job {action.namespace}/{action.job_name} vanished without a result "
                f"after {action.attempts + 1} attempt(s)",
            }
            with transaction(rt.sessions) as session:
                won = dispatches.record_terminal(session, action.dispatch_id, EventType.WORKER_FAILED, payload)
            if not won:
                return _Outcome.SKIPPED
            log.warning("dispatch %s: %s", action.dispatch_id, payload["message"])
            statelog.dispatch_changed(record, DispatchState.FAILED, reason=action.reason)
            delivery.notify_engine(rt, action.dispatch_id)
            return _Outcome.ACTED
        finally:
            rt.guard.release(claim)

    def _report_orphan(self, action: ReportOrphan) -> None:
        log.warning(
            "sweep: never delivering job %s/%s (dispatch %s): %s: %s%s",
            action.namespace, action.job_name, action.dispatch_id or "unknown", action.reason, action.detail,
            "; deleting it (orphan policy)" if action.delete and not self.dry_run else "",
        )  # fmt: skip
        if not self.dry_run:
            self.rt.stats.incr(ORPHANS_REPORTED)

    def _delete_orphan(self, action: ReportOrphan) -> _Outcome:
        """Delete an orphan, if a fresh read of the Job and its dispatch still refuses it."""
        rt = self.rt
        try:
            job = rt.kube.get_job(action.namespace, action.job_name)
        except NotFound:
            return _Outcome.SKIPPED
        views = _views_for_jobs(rt, [job])
        view = views.get(action.dispatch_id) if action.dispatch_id is not None else None
        if refusal(job, view) is None:
            return _Outcome.SKIPPED  # it is a dispatch's own Job after all
        delivery.cleanup_job(rt, action.namespace, action.job_name, snapshot=job, delivered=False)
        return _Outcome.ACTED

    def _renotify(self, dispatch_id: str) -> _Outcome:
        rt = self.rt
        claim = rt.guard.claim(dispatch_id)
        if claim is None:
            return _Outcome.SKIPPED
        try:
            record = delivery.load_record(rt, dispatch_id)
            if record is None or record.notified:
                return _Outcome.SKIPPED
            return _Outcome.ACTED if delivery.notify_engine(rt, dispatch_id) else _Outcome.FAILED
        finally:
            rt.guard.release(claim)


def _snapshots(actions: Sequence[CompleteJob | CleanUpJob]) -> list[Mapping[str, Any]]:
    """The Jobs as the LIST read them, one per action (pure); only actions that carry one come here."""
    jobs = [action.job for action in actions if action.job is not None]
    if len(jobs) != len(actions):
        raise ValueError("a CompleteJob without the LIST's snapshot goes through Executor.one")
    return jobs


def stop_job(rt: Runtime, view: DispatchView, job: Mapping[str, Any]) -> bool:
    """Release and delete an ended dispatch's Job (exact by its uid), its Pods freed first; True
    once a GET finds it gone. Released with the delivered label, so that a DELETE that fails
    leaves it to the bulk delete. Idempotent: a cancel's own clean-up after it finds nothing."""
    metadata = job.get("metadata") or {}
    namespace, name = view.namespace, view.job_name
    delivery.release_pods(rt, namespace, delivery.pods_by_job(rt, namespace, [name])[name])
    delivery.release_job(rt, namespace, name, snapshot=job)
    rt.kube.delete_job(namespace, name, propagation="Background", uid=metadata.get("uid"))
    now = _job_or_none(rt, namespace, name)
    return now is None or (now.get("metadata") or {}).get("uid") != metadata.get("uid")


def _job_or_none(rt: Runtime, namespace: str, name: str) -> Mapping[str, Any] | None:
    """The Job of that name as a GET reads it now, or None if there is none."""
    try:
        return rt.kube.get_job(namespace, name)
    except NotFound:
        return None


def _job_exists(rt: Runtime, namespace: str, name: str) -> bool:
    try:
        rt.kube.get_job(namespace, name)
    except NotFound:
        return False
    return True
