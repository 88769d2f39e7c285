"""The chaos run's fault schedule: reproducible from its seed, with the faults the issue asks for."""

from __future__ import annotations

import pytest

from k8s_dispatch.lab.chaos.fault_plan import BEAT, FaultKind, make_plan, worker_names

TARGETS = [*worker_names(3), BEAT]


def plan(seed: int = 7, **overrides):
    options = dict(window_s=100.0, kills=20, targets=TARGETS)
    options.update(overrides)
    return make_plan(seed, **options)


def test_the_same_seed_gives_the_same_plan_and_another_seed_another():
    assert plan(42) == plan(42)
    assert plan(42).faults != plan(43).faults


@pytest.mark.parametrize(
    "options, expected",
    [
        (
            {},
            {
                FaultKind.KILL: 20,
                FaultKind.BROKER_FLUSH: 1,
                FaultKind.API_RESTART: 1,
                FaultKind.DB_KILL: 1,
                FaultKind.POD_DELETE: 3,
                FaultKind.NAMESPACE_CHANGE: 1,
                FaultKind.API_FAULTS_ON: 1,
                FaultKind.API_FAULTS_OFF: 1,
            },
        ),
        (
            {"pod_deletes": 0, "namespace_changes": 2},
            {FaultKind.POD_DELETE: 0, FaultKind.NAMESPACE_CHANGE: 2},
        ),
        (
            {"kills": 3, "broker_flushes": 2, "api_restarts": 0, "db_kills": 0, "api_fault_rate": 0.0},
            {
                FaultKind.KILL: 3,
                FaultKind.BROKER_FLUSH: 2,
                FaultKind.API_RESTART: 0,
                FaultKind.DB_KILL: 0,
                FaultKind.API_FAULTS_ON: 0,
                FaultKind.API_FAULTS_OFF: 0,
            },
        ),
        (
            {"kills": 0},
            {FaultKind.KILL: 0, FaultKind.BROKER_FLUSH: 1, FaultKind.API_RESTART: 1, FaultKind.DB_KILL: 1},
        ),
    ],
)
def test_each_kind_of_fault_is_planned_as_often_as_asked(options, expected):
    result = plan(**options)
    for kind, count in expected.items():
        assert result.count(kind) == count, kind


@pytest.mark.parametrize("seed", range(20))
def test_faults_are_sorted_and_inside_their_part_of_the_window(seed):
    result = plan(seed, window_s=60.0)
    offsets = [f.at_s for f in result.faults]
    assert offsets == sorted(offsets)
    for fault in result.faults:
        assert 0.0 <= fault.at_s <= 60.0
        if fault.kind in (FaultKind.BROKER_FLUSH, FaultKind.API_RESTART, FaultKind.DB_KILL, FaultKind.POD_DELETE,
                          FaultKind.NAMESPACE_CHANGE):  # fmt: skip
            assert 12.0 <= fault.at_s <= 48.0, fault  # the middle: while work is in flight
        if fault.kind is FaultKind.NAMESPACE_CHANGE:
            assert 18.0 <= fault.at_s <= 30.0, fault  # the first half: work is scheduled after it too
        if fault.kind is FaultKind.API_FAULTS_ON:
            assert fault.at_s <= 6.0
        if fault.kind is FaultKind.API_FAULTS_OFF:
            assert fault.at_s == 60.0
        assert (fault.target is not None) == (fault.kind in (FaultKind.KILL, FaultKind.CLOCK_STEP))


NEW_KINDS = {"redis_restarts": FaultKind.REDIS_RESTART, "pg_restarts": FaultKind.PG_RESTART,
             "lost_cancels": FaultKind.LOST_CANCEL, "label_edits": FaultKind.LABEL_EDIT,
             "rolling_upgrades": FaultKind.ROLLING_UPGRADE}  # fmt: skip


def test_the_server_restarts_edits_lost_cancels_and_upgrade_are_planned_only_when_asked():
    assert all(plan().count(kind) == 0 for kind in NEW_KINDS.values())
    asked = plan(**{option: 2 for option in NEW_KINDS})
    assert all(asked.count(kind) == 2 for kind in NEW_KINDS.values())
    assert plan(**{option: 2 for option in NEW_KINDS}) == asked  # still a function of the seed


@pytest.mark.parametrize("seed", range(20))
def test_the_upgrade_comes_early_the_clock_steps_after_it_and_the_restarts_while_work_is_in_flight(seed):
    steps = [("worker-3", 600.0), (BEAT, -600.0)]
    result = plan(seed, window_s=100.0, redis_restarts=1, pg_restarts=1, lost_cancels=1, label_edits=1,
                  rolling_upgrades=1, clock_steps=steps)  # fmt: skip
    (upgrade,) = [f for f in result.faults if f.kind is FaultKind.ROLLING_UPGRADE]
    assert 8.0 <= upgrade.at_s <= 20.0
    stepped = [f for f in result.faults if f.kind is FaultKind.CLOCK_STEP]
    assert sorted((f.target, f.step_s) for f in stepped) == sorted(steps)
    assert all(25.0 <= f.at_s <= 60.0 and f.at_s > upgrade.at_s for f in stepped)
    for kind in (FaultKind.REDIS_RESTART, FaultKind.PG_RESTART, FaultKind.LOST_CANCEL, FaultKind.LABEL_EDIT):
        (fault,) = [f for f in result.faults if f.kind is kind]
        assert 20.0 <= fault.at_s <= 80.0, fault
    assert any("clock_step beat -600s" in line for line in result.describe().splitlines())


@pytest.mark.parametrize("option", sorted(NEW_KINDS))
def test_a_negative_count_of_a_new_fault_is_refused(option):
    with pytest.raises(ValueError):
        plan(**{option: -1})


@pytest.mark.parametrize("seed", range(20))
def test_with_enough_kills_every_process_is_killed_at_least_once(seed):
    kills = plan(seed, kills=20).kills_by_target()
    assert set(kills) == set(TARGETS)
    assert sum(kills.values()) == 20


def test_with_fewer_kills_than_processes_the_victims_are_drawn_from_the_targets():
    kills = plan(3, kills=2).kills_by_target()
    assert sum(kills.values()) == 2
    assert set(kills) <= set(TARGETS)


def test_the_api_fault_settings_travel_with_the_plan():
    result = plan(api_fault_rate=0.05, api_latency_ms=30)
    assert (result.api_fault_rate, result.api_latency_ms) == (0.05, 30)


def test_describe_lists_one_line_per_fault():
    result = plan(kills=2)
    lines = result.describe().splitlines()
    assert len(lines) == len(result.faults)
    assert any("kill" in line and ("worker-" in line or BEAT in line) for line in lines)


@pytest.mark.parametrize(
    "options",
    [
        {"window_s": 0.0},
        {"kills": -1},
        {"pod_deletes": -1},
        {"namespace_changes": -1},
        {"kills": 1, "targets": []},
        {"api_fault_rate": 1.5},
        {"api_latency_ms": -5},
    ],
)
def test_impossible_options_are_refused(options):
    with pytest.raises(ValueError):
        plan(**options)


def test_worker_names_are_numbered_from_one():
    assert worker_names(3) == ["worker-1", "worker-2", "worker-3"]


def test_the_cli_shows_a_seeds_plan_without_running_anything(capsys):
    from k8s_dispatch.lab.cli import main

    assert main(["chaos", "--seed", "3", "--dispatches", "1000", "--rate", "10", "--kills", "20", "--show-plan"]) == 0
    first = capsys.readouterr().out
    assert main(["chaos", "--seed", "3", "--show-plan"]) == 0  # the same, from the defaults
    assert capsys.readouterr().out == first
    lines = first.splitlines()
    assert lines[0] == "seed 3: faults over 100s"
    assert sum(" kill " in line for line in lines) == 20
    assert sum("broker_flush" in line for line in lines) == 1
    # the default run: its own servers restarted, a rolling upgrade, a worker's clock and beat's stepped
    for kind in ("redis_restart", "pg_restart", "rolling_upgrade", "lost_cancel", "label_edit"):
        assert sum(f" {kind}" in line for line in lines) == 1, kind
    assert sum("clock_step worker-1 +600s" in line or "clock_step beat -600s" in line for line in lines) == 2
    assert main(["chaos", "--seed", "3", "--upgrade-from", "none", "--show-plan"]) == 0
    assert "rolling_upgrade" not in capsys.readouterr().out


def test_the_cli_leaves_out_the_classes_of_fault_it_is_told_to_skip(capsys):
    from k8s_dispatch.lab.cli import main

    assert main(["chaos", "--seed", "3", "--skip", "redis_restart", "--skip", "clock_step", "--show-plan"]) == 0
    out = capsys.readouterr().out
    assert "redis_restart" not in out and "clock_step" not in out
    assert sum(f" {kind}" in line for line in out.splitlines() for kind in ("pg_restart", "label_edit")) == 2


@pytest.mark.parametrize("seed", [0, 11, 15])
def test_the_short_run_feeds_work_on_both_sides_of_the_namespace_change(seed):
    # The short run: 300 dispatches at 15/s. Whatever the move costs (a rolling upgrade's
    # migration beside it once took as long as the feed), the work planned from the move on is
    # fed only once every process runs the moved file, and the work before it is fed at once.
    from k8s_dispatch.lab.chaos.feeder import waits_for_move
    from k8s_dispatch.lab.chaos.options import ChaosOptions, fault_plan

    options = ChaosOptions(dispatches=300, rate=15, kills=8, seed=seed)
    moves = [f.at_s for f in fault_plan(options).faults if f.kind is FaultKind.NAMESPACE_CHANGE]
    held = [waits_for_move(i / options.rate, moves_at=moves, last=i == 299) for i in range(300)]
    assert len(moves) == 1 and held.index(True) > 0 and all(held[held.index(True) :])
    assert 50 <= held.count(True) <= 250, held.count(True)


def test_without_a_namespace_change_nothing_waits_and_the_last_dispatch_waits_for_a_late_one():
    from k8s_dispatch.lab.chaos.feeder import waits_for_move

    assert not waits_for_move(5.0, moves_at=[], last=True)
    assert not waits_for_move(5.0, moves_at=[30.0], last=False)
    assert waits_for_move(5.0, moves_at=[30.0], last=True)  # planned past the feed's end: the last one waits
    assert waits_for_move(30.0, moves_at=[30.0], last=False)
