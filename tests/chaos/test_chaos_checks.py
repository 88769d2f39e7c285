"""The chaos run's verdict and its work mix (pure): each kind of damage is counted, and nothing
else is."""

from __future__ import annotations

from dataclasses import replace

import pytest

from k8s_dispatch.core.limits import parse as parse_limits
from k8s_dispatch.lab.chaos.checks import (
    ItemEvent,
    LimitPeak,
    RowSnapshot,
    TerminalEvent,
    judge,
    limit_peaks,
    mismatch,
    story,
)
from k8s_dispatch.lab.chaos.observer import CAPABILITY, TENANCY, VersionOrder, live_job, live_pod, running_now
from k8s_dispatch.lab.chaos.workload import (
    LIMITED_CAPABILITY,
    LIMITED_TENANCY,
    LIMITS,
    MAP_FAILING,
    MAP_ITEMS,
    MAP_PARALLELISM,
    MAP_SPAN,
    TENANCIES,
    Expected,
    ItemExpected,
    Kind,
    capabilities_config,
    expected,
    expected_end,
    expected_items,
    kind_of,
    map_plan,
    workload,
)
from k8s_dispatch.store.models import EventType, ItemEventType
from k8s_dispatch.workers.indexed import MAP_LABEL
from k8s_dispatch.workers.labels import (
    CAPABILITY_KEY,
    DEPLOYMENT_LABEL,
    DISPATCH_ID_KEY,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    TENANCY_ID_KEY,
)
from k8s_dispatch.workers.manifest import FINALIZER
from k8s_dispatch.workers.resolver import CapabilityResolver

DONE = Expected(EventType.WORKER_COMPLETED, output={"simulated": True, "input": {"n": 1}})
FAILS = Expected(EventType.WORKER_FAILED, reason="DeadlineExceeded")


def completed(output):
    return TerminalEvent("WORKER_COMPLETED", {"output": output})


def failed(reason):
    return TerminalEvent("WORKER_FAILED", {"reason": reason})


GOOD_EVENT = completed(DONE.output)
GOOD_ROW = RowSnapshot("COMPLETED", output=DONE.output)
FAIL_EVENT = failed("DeadlineExceeded")
FAIL_ROW = RowSnapshot("FAILED", reason="DeadlineExceeded")


def verdict(expected=None, rows=None, events=None, jobs=(), claims=()):
    return judge(
        expected if expected is not None else {"a": DONE, "b": FAILS},
        rows=rows if rows is not None else {"a": GOOD_ROW, "b": FAIL_ROW},
        events=events if events is not None else {"a": [GOOD_EVENT], "b": [FAIL_EVENT]},
        jobs=jobs,
        claims=claims,
    )


def test_a_clean_run_passes_and_counts_its_outcomes():
    v = verdict()
    assert v.ok
    assert (v.dispatched, v.terminal, v.lost, v.duplicates, v.wrong_output, v.leftover_jobs, v.held_claims) == (
        2, 2, 0, 0, 0, 0, 0,
    )  # fmt: skip
    assert v.outcomes == {"WORKER_COMPLETED": 1, "WORKER_FAILED:DeadlineExceeded": 1}
    assert v.problems == []


@pytest.mark.parametrize(
    "damage, field, count",
    [
        ({"events": {"b": [FAIL_EVENT]}}, "lost", 1),  # a: no terminal event
        ({"rows": {"b": FAIL_ROW}, "events": {"b": [FAIL_EVENT]}}, "lost", 1),  # a: not even a row
        ({"events": {"a": [GOOD_EVENT, failed("JobLost")], "b": [FAIL_EVENT]}}, "duplicates", 1),
        ({"events": {"a": [completed({"simulated": True, "input": {"n": 2}})], "b": [FAIL_EVENT]}}, "wrong_output", 1),
        ({"events": {"a": [GOOD_EVENT], "b": [failed("BackoffLimitExceeded")]}}, "wrong_output", 1),
        ({"events": {"a": [failed("JobLost")], "b": [FAIL_EVENT]}}, "wrong_output", 1),
        (
            {"events": {"a": [GOOD_EVENT], "b": [TerminalEvent("WORKER_CANCELLED", {"reason": "Cancelled"})]}},
            "wrong_output",
            1,
        ),
        ({"rows": {"a": RowSnapshot("COMPLETED", output=None), "b": FAIL_ROW}}, "wrong_output", 1),
        ({"rows": {"a": RowSnapshot("FAILED", output=DONE.output), "b": FAIL_ROW}}, "wrong_output", 1),
        (
            {"jobs": [{"metadata": {"name": "kd-1", "namespace": "chaos", "labels": {MANAGED_BY_LABEL: MANAGED_BY}}}]},
            "leftover_jobs",
            1,
        ),
        ({"jobs": [{"metadata": {"name": "x", "namespace": "chaos", "finalizers": [FINALIZER]}}]}, "leftover_jobs", 1),
        ({"claims": [("p:claim:a", 1200)]}, "held_claims", 1),
        ({"claims": [("p:claim:a", -1), ("p:claim:b", 10)]}, "held_claims", 2),
        (
            {"rows": {"a": GOOD_ROW, "b": RowSnapshot("FAILED", reason="DeadlineExceeded", notified=False)}},
            "unnotified",
            1,
        ),
    ],
)
def test_each_kind_of_damage_fails_the_run_and_is_counted_once(damage, field, count):
    v = verdict(**damage)
    assert not v.ok
    assert getattr(v, field) == count
    others = {"lost", "duplicates", "wrong_output", "leftover_jobs", "held_claims", "unnotified"} - {field}
    assert all(getattr(v, other) == 0 for other in others), v
    assert v.problems, "a failure names its dispatch, Job or key"


def test_a_foreign_job_without_our_label_or_finalizer_is_not_ours_to_judge():
    v = verdict(jobs=[{"metadata": {"name": "someone-elses", "namespace": "chaos", "labels": {"app": "x"}}}])
    assert v.ok and v.leftover_jobs == 0


def test_a_claim_without_expiry_is_called_out():
    v = verdict(claims=[("p:claim:a", -1)])
    assert v.claims_without_expiry == 1
    assert "no expiry" in v.problems[0]


def test_examples_are_capped_but_every_problem_is_counted():
    expected_many = {f"d{i}": DONE for i in range(20)}
    v = judge(expected_many, rows={}, events={}, jobs=[], claims=[])
    assert v.lost == 20
    assert len(v.problems) == 5
    assert v.suspects == [f"d{i}" for i in range(5)]  # the dispatches whose logs the report shows


def test_a_leftover_job_names_its_dispatch_as_a_suspect():
    job = {"metadata": {"name": "kd-a", "namespace": "chaos", "finalizers": [FINALIZER],
                        "labels": {MANAGED_BY_LABEL: MANAGED_BY, DISPATCH_ID_KEY: "a"}}}  # fmt: skip
    assert verdict(jobs=[job]).suspects == ["a"]
    assert verdict().suspects == []


def test_a_story_is_the_last_lines_naming_the_dispatch_across_logs_in_time_order():
    logs = {
        "worker-1.log": "[2026-12-02 17:39:29,085: WARNING] dispatch a: edited\n[2026-12-02 17:39:31,000: INFO] b\n",
        "beat.log": "[2026-12-02 17:39:30,500: INFO] poll saw a\n[2026-12-02 17:39:28,000: INFO] created a\n",
        "localcluster.log": "no stamp: a\n",
    }
    told = story(logs, "a")
    assert told == [
        "localcluster.log: no stamp: a",
        "beat.log: [2026-12-02 17:39:28,000: INFO] created a",
        "worker-1.log: [2026-12-02 17:39:29,085: WARNING] dispatch a: edited",
        "beat.log: [2026-12-02 17:39:30,500: INFO] poll saw a",
    ]
    assert story(logs, "a", lines=1) == ["beat.log: [2026-12-02 17:39:30,500: INFO] poll saw a"]
    assert story({"w": "x" * 500 + " a"}, "a")[0] == ("w: " + "x" * 500)[:240]


@pytest.mark.parametrize(
    "want, event, row, fine",
    [
        (DONE, GOOD_EVENT, GOOD_ROW, True),
        (FAILS, FAIL_EVENT, FAIL_ROW, True),
        (DONE, GOOD_EVENT, None, False),
        (FAILS, failed("DeadlineExceeded"), RowSnapshot("FAILED", reason="Other"), False),
    ],
)
def test_mismatch(want, event, row, fine):
    assert (mismatch(want, event, row) is None) is fine


# --- the work mix ------------------------------------------------------------------------------


def test_the_workload_is_reproducible_from_its_seed_and_unique_per_run():
    assert workload(5, 50, tag="t") == workload(5, 50, tag="t")
    assert [p.kind for p in workload(5, 50, tag="t")] != [p.kind for p in workload(6, 50, tag="t")]
    keys = {p.idempotency_key for p in workload(5, 50, tag="t")} | {p.idempotency_key for p in workload(5, 50, tag="u")}
    assert len(keys) == 100


def test_the_workload_mixes_every_kind_and_both_ways_of_scheduling():
    planned = workload(1, 400, tag="t", maps=5, stored=3, secrets=3)
    assert {p.kind for p in planned} == set(Kind)
    singles = [p for p in planned if p.map is None]
    assert 90 <= sum(p.via_task for p in singles) <= 100  # every 4th through the Celery task
    assert len({p.case_id for p in planned}) == 10
    # no maps, stored results or secret inputs unless asked
    assert {p.kind for p in workload(1, 400, tag="t")} == set(Kind) - {Kind.MAP, Kind.LARGE, Kind.SECRET}


@pytest.mark.parametrize("mode", ["simulate", "exec"])
def test_the_capability_file_is_valid_and_names_every_kind(mode):
    resolver = CapabilityResolver.from_mapping(capabilities_config(mode), source="<chaos>")
    assert {kind_of(name) for name in resolver.capabilities()} == set(Kind) - {Kind.LARGE, Kind.SECRET}
    assert resolver.spec("chaos.timeout").active_deadline_seconds == 2
    assert all(resolver.spec(name).backoff_limit == 0 for name in resolver.capabilities())


@pytest.mark.parametrize(
    "kind, mode, want",
    [
        (
            Kind.QUICK,
            "simulate",
            Expected(EventType.WORKER_COMPLETED, output={"simulated": True, "input": {"n": 1, "seconds": 1.5}}),
        ),
        (
            Kind.SLOW,
            "simulate",
            Expected(EventType.WORKER_COMPLETED, output={"simulated": True, "input": {"n": 1, "seconds": 1.5}}),
        ),
        (Kind.QUICK, "exec", Expected(EventType.WORKER_COMPLETED, output={"n": 1, "seconds": 1.5})),
        (Kind.SLOW, "exec", Expected(EventType.WORKER_COMPLETED, output={"slept": 1.5})),
        (Kind.FAIL, "simulate", Expected(EventType.WORKER_FAILED, reason="BackoffLimitExceeded")),
        (
            Kind.TIMEOUT,
            "exec",
            Expected(EventType.WORKER_FAILED, reason="DeadlineExceeded", also=frozenset({"BackoffLimitExceeded"})),
        ),
    ],
)
def test_the_expected_end_follows_from_kind_input_and_mode(kind, mode, want):
    assert expected(kind, {"n": 1, "seconds": 1.5}, mode=mode) == want


def test_kind_of_reads_back_only_our_capabilities():
    assert kind_of("chaos.slow") is Kind.SLOW
    assert kind_of("chaos.nope") is None
    assert kind_of("demo.primes") is None


@pytest.mark.parametrize(
    "seen, namespaces, counts",
    [
        ({"a": {("chaos", "u1")}}, {"a": "chaos"}, (0, 0)),
        ({"a": {("chaos", "u1"), ("chaos", "u2")}}, {"a": "chaos"}, (1, 0)),  # re-created: a second Job
        ({"a": {("chaos", "u1"), ("moved", "u2")}}, {"a": "chaos"}, (1, 1)),  # the namespace-change hole
        ({"a": {("moved", "u1")}}, {"a": "chaos"}, (0, 1)),
        ({"zz": {("chaos", "u1"), ("chaos", "u2")}}, {}, (0, 0)),  # another deployment's: not judged
        ({}, {"a": "chaos"}, (0, 0)),  # never seen (made and gone between two looks): not judged
    ],
)
def test_each_dispatch_has_one_job_in_the_namespace_it_recorded(seen, namespaces, counts):
    result = judge({"a": DONE}, rows={"a": GOOD_ROW}, events={"a": [GOOD_EVENT]}, jobs=(), claims=(),
                   namespaces=namespaces, jobs_seen=seen)  # fmt: skip
    assert (result.second_jobs, result.wrong_namespace) == counts
    assert result.ok == (counts == (0, 0))


def test_two_verdicts_merge_into_one_count():
    one = verdict(events={"a": [GOOD_EVENT, GOOD_EVENT], "b": [FAIL_EVENT]})
    other = verdict(events={"a": [GOOD_EVENT], "b": []})
    both = one.merged(other)
    assert (both.dispatched, both.terminal, both.duplicates, both.lost) == (4, 3, 1, 1)
    assert both.outcomes == one.outcomes + other.outcomes and not both.ok


@pytest.mark.parametrize("kind", [k for k in Kind if k.value.startswith("poison")])
def test_poison_work_must_end_result_not_json(kind):
    assert expected(kind, {"n": 1}, mode="simulate") == Expected(EventType.WORKER_FAILED, reason="ResultNotJson")
    assert expected(kind, {"n": 1}, mode="exec") == Expected(EventType.WORKER_FAILED, reason="ResultNotJson")


@pytest.mark.parametrize(("reason", "right"), [("DeadlineExceeded", True), ("BackoffLimitExceeded", True),
                                               ("JobLost", False), ("ResultNotJson", False)])  # fmt: skip
def test_a_hung_job_may_end_past_its_deadline_or_past_its_backoff_limit_and_nothing_else(reason, right):
    want = expected(Kind.TIMEOUT, {"n": 1}, mode="simulate")
    why = mismatch(want, failed(reason), RowSnapshot("FAILED", reason=reason))
    assert (why is None) == right, why


# --- fair-share limits (issue 17) --------------------------------------------------------------


@pytest.mark.parametrize("mode", ["simulate", "exec"])
def test_the_capability_file_limits_one_tenancy_every_other_and_the_slow_capability(mode):
    limits = CapabilityResolver.from_mapping(capabilities_config(mode), source="<chaos>").limits
    a, b = limits.tenancy(LIMITED_TENANCY), limits.tenancy("tenant-b")
    assert a.max_running is not None and b.max_running is not None and a.max_running < b.max_running
    assert limits.capability(LIMITED_CAPABILITY) is not None
    assert not CapabilityResolver.from_mapping(capabilities_config(mode, limits=False), source="<chaos>").limits


def test_each_limit_is_judged_by_the_most_jobs_seen_running_under_it():
    limits, _ = parse_limits(LIMITS, source="<chaos>")
    peaks = limit_peaks(limits, {("tenancy", "tenant-a"): 16, ("tenancy", "tenant-b"): 3}, tenancies=TENANCIES)
    assert [(p.scope, p.name, p.limit, p.peak) for p in peaks] == [
        ("tenancy", "tenant-a", 16, 16), ("tenancy", "tenant-b", 24, 3), ("capability", "chaos.slow", 16, 0),
    ]  # fmt: skip
    at_limit = verdict_with(peaks)
    assert at_limit.ok and at_limit.limit_exceeded == 0
    over = verdict_with(limit_peaks(limits, {("capability", "chaos.slow"): 17}, tenancies=TENANCIES))
    assert not over.ok and over.limit_exceeded == 1
    assert any("capability chaos.slow: 17 Jobs running at once, limit 16" in p for p in over.problems)
    assert verdict().limit_exceeded is None and verdict().ok  # no limits: nothing to judge


@pytest.mark.parametrize("open_slots", [(1, 0), (0, 1), (2, 3)])
def test_a_slot_held_or_a_dispatch_queued_after_convergence_fails_the_run(open_slots):
    left = verdict_with((), open_slots=open_slots)
    assert not left.ok and (left.running, left.queued) == open_slots
    assert any(p.startswith("slot left:") for p in left.problems)


def test_merged_verdicts_keep_the_worst_limit_and_add_the_slots_left():
    ok = LimitPeak("tenancy", "tenant-a", 12, 10)
    over = LimitPeak("neighbour tenancy", "tenant-a", 12, 13)
    both = verdict_with([ok], open_slots=(0, 1)).merged(verdict_with([over]))
    assert both.limit_exceeded == 1 and both.queued == 1 and both.limits == [ok, over] and not both.ok
    assert verdict().merged(verdict_with([ok])).limit_exceeded == -2


def job(uid, tenancy, capability, *, conditions=(), deployment="d1", deleting=False):
    metadata = {
        "uid": uid,
        "labels": {DEPLOYMENT_LABEL: deployment, TENANCY_ID_KEY: tenancy, CAPABILITY_KEY: capability},
    }
    if deleting:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": metadata, "status": {"conditions": [{"type": t, "status": "True"} for t in conditions]}}


def test_the_sampler_counts_running_jobs_per_deployment_tenancy_and_capability():
    jobs = {
        "1": job("1", "tenant-a", "chaos.slow"),
        "2": job("2", "tenant-a", "chaos.quick"),
        "3": job("3", "tenant-a", "chaos.slow", conditions=["Complete"]),
        "4": job("4", "tenant-b", "chaos.slow", conditions=["FailureTarget"]),  # the engine reads it as ended
        "5": job("5", "tenant-b", "chaos.slow", deleting=True),
        "6": job("6", "tenant-b", "chaos.slow", deployment="d2"),
    }
    counts = running_now({uid: live_job(j) for uid, j in jobs.items()})
    assert counts == {
        ("d1", TENANCY, "tenant-a"): 2, ("d1", CAPABILITY, "chaos.slow"): 1, ("d1", CAPABILITY, "chaos.quick"): 1,
        ("d2", TENANCY, "tenant-b"): 1, ("d2", CAPABILITY, "chaos.slow"): 1,
    }  # fmt: skip


def verdict_with(limits, *, open_slots=(0, 0)):
    return judge(
        {"a": DONE, "b": FAILS}, rows={"a": GOOD_ROW, "b": FAIL_ROW}, events={"a": [GOOD_EVENT], "b": [FAIL_EVENT]},
        jobs=(), claims=(), limits=limits, open_slots=open_slots,
    )  # fmt: skip


CANCEL_EVENT = TerminalEvent("WORKER_CANCELLED", {"reason": "Cancelled"})
CANCEL_ROW = RowSnapshot("CANCELLED", reason="Cancelled")
ANY = Expected(EventType.WORKER_COMPLETED, output={"x": 1}, any_end=True)


@pytest.mark.parametrize(
    "event, row",
    [
        (CANCEL_EVENT, CANCEL_ROW),
        (FAIL_EVENT, FAIL_ROW),
        (completed({"other": 2}), RowSnapshot("COMPLETED", output={"other": 2})),
    ],
)
def test_a_cancelled_or_edited_dispatch_may_end_in_any_terminal_event(event, row):
    assert mismatch(ANY, event, row) is None
    assert mismatch(DONE, CANCEL_EVENT, CANCEL_ROW) is not None  # a dispatch nobody touched may not


def test_a_cancelled_or_edited_dispatch_still_needs_its_row_to_agree_and_one_end_only():
    assert mismatch(ANY, CANCEL_EVENT, FAIL_ROW) is not None
    assert mismatch(ANY, CANCEL_EVENT, None) is not None
    result = verdict(expected={"a": ANY}, rows={"a": CANCEL_ROW}, events={"a": [CANCEL_EVENT, FAIL_EVENT]})
    assert result.duplicates == 1
    result = verdict(expected={"a": ANY}, rows={}, events={})
    assert result.lost == 1


def test_a_second_job_is_no_fault_only_for_a_dispatch_whose_job_was_edited_by_hand():
    from dataclasses import replace

    seen = {"a": {("chaos", "uid-1"), ("chaos", "uid-2")}}
    for want, second_jobs in ((ANY, 1), (replace(ANY, rerun_allowed=True), 0), (DONE, 1)):
        result = judge({"a": want}, rows={"a": GOOD_ROW}, events={"a": [GOOD_EVENT]}, jobs=(), claims=(),
                       jobs_seen=seen)  # fmt: skip
        assert result.second_jobs == second_jobs, want


def test_idle_namespaces_each_get_a_capability_that_the_resolver_watches(tmp_path):
    import yaml

    from k8s_dispatch.core.settings import load_settings
    from k8s_dispatch.lab.chaos.workload import idle_namespaces

    idle = idle_namespaces(48)
    assert len(set(idle)) == 48 and "chaos" not in idle and "chaos-moved" not in idle
    config = capabilities_config("simulate", idle=idle)
    assert sorted(spec["namespace"] for spec in config["capabilities"].values() if "namespace" in spec) == sorted(idle)
    path = tmp_path / "capabilities.yaml"
    path.write_text(yaml.safe_dump(config))
    resolver = CapabilityResolver.from_settings(
        load_settings({"K8S_DISPATCH_CAPABILITIES": str(path), "K8S_DISPATCH_NAMESPACE": "chaos"})
    )
    assert resolver.namespaces("chaos") == {"chaos", *idle}  # 49 here, the moved file adds chaos-moved


def test_an_exception_a_task_did_not_expect_is_found_in_the_worker_logs_and_nothing_else_is():
    from k8s_dispatch.lab.chaos.checks import unexpected_task_errors

    logs = {
        "worker-1.log": "[2026-12-02 07:01:00,981: ERROR/MainProcess] Task k8s-dispatch.sweep[170e] raised "
        "unexpected: ValueError('zip() argument 2 is shorter than argument 1')\nTraceback ...\n",
        "worker-2.log": "[...] Task k8s-dispatch.poll[1] retry: Retry in 1s: ApiUnavailable('500')\n"
        "[...] Task k8s-dispatch.create_jobs[2] succeeded in 0.1s: None\n",
    }
    assert unexpected_task_errors(logs) == [
        "worker-1.log: k8s-dispatch.sweep: ValueError('zip() argument 2 is shorter than argument 1')"
    ]
    assert unexpected_task_errors({"worker-2.log": logs["worker-2.log"]}) == []


# --- map dispatches (issue 29), item by item ---------------------------------------------------

ITEM_OK = ItemExpected(ItemEventType.ITEM_COMPLETED, output={"item": 0})
ITEM_FAILS = ItemExpected(ItemEventType.ITEM_FAILED, reason="ContainerFailed", exit_code=2)
MAP_DONE = Expected(EventType.WORKER_COMPLETED, output={"items": 2, "succeeded": 1, "failed": 1, "needed": 1})
MAP_EVENT = completed(MAP_DONE.output)
MAP_ROW = RowSnapshot("COMPLETED", output=MAP_DONE.output)


def item_completed(index, output):
    return ItemEvent("WORKER_ITEM_COMPLETED", {"item": index, "output": output})


def item_failed(index, reason="ContainerFailed", exit_code=2):
    return ItemEvent("WORKER_ITEM_FAILED", {"item": index, "reason": reason, "exit_code": exit_code, "message": "x"})


GOOD_ITEMS = [item_completed(0, {"item": 0}), item_failed(1)]


def map_verdict(item_events=None, pods=(), want=MAP_DONE, event=MAP_EVENT, row=MAP_ROW, items=(ITEM_OK, ITEM_FAILS)):
    return judge(
        {"a": DONE, "m": want}, rows={"a": GOOD_ROW, "m": row}, events={"a": [GOOD_EVENT], "m": [event]},
        jobs=(), claims=(), items={"m": list(items)},
        item_events={"m": GOOD_ITEMS if item_events is None else item_events}, pods=pods,
    )  # fmt: skip


ITEM_FIELDS = {"lost", "duplicates", "wrong_output", "items_lost", "items_duplicates", "items_wrong_output",
               "held_pods", "leftover_jobs"}  # fmt: skip


def test_a_clean_map_passes_and_counts_its_items_and_their_outcomes():
    v = map_verdict()
    assert v.ok, v.problems
    assert (v.dispatched, v.maps, v.items) == (2, 1, 2)
    assert all(getattr(v, f) == 0 for f in ITEM_FIELDS)
    assert v.item_outcomes == {"WORKER_ITEM_COMPLETED": 1, "WORKER_ITEM_FAILED:ContainerFailed": 1}


def held_pod(finalizers=(FINALIZER,)):
    return {"metadata": {"name": "kd-m-0-x", "namespace": "chaos", "finalizers": list(finalizers),
                         "labels": {DISPATCH_ID_KEY: "m"}}, "status": {"phase": "Succeeded"}}  # fmt: skip


@pytest.mark.parametrize(
    "damage, field",
    [
        ({"item_events": [item_completed(0, {"item": 0})]}, "items_lost"),
        ({"item_events": [*GOOD_ITEMS, item_failed(1, reason="ItemResultLost")]}, "items_duplicates"),
        ({"item_events": [item_completed(0, {"item": 1}), item_failed(1)]}, "items_wrong_output"),  # another's output
        ({"item_events": [ItemEvent("WORKER_ITEM_COMPLETED", {"item": 0}), item_failed(1)]}, "items_wrong_output"),
        ({"item_events": [item_completed(0, {"item": 0}), item_failed(1, reason="BackoffLimitExceeded")]},
         "items_wrong_output"),
        ({"item_events": [item_completed(0, {"item": 0}), item_failed(1, exit_code=137)]}, "items_wrong_output"),
        ({"item_events": [item_completed(0, {"item": 0}), item_completed(1, {"item": 1})]}, "items_wrong_output"),
        ({"item_events": [*GOOD_ITEMS, item_completed(2, {"item": 2})]}, "items_wrong_output"),  # no such item
        ({"item_events": [*GOOD_ITEMS, ItemEvent("WORKER_ITEM_FAILED", {"reason": "x"})]}, "items_wrong_output"),
        ({"pods": [held_pod()]}, "held_pods"),
        # the map's own end, with the wrong counts
        ({"event": completed({"items": 2, "succeeded": 2, "failed": 0, "needed": 1}),
          "row": RowSnapshot("COMPLETED", output={"items": 2, "succeeded": 2, "failed": 0, "needed": 1})},
         "wrong_output"),
        ({"want": Expected(EventType.WORKER_FAILED, reason="ItemsFailed",
                           detail={"items": 2, "succeeded": 1, "failed": 1, "needed": 2}),
          "event": TerminalEvent("WORKER_FAILED", {"reason": "ItemsFailed",
                                                   "detail": {"items": 2, "succeeded": 0, "failed": 2, "needed": 2}}),
          "row": RowSnapshot("FAILED", reason="ItemsFailed")}, "wrong_output"),
    ],
)  # fmt: skip
def test_each_kind_of_damage_to_a_map_fails_the_run_and_is_counted_once(damage, field):
    v = map_verdict(**damage)
    assert not v.ok
    assert getattr(v, field) == 1, v
    assert all(getattr(v, other) == 0 for other in ITEM_FIELDS - {field}), v
    assert v.problems and "m" in v.suspects  # the report shows the map's log lines


def test_a_pod_freed_of_our_finalizer_is_not_held_and_a_failed_map_with_its_counts_passes():
    assert map_verdict(pods=[held_pod(finalizers=("batch.kubernetes.io/job-tracking",))]).ok
    summary = {"items": 2, "succeeded": 1, "failed": 1, "needed": 2}
    want = Expected(EventType.WORKER_FAILED, reason="ItemsFailed", detail=summary)
    event = TerminalEvent("WORKER_FAILED", {"reason": "ItemsFailed", "message": "1 of 2", "detail": summary})
    assert map_verdict(want=want, event=event, row=RowSnapshot("FAILED", reason="ItemsFailed")).ok


def test_the_items_of_a_cancelled_or_edited_map_may_end_any_way_but_once_each():
    anyhow = [replace(ITEM_OK, any_end=True), replace(ITEM_FAILS, any_end=True)]
    cancelled = [ItemEvent("WORKER_ITEM_CANCELLED", {"item": 0, "reason": "Cancelled"}), item_failed(1, "JobLost")]
    assert map_verdict(item_events=cancelled, items=anyhow).ok
    assert map_verdict(item_events=cancelled[:1], items=anyhow).items_lost == 1
    assert map_verdict(item_events=[*cancelled, cancelled[0]], items=anyhow).items_duplicates == 1


def test_merged_verdicts_add_the_items_counts():
    both = map_verdict(item_events=GOOD_ITEMS[:1]).merged(map_verdict(pods=[held_pod()]))
    assert (both.maps, both.items, both.items_lost, both.held_pods) == (2, 4, 1, 1) and not both.ok
    assert both.item_outcomes == {"WORKER_ITEM_COMPLETED": 2, "WORKER_ITEM_FAILED:ContainerFailed": 1}


def test_the_workload_places_seeded_maps_early_in_the_feed_sent_both_ways():
    planned = workload(11, 300, tag="t", maps=4)
    maps = [p for p in planned if p.map is not None]
    assert len(planned) == 300 and len(maps) == 4 and all(p.kind is Kind.MAP for p in maps)
    assert all(p.index < 300 * MAP_SPAN for p in maps)
    assert [p.via_task for p in maps] == [False, True, False, True]
    without = workload(11, 300, tag="t")  # the singles' draws stay as they were, their places aside
    assert [p for p in planned if p.map is None] == [p for p in without if p.index not in {m.index for m in maps}]
    for p in maps:
        assert MAP_ITEMS[0] <= len(p.map.items) <= MAP_ITEMS[1]
        assert MAP_PARALLELISM[0] <= p.map.parallelism <= MAP_PARALLELISM[1]
    # The rules in turn: every item needed (fails), the others needed, the same with maxFailedIndexes.
    ends = [expected_end(p, mode="simulate") for p in maps]
    assert [e.event for e in ends] == [EventType.WORKER_FAILED, EventType.WORKER_COMPLETED,
                                       EventType.WORKER_COMPLETED, EventType.WORKER_FAILED]  # fmt: skip
    assert ends[0].reason == "ItemsFailed" and ends[0].detail["failed"] == maps[0].map.failing > 0
    assert maps[2].map.max_failed_items == maps[2].map.failing and maps[1].map.max_failed_items is None


def test_each_item_is_expected_to_end_as_its_index_says_in_both_modes():
    plan = map_plan(3, 0)
    size = len(plan.items)
    sim, real = expected_items(plan, mode="simulate"), expected_items(plan, mode="exec")
    assert len(sim) == len(real) == size
    for i in range(size):
        if i in MAP_FAILING:
            assert sim[i] == ItemExpected(ItemEventType.ITEM_FAILED, reason="ContainerFailed", exit_code=2)
            assert real[i].reason == "ContainerFailed" and real[i].exit_code == 1
            assert plan.items[i]["seconds"] < 0  # the exec function refuses it
        else:
            assert sim[i].output == {"item": i}
            assert real[i].output == {"slept": plan.items[i]["seconds"]}


def test_the_map_capability_simulates_each_index_as_the_items_are_expected_to_end():
    import json

    spec = capabilities_config("simulate")["capabilities"]["chaos.map"]
    table = json.loads(spec["annotations"]["localcluster.k8s-dispatch.io/by-index"])
    assert set(table) == {str(i) for i in range(MAP_ITEMS[1])}
    for i, entry in table.items():
        if int(i) in MAP_FAILING:
            assert (entry["outcome"], entry["exit-code"]) == ("fail", "2")
        else:
            assert entry["result"] == {"item": int(i)} and "outcome" not in entry
    assert capabilities_config("exec")["capabilities"]["chaos.map"]["args"] == ["k8s_dispatch.demo.functions:sleep"]


def pod(uid, tenancy, capability, phase, *, deleting=False, is_map=True):
    metadata = {"uid": uid, "labels": {DEPLOYMENT_LABEL: "d1", TENANCY_ID_KEY: tenancy, CAPABILITY_KEY: capability}}
    if is_map:
        metadata["labels"][MAP_LABEL] = "true"
    if deleting:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": metadata, "status": {"phase": phase}}


def test_the_sampler_counts_a_map_as_its_running_pods_not_as_its_job():
    map_job = job("m", "tenant-a", "chaos.map")
    map_job["metadata"]["labels"][MAP_LABEL] = "true"
    jobs = {"m": live_job(map_job), "1": live_job(job("1", "tenant-a", "chaos.slow"))}
    pods = {
        uid: live_pod(p)
        for uid, p in {
            "p1": pod("p1", "tenant-a", "chaos.map", "Running"),
            "p2": pod("p2", "tenant-a", "chaos.map", "Pending"),
            "p3": pod("p3", "tenant-a", "chaos.map", "Succeeded"),
            "p4": pod("p4", "tenant-a", "chaos.map", "Running", deleting=True),
        }.items()
    }
    assert (
        live_pod(pod("s", "tenant-a", "chaos.slow", "Running", is_map=False)) is None
    )  # a single's Pod: its Job counts
    counts = running_now(jobs, pods)
    assert counts == {("d1", TENANCY, "tenant-a"): 3, ("d1", CAPABILITY, "chaos.map"): 2,
                      ("d1", CAPABILITY, "chaos.slow"): 1}  # fmt: skip


def test_two_watches_are_applied_in_version_order_once_both_reached_it():
    order = VersionOrder(("jobs", "pods"))
    applied = []
    order.add("pods", "7", lambda: applied.append("pod created at 7"))
    assert applied == [] and order.held == 1  # the Jobs watch may still hold an earlier change
    order.add("jobs", "5", lambda: applied.append("job ended at 5"))
    assert applied == ["job ended at 5"]
    order.add("jobs", "9")  # a bookmark: the Jobs watch is past 7
    assert applied == ["job ended at 5", "pod created at 7"] and order.held == 0
    order.add("jobs", "x", lambda: applied.append("not a number: at once"))
    assert applied[-1] == "not a number: at once"
