"""The chaos run's feeder: the engine's side, scheduling each planned dispatch at the run's rate
(in its own transaction or as the Celery `schedule` task; a map through `schedule_map_in_session`
or the `schedule_map` task; a secret input sealed under the deployment's input key, in the
database and in the task's message alike) and sending lost task calls again. The work planned
after the namespace change waits for it to be done."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence

import sqlalchemy as sa

from k8s_dispatch.core.errors import DispatchError
from k8s_dispatch.lab.chaos.fault_plan import FaultKind
from k8s_dispatch.lab.chaos.options import RESEND_AFTER_S, TICK_S
from k8s_dispatch.lab.chaos.state import RunState
from k8s_dispatch.lab.chaos.stores import chunks
from k8s_dispatch.lab.chaos.workload import Planned
from k8s_dispatch.store.models import Dispatch

log = logging.getLogger(__name__)


def waits_for_move(at_s: float, *, moves_at: Sequence[float], last: bool) -> bool:
    """Whether the dispatch planned at `at_s` (seconds into the feed) waits until the namespace
    change planned at `moves_at` is done: the work planned from the first move on, and the last
    dispatch in any case, so that some of the run's work is scheduled by processes on the moved
    file however long the move (or a rolling upgrade beside it) takes. No move, no wait."""
    return bool(moves_at) and (at_s >= min(moves_at) or last)


class Feeder(RunState):
    """The engine: schedules the planned dispatches at the run's rate, in the database or as the
    `schedule` task, and sends a task call again when its dispatch is not recorded in time."""

    def _feed(self) -> None:
        moves = [f.at_s for f in self.result.plan.faults if f.kind is FaultKind.NAMESPACE_CHANGE]
        try:
            for planned in self.planned:
                at_s = planned.index / self.options.rate
                if not self._sleep_until(self.t0 + at_s):
                    return
                if waits_for_move(at_s, moves_at=moves, last=planned is self.planned[-1]) and not self._wait_moved():
                    return
                self._schedule(planned)
            self.result.feed_s = time.monotonic() - self.t0
        except BaseException as e:
            self.feed_error = e

    def _wait_moved(self) -> bool:
        """Wait until the namespace change is done (`moved`); False if the run is stopping."""
        while not self.moved.wait(TICK_S):
            if self.stop.is_set():
                return False
        return not self.stop.is_set()

    def _schedule(self, planned: Planned) -> None:
        from kombu.exceptions import OperationalError

        from k8s_dispatch.core.errors import DatabaseUnavailable
        from k8s_dispatch.store.db import transaction
        from k8s_dispatch.tasks.maps import schedule_map_in_session
        from k8s_dispatch.tasks.scheduling import schedule_many_in_session
        from k8s_dispatch.workers.resolver import CapabilityResolver

        # While the previous release runs on its schema, the engine sends the `schedule` task
        # (its workers write the rows), as an engine whose library is not upgraded yet would.
        if planned.via_task or self.old_schema:
            dispatch_id = planned.dispatch_id or str(uuid.uuid4())
            with self.ids_lock:
                self.ids[planned.index] = dispatch_id
                self.by_task[dispatch_id] = planned
            try:
                self._send_schedule(planned, dispatch_id)
            except OperationalError as e:
                log.warning("schedule task for %s not sent (%s); sent again later", dispatch_id, e)
            return
        resolver = getattr(self, "_resolver", None) or CapabilityResolver.from_settings(self.settings)
        self._resolver = resolver  # the engine's router: replaced when the capability file changes
        while not self.stop.is_set():
            try:
                with transaction(self.sessions) as session:
                    if planned.map is not None:
                        scheduled = schedule_map_in_session(
                            session, case_id=planned.case_id, tenancy_id=planned.tenancy_id,
                            capability=planned.capability, items=list(planned.map.items),
                            idempotency_key=planned.idempotency_key, parallelism=planned.map.parallelism,
                            max_failed_items=planned.map.max_failed_items, min_succeeded=planned.map.min_succeeded,
                            router=resolver, max_input_bytes=self.settings.max_input_bytes, via=self.producer,
                        )  # fmt: skip
                    else:
                        (scheduled,) = schedule_many_in_session(
                            session, [planned.request()], router=resolver,
                            max_input_bytes=self.settings.max_input_bytes, input_key=self.settings.input_key,
                            via=self.producer,
                        )  # fmt: skip
            except DatabaseUnavailable as e:  # the engine retries its own transaction
                log.warning("scheduling %s: %s; retrying", planned.idempotency_key, e)
                time.sleep(0.2)
                continue
            with self.ids_lock:
                self.ids[planned.index] = scheduled.dispatch_id
            return

    def _send_schedule(self, planned: Planned, dispatch_id: str) -> None:
        from k8s_dispatch import celeryconfig as names
        from k8s_dispatch.tasks.maps import SCHEDULE_MAP_TASK

        self.sent_at[dispatch_id] = time.monotonic()
        self.sends[dispatch_id] += 1
        if planned.map is not None:
            self.producer.send_task(
                SCHEDULE_MAP_TASK,
                args=[planned.case_id, planned.tenancy_id, planned.capability, list(planned.map.items),
                      planned.idempotency_key, planned.map.parallelism],
                kwargs={"max_failed_items": planned.map.max_failed_items,
                        "min_succeeded": planned.map.min_succeeded, "dispatch_id": dispatch_id},
            )  # fmt: skip
            return
        if planned.secret:  # the message carries only the Fernet token, as send_schedule_until_recorded's
            from k8s_dispatch.core.payloads import canonical_json
            from k8s_dispatch.store.secret_inputs import seal

            sealed = self.sealed.get(dispatch_id) or seal(canonical_json(planned.input), self.settings.input_key)
            self.sealed[dispatch_id] = sealed  # sealed once: every resend carries the same token
            self.producer.send_task(
                names.SCHEDULE_TASK,
                args=[planned.case_id, planned.tenancy_id, planned.capability, None, planned.idempotency_key],
                kwargs={"dispatch_id": dispatch_id, "sealed_input": sealed},
            )
            return
        self.producer.send_task(
            names.SCHEDULE_TASK,
            args=[planned.case_id, planned.tenancy_id, planned.capability, planned.input, planned.idempotency_key],
            kwargs={"dispatch_id": dispatch_id},
        )

    def _resend_unrecorded(self) -> None:
        """The engine's half of the `schedule` task: a call not recorded in time is sent again."""
        from kombu.exceptions import OperationalError

        now = time.monotonic()
        with self.ids_lock:
            waiting = {d: p for d, p in self.by_task.items() if d not in self.recorded}
        due = {
            d: p
            for d, p in waiting.items()
            if now - self.sent_at.get(d, 0.0) >= RESEND_AFTER_S * 2 ** max(0, self.sends[d] - 1)
        }
        if not due:
            return
        try:
            present = self._existing(list(due))
        except DispatchError as e:
            log.warning("cannot read dispatches to resend: %s", e)
            return
        self.recorded |= present
        for dispatch_id, planned in due.items():
            if dispatch_id in present:
                continue
            try:
                self._send_schedule(planned, dispatch_id)
                self.result.resends += 1
            except OperationalError as e:
                log.warning("schedule task for %s not sent again (%s)", dispatch_id, e)

    def _existing(self, ids: list[str]) -> set[str]:
        from k8s_dispatch.store.db import transaction

        found: set[str] = set()
        with transaction(self.sessions) as session:
            for chunk in chunks(ids):
                found.update(session.scalars(sa.select(Dispatch.dispatch_id).where(Dispatch.dispatch_id.in_(chunk))))
        return found
