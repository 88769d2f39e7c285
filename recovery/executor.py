"""The recovery sweep's executor: carries out the planned actions through `delivery`, counting
each in the report (found, acted, skipped, errors), a few at a time; a fresh read under the
dispatch's guard claim decides whether an action is still needed, so a sweep that runs twice, or
beside another, changes nothing twice."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import datetime, timedelta
from enum import Enum
from functools import partial
from typing import Any, TypeVar

import redis
import sqlalchemy as sa

from k8s_dispatch.core.errors import DispatchError, NotFound
from k8s_dispatch.core.settings import OrphanPolicy
from k8s_dispatch.delivery import cleanup, complete, create, handoff, items, records, terminal, unstarted
from k8s_dispatch.delivery.crashpoints import Point, crashpoint
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
    Policy,
    RecreateJob,
    ReportOrphan,
    ReportRunning,
    StopStep,
    TamperedJob,
    TamperStep,
    hidden,
    missing_job,
    name_dispatch_id,
    named_dispatch_ids,
    refusal,
    stop_step,
    tamper_step,
)
from k8s_dispatch.recovery.report import Counts, SweepReport
from k8s_dispatch.store import dispatches
from k8s_dispatch.store.db import database_now, transaction
from k8s_dispatch.store.models import Dispatch, DispatchState
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.indexed import is_map_job
from k8s_dispatch.workers.pod_health import assess

log = logging.getLogger(__name__)

ORPHANS_REPORTED = "orphans_reported"  # a Redis stats counter, cluster-wide (see delivery.stats)

_COMPLETE_ACTED = (complete.CompleteOutcome.COMPLETED, complete.CompleteOutcome.RERUN)
_CREATE_ACTED = (
    create.CreateOutcome.CREATED,
    create.CreateOutcome.ADOPTED,
    create.CreateOutcome.FAILED,
    create.CreateOutcome.ENDED,
)
Deferrable = TypeVar("Deferrable", CompleteJob, CleanUpJob)  # a Job a queued completion may be handling


class _Outcome(Enum):
    ACTED = "acted"
    SKIPPED = "skipped"  # a fresh read showed it was no longer needed
    NOTHING = "nothing"  # a finding that asks for no side effect (a running Job)
    FAILED = "failed"  # could not be done now (counted as an error); the next sweep retries


def _decided(outcome: _Outcome) -> _Outcome:
    """An outcome known already, for `Executor._count` (which otherwise carries an action out)."""
    return outcome


def views_for_jobs(rt: Runtime, jobs: Sequence[dict[str, Any]]) -> dict[str, DispatchView]:
    """The dispatches the Jobs' (or Pods') labels name, read with one query per page of them
    (the labels are checked by the plan, which reports a Job whose labels do not hold up), and
    the dispatches the Jobs' names stand for (a Job hand-edited is still its dispatch's)."""
    ids = {dispatch_id for job in jobs for dispatch_id in named_dispatch_ids(job)}
    ids |= {dispatch_id for job in jobs if (dispatch_id := name_dispatch_id(job)) is not None}
    with transaction(rt.sessions) as session:
        rows = dispatches.dispatch_rows(session, ids)
        return {dispatch_id: view_of(rt, row) for dispatch_id, row in rows.items()}


def view_of(rt: Runtime, row: Dispatch | sa.Row[Any]) -> DispatchView:
    record = DispatchRecord.from_row(row)
    namespace, _ = records.job_location(rt, record)
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


# --- carrying actions out ------------------------------------------------------------------


class Executor:
    """Carries out planned actions through `delivery`, counting each in the report.

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
        there (`CleanUpJob`) that a completion is releasing now: while Jobs finish quickly, a
        sweep's page meets many such, and each would cost a patch that finds no Job.
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
        job = action.job if action.job is not None else job_or_none(rt, action.namespace, action.job_name)
        missing: CreateJob | RecreateJob | FailJobLost | None = None
        claim = rt.guard.claim(action.dispatch_id)
        if claim is None:
            return _Outcome.SKIPPED  # another replica is delivering it
        try:
            with transaction(rt.sessions) as session:
                row = dispatches.dispatch_rows(session, [action.dispatch_id]).get(action.dispatch_id)
                now = database_now(session)
            if row is None:
                return _Outcome.SKIPPED
            view = view_of(rt, row)
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
            if step is TamperStep.MISSING:
                missing = missing_job(view, now=now, policy=Policy.from_settings(rt.settings))
                if missing is None:
                    return _Outcome.NOTHING  # inside the grace: the next sweep looks again
            if step in (TamperStep.CLEAN, TamperStep.DELETE):
                if step is TamperStep.DELETE:
                    # Noted first: the dispatch is found again from its row, with no Job.
                    with transaction(rt.sessions) as session:
                        dispatches.note_job_tampered(session, view.dispatch_id, now=now)
                    log.warning(
                        "dispatch %s: its job %s/%s was edited by hand (%s); deleting it (orphan policy), "
                        "the dispatch gets a job of its own", view.dispatch_id, action.namespace, action.job_name,
                        refused,
                    )  # fmt: skip
                assert job is not None
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
                assert refused is not None and job is not None
                message = (
                    f"job {action.namespace}/{action.job_name} was edited by hand and disagreed with the "
                    f"dispatch for {(now - (view.job_tampered_at or now)).total_seconds():.0f}s: {refused}"
                )
                detail = {"namespace": action.namespace, "job": action.job_name, "refusal": refused.reason}
                won = terminal.fail_dispatch(
                    rt, view.dispatch_id, reason=JOB_TAMPERED_REASON, message=message, detail=detail
                )
                self._remove(action.namespace, action.job_name, job)
                return _Outcome.ACTED if won else _Outcome.SKIPPED
            if step not in (TamperStep.DELIVER, TamperStep.MISSING):
                return _Outcome.ACTED if noted else _Outcome.NOTHING  # WAIT, RUNS
        finally:
            rt.guard.release(claim)
        if missing is not None:  # each takes the claim itself
            if isinstance(missing, CreateJob):
                made = create.create_job_for(rt, missing.dispatch_id)
                return _Outcome.ACTED if made in _CREATE_ACTED else _Outcome.SKIPPED
            return self._job_lost(missing)
        assert job is not None
        completed = complete.complete_job(rt, action.namespace, action.job_name, snapshot=job, delete=False)
        if completed is complete.CompleteOutcome.COMPLETED:
            # Released; the next cleanup's bulk delete removes it, if it carries our deployment
            # label (the selector names it); else it is deleted here.
            metadata = job.get("metadata") or {}
            if job_labels.deployment_of(metadata.get("labels")) == rt.settings.effective_deployment:
                cleanup.delete_delivered_later(rt, action.namespace)
            else:
                rt.kube.delete_job(action.namespace, action.job_name, uid=metadata.get("uid"))
        return _Outcome.ACTED if completed in _COMPLETE_ACTED else _Outcome.SKIPPED

    def _remove(self, namespace: str, name: str, job: Mapping[str, Any]) -> None:
        """A hand-edited Job whose dispatch has ended: our finalizers off it and its Pods (no
        delivered label: no selector of ours may select it), then deleted, exact by its uid."""
        rt = self.rt
        cleanup.release_pods(self.rt, namespace, cleanup.pods_by_job(rt, namespace, [name])[name])
        cleanup.release_job(rt, namespace, name, snapshot=job, delivered=False)
        rt.kube.delete_job(namespace, name, propagation="Background", uid=(job.get("metadata") or {}).get("uid"))

    def starts(self, namespace: str, checks: Sequence[start_checks.StartCheck]) -> None:
        """Category 3's Jobs with no container started, past the grace: their Pending Pods read
        with one LIST for the page, each Job judged against its capability's clocks
        (`pod_health.assess`); one given up is failed with its cause and deleted
        (`unstarted.fail_unstarted`), counted as acted."""
        if self.dry_run or not checks:
            return
        counts = self.report.categories[Category.RUNNING]
        try:
            pods = unstarted.pending_pods(self.rt, namespace, [check.dispatch_id for check in checks])
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
        verdict = unstarted.fail_unstarted(
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
        those not handed to a queued completion delivered with one `complete.complete_jobs`
        call, each counted as `one` would count it."""
        counts = self.report.categories[Category.FINISHED_UNRECORDED]
        with self._lock:
            counts.found += len(actions)
        actions = self._deferred(namespace, actions)
        if self.dry_run or not actions:
            return
        try:
            done = complete.complete_jobs(self.rt, namespace, _snapshots(actions), delete=False)
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
        for action in [a for a in actions if a.job is not None and is_map_job(a.job)]:
            self._count(counts, action, partial(self._clean_up_map, action))
        actions = [a for a in actions if a.job is None or not is_map_job(a.job)]
        if not actions:
            return
        try:
            pods = cleanup.pods_by_job(self.rt, namespace, [action.job_name for action in actions])
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
        cleanup.release_pods(self.rt, action.namespace, pods)
        cleanup.release_job(self.rt, action.namespace, action.job_name, snapshot=action.job)
        return _Outcome.ACTED

    def _clean_up_map(self, action: CleanUpJob) -> _Outcome:
        # A map's Pods are many: freed by its hand-off's path (`delivery.items`), under the
        # dispatch's guard claim, so that a completion still freeing them is not raced PATCH
        # for PATCH; skipped while another holds the claim.
        assert action.job is not None
        done = items.deliver_maps(self.rt, action.namespace, [action.job])
        if done.error is not None:
            raise done.error
        return _Outcome.ACTED if done.outcomes == [items.ALREADY_TERMINAL] else _Outcome.SKIPPED

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
            labelled = cleanup.label_deployment(self.rt, namespace, name, snapshot=job)
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
            created = create.create_job_for(rt, action.dispatch_id)
            return _Outcome.SKIPPED if created is create.CreateOutcome.SKIPPED else _Outcome.ACTED
        if isinstance(action, CompleteJob):
            # The namespace's bulk delete follows its pages: none per Job.
            completed = complete.complete_job(rt, action.namespace, action.job_name, snapshot=action.job, delete=False)
            return _Outcome.ACTED if completed in _COMPLETE_ACTED else _Outcome.SKIPPED
        if isinstance(action, ReportRunning):
            if not action.adopt:
                return _Outcome.NOTHING
            # The Job exists but the row was never marked created: adopt it (409 path).
            adopted = create.create_job_for(rt, action.dispatch_id)
            return _Outcome.ACTED if adopted is create.CreateOutcome.ADOPTED else _Outcome.SKIPPED
        if isinstance(action, CleanUpJob):
            return self._clean_up(action, cleanup.pods_by_job(rt, action.namespace, [action.job_name])[action.job_name])
        if isinstance(action, FreePod):
            freed = cleanup.release_pods(rt, action.namespace, [action.pod])
            return _Outcome.ACTED if freed else _Outcome.SKIPPED
        if isinstance(action, (RecreateJob, FailJobLost)):
            found = job_or_none(rt, action.namespace, action.job_name)
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
            record = records.load_record(rt, action.dispatch_id)
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
                rerun = {action.dispatch_id: create.Rerun(action.attempts, attempt)}
                outcome = create.create_jobs_for(rt, [action.dispatch_id], reruns=rerun).get(action.dispatch_id)
                return _Outcome.ACTED if outcome in _CREATE_ACTED else _Outcome.SKIPPED
            message = (
                f"job {action.namespace}/{action.job_name} vanished without a result "
                f"after {action.attempts + 1} attempt(s)"
            )
            if not terminal.fail_dispatch(rt, action.dispatch_id, reason=action.reason, message=message):
                return _Outcome.SKIPPED
            log.warning("dispatch %s: %s", action.dispatch_id, message)
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
        views = views_for_jobs(rt, [job])
        view = views.get(action.dispatch_id) if action.dispatch_id is not None else None
        if refusal(job, view) is None:
            return _Outcome.SKIPPED  # it is a dispatch's own Job after all
        cleanup.cleanup_job(rt, action.namespace, action.job_name, snapshot=job, delivered=False)
        return _Outcome.ACTED

    def _renotify(self, dispatch_id: str) -> _Outcome:
        rt = self.rt
        claim = rt.guard.claim(dispatch_id)
        if claim is None:
            return _Outcome.SKIPPED
        try:
            record = records.load_record(rt, dispatch_id)
            if record is None or record.notified:
                return _Outcome.SKIPPED
            return _Outcome.ACTED if terminal.notify_engine(rt, dispatch_id) else _Outcome.FAILED
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
    cleanup.release_pods(rt, namespace, cleanup.pods_by_job(rt, namespace, [name])[name])
    cleanup.release_job(rt, namespace, name, snapshot=job)
    rt.kube.delete_job(namespace, name, propagation="Background", uid=metadata.get("uid"))
    now = job_or_none(rt, namespace, name)
    return now is None or (now.get("metadata") or {}).get("uid") != metadata.get("uid")


def job_or_none(rt: Runtime, namespace: str, name: str) -> Mapping[str, Any] | None:
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
