"""Beat's scheduler: Celery's in-memory one, keeping its intervals on the monotonic clock and
writing the liveness heartbeat (tasks/heartbeat.py) for every task it hands to the broker.

Celery keys each entry on wall-clock datetimes (`last_run_at`, the heap's due times): a host
whose clock steps back a minute sends no poll, admit, cleanup or sweep for that minute, and one
stepped forward sends a burst. Here every entry's schedule reads `monotonic_now`, a datetime
that advances with `time.monotonic()` and never steps, so Celery's own heap and due-ness
arithmetic run unchanged on a clock that only moves forward. Only intervals make sense on it:
a calendar schedule (crontab, solar) is refused at start-up.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

from celery import Celery
from celery.beat import ScheduleEntry, Scheduler
from celery.schedules import maybe_schedule
from celery.schedules import schedule as interval_schedule

from k8s_dispatch.core.errors import ConfigError
from k8s_dispatch.tasks.heartbeat import clear_heartbeat, write_heartbeat

# An arbitrary origin: what `monotonic_now` returns is never mistaken for a wall-clock time.
MONOTONIC_ORIGIN = datetime(2000, 1, 1, tzinfo=UTC)


def monotonic_now() -> datetime:
    """`time.monotonic()` as an aware datetime from `MONOTONIC_ORIGIN`: it never steps."""
    return MONOTONIC_ORIGIN + timedelta(seconds=time.monotonic())


def on_monotonic_clock(schedule: Any, *, relative: bool, app: Celery | None) -> interval_schedule:
    """`schedule` (seconds, a timedelta or an interval) as an interval timed by `monotonic_now`.

    Raises:
        ConfigError: a calendar schedule (crontab, solar) or a `relative` interval (rounded to
            wall-clock boundaries): both exist only on the wall clock.
    """
    parsed = maybe_schedule(schedule, relative, app=app)
    if type(parsed) is not interval_schedule or parsed.relative:
        raise ConfigError(f"beat runs intervals on the monotonic clock; {parsed!r} needs the wall clock")
    return interval_schedule(timedelta(seconds=parsed.seconds), nowfun=monotonic_now, app=app)


class MonotonicEntry(ScheduleEntry):
    """A beat entry whose interval, last run and due-ness are all on `monotonic_now`."""

    def __init__(
        self,
        name: str | None = None,
        task: str | None = None,
        last_run_at: datetime | None = None,
        total_run_count: int | None = None,
        schedule: Any = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        options: dict[str, Any] | None = None,
        relative: bool = False,
        app: Celery | None = None,
    ) -> None:
        # Celery passes last_run_at only from default_now(), which is then monotonic_now too.
        monotonic = on_monotonic_clock(schedule, relative=relative, app=app)
        super().__init__(name, task, last_run_at, total_run_count, monotonic, args, kwargs, options, False, app)


class MonotonicScheduler(Scheduler):
    """Celery's in-memory scheduler with `MonotonicEntry` entries and a heartbeat per task sent.

    The heartbeat is written after the broker took the message (Celery's publish returned), so
    a beat that ticks but cannot send (broker gone, publish failing) stops renewing it.
    """

    Entry = MonotonicEntry

    def setup_schedule(self) -> None:
        clear_heartbeat()  # only a send of this beat's proves it alive
        super().setup_schedule()

    def install_default_entries(self, data: dict[str, Any]) -> None:
        """None: Celery's one default entry is a nightly crontab that cleans a results backend, and
        results never travel through Celery here (`task_ignore_result`, no backend)."""

    def apply_async(self, entry: ScheduleEntry, producer: Any = None, advance: bool = True, **kwargs: Any) -> Any:
        result = super().apply_async(entry, producer=producer, advance=advance, **kwargs)
        write_heartbeat()
        return result
