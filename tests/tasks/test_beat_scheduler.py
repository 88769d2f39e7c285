"""Beat's scheduler keeps every entry on the monotonic clock and refuses what needs the wall clock
(a crontab, a relative interval). The real beat under a stepped clock: test_beat_clock_step.py;
its heartbeat: tests/deploy/test_beat_liveness.py."""

from __future__ import annotations

import tempfile
from datetime import timedelta

import pytest
from celery.schedules import crontab
from celery.schedules import schedule as interval_schedule

from k8s_dispatch import celeryconfig
from k8s_dispatch.core.errors import ConfigError
from k8s_dispatch.tasks.app import app
from k8s_dispatch.tasks.beat_scheduler import (
    MONOTONIC_ORIGIN,
    MonotonicEntry,
    MonotonicScheduler,
    monotonic_now,
    on_monotonic_clock,
)


@pytest.mark.parametrize("given", [2, 2.0, timedelta(seconds=2), interval_schedule(timedelta(seconds=2))])
def test_an_interval_in_any_form_is_timed_by_the_monotonic_clock(given) -> None:
    parsed = on_monotonic_clock(given, relative=False, app=app)
    assert parsed.seconds == 2.0
    assert parsed.nowfun is monotonic_now  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("given", "relative"),
    [(crontab(minute="0", hour="4"), False), (timedelta(hours=1), True)],
)
def test_what_needs_the_wall_clock_is_refused(given, relative: bool) -> None:
    with pytest.raises(ConfigError, match="monotonic"):
        on_monotonic_clock(given, relative=relative, app=app)


def test_the_configured_schedule_is_all_monotonic_and_unchanged(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the scheduler clears a heartbeat there
    scheduler = MonotonicScheduler(app, lazy=False)
    configured = celeryconfig.config(celeryconfig.get_settings())["beat_schedule"]
    assert set(scheduler.schedule) == set(configured)  # no default entry added (a crontab)
    for name, entry in scheduler.schedule.items():
        assert isinstance(entry, MonotonicEntry)
        assert (entry.task, entry.schedule) == (configured[name]["task"], configured[name]["schedule"])
        assert entry.last_run_at is not None and entry.last_run_at - MONOTONIC_ORIGIN < timedelta(days=365 * 20)
        due, next_s = entry.is_due()
        assert not due and 0 < next_s <= configured[name]["schedule"].total_seconds()
        following = next(entry)  # what Celery makes after a send
        assert isinstance(following, MonotonicEntry) and following.schedule.nowfun is monotonic_now  # type: ignore[union-attr]
