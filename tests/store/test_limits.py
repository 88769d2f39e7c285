"""Fair-share limits (pure): the config's parse names what is wrong, and `choose` gives a free
slot to the tenancy furthest below its weighted share, then by priority and first in."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from k8s_dispatch.core.errors import ConfigError
from k8s_dispatch.core.limits import Candidate, Limits, TenancyLimit, choose, free_slots, parse
from k8s_dispatch.workers.resolver import CapabilityResolver

T0 = datetime(2026, 12, 1, tzinfo=UTC)
CAPS = {"demo.sha256": {"worker": "w", "image": "i:1"}, "demo.wordcount": {"worker": "w", "image": "i:1"}}


def test_the_issue_example_parses() -> None:
    limits, problems = parse(
        {
            "tenancies": {"default": {"maxRunning": 100}, "acme": {"maxRunning": 3, "weight": 2}},
            "capabilities": {"demo.sha256": {"maxRunning": 5}},
        },
        source="caps.yaml",
    )
    assert problems == []
    assert limits.tenancy("acme") == TenancyLimit(3, 2)
    assert limits.tenancy("anyone") == TenancyLimit(100, 1)  # the default's
    assert limits.capability("demo.sha256") == 5 and limits.capability("demo.wordcount") is None
    assert limits.limits("anyone", "demo.wordcount")


def test_no_limits_queue_nothing() -> None:
    limits, problems = parse(None, source="caps.yaml")
    assert not limits and problems == [] and not limits.limits("t", "c")
    only_acme, _ = parse({"tenancies": {"acme": {"maxRunning": 1}}}, source="caps.yaml")
    assert only_acme.limits("acme", "c") and not only_acme.limits("other", "c")


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"tenancies": {"acme": {"maxRunning": -1}}}, "caps.yaml: limits.tenancies.acme: field 'maxRunning': must be"),
        ({"tenancies": {"acme": {"maxRuning": 3}}}, "caps.yaml: limits.tenancies.acme: unknown field 'maxRuning'"),
        ({"tenancies": {"acme": {"weight": 0}}}, "caps.yaml: limits.tenancies.acme: field 'weight': must be"),
        ({"tenancies": {"acme": {"maxRunning": True}}}, "limits.tenancies.acme: field 'maxRunning'"),
        ({"tenancies": {"acme": {"maxRunning": "3"}}}, "limits.tenancies.acme: field 'maxRunning'"),
        ({"tenancies": {"acme": 3}}, "caps.yaml: limits.tenancies.acme: must be a mapping"),
        ({"capabilities": {"demo.sha256": {}}}, "limits.capabilities.demo.sha256: field 'maxRunning': required"),
        ({"capabilities": {"demo.sha256": {"maxRunning": 2, "weight": 1}}}, "unknown field 'weight'"),
        ({"tenants": {}}, "caps.yaml: limits: unknown key 'tenants'"),
        ([1], "caps.yaml: limits: must be a mapping"),
    ],
)
def test_a_bad_field_names_the_file_the_key_and_the_field(section: object, message: str) -> None:
    _, problems = parse(section, source="caps.yaml")
    assert any(message in p for p in problems), problems
    with pytest.raises(ConfigError, match="invalid capability config") as raised:
        CapabilityResolver.from_mapping({"capabilities": CAPS, "limits": section}, source="caps.yaml")
    assert message.split(": ", 1)[-1] in str(raised.value)


def test_a_limit_on_an_unknown_capability_stops_the_start() -> None:
    with pytest.raises(ConfigError, match=r"limits.capabilities.demo.sha265: no such capability"):
        CapabilityResolver.from_mapping(
            {"capabilities": CAPS, "limits": {"capabilities": {"demo.sha265": {"maxRunning": 1}}}}, source="caps.yaml"
        )


def test_the_resolver_keeps_its_limits_with_a_default_namespace() -> None:
    resolver = CapabilityResolver.from_mapping(
        {"capabilities": CAPS, "limits": {"tenancies": {"acme": {"maxRunning": 0}}}}, source="caps.yaml"
    ).with_default_namespace("jobs")
    assert resolver.limits.tenancy("acme").max_running == 0


def candidates(tenancy: str, capability: str, n: int, *, start: int = 0, priority: int = 0) -> list[Candidate]:
    return [
        Candidate(
            f"{tenancy}-{capability}-{start + i}", tenancy, capability, priority, T0 + timedelta(seconds=start + i)
        )
        for i in range(n)
    ]


def limits(**tenancies: TenancyLimit) -> Limits:
    return Limits(tenancies=tenancies)


def test_a_tenancy_gets_no_more_than_its_limit() -> None:
    chosen = choose(limits(a=TenancyLimit(3)), {("a", "c"): 1}, {("a", "c"): candidates("a", "c", 5)})
    assert [c.dispatch_id for c in chosen] == ["a-c-0", "a-c-1"]


def test_zero_pauses_and_unlimited_takes_all() -> None:
    heads = {("a", "c"): candidates("a", "c", 2), ("b", "c"): candidates("b", "c", 2)}
    chosen = choose(limits(a=TenancyLimit(0)), {}, heads)
    assert [c.tenancy_id for c in chosen] == ["b", "b"]


def test_within_a_tenancy_priority_then_first_in() -> None:
    heads = {
        ("a", "x"): candidates("a", "x", 2),
        ("a", "y"): candidates("a", "y", 2, start=5, priority=7),
    }
    chosen = choose(limits(a=TenancyLimit(3)), {}, heads)
    assert [c.dispatch_id for c in chosen] == ["a-y-5", "a-y-6", "a-x-0"]


def test_slots_of_a_shared_capability_follow_the_weights() -> None:
    shared = Limits(tenancies={"a": TenancyLimit(None, 1), "b": TenancyLimit(None, 2)}, capabilities={"c": 6})
    heads = {("a", "c"): candidates("a", "c", 6), ("b", "c"): candidates("b", "c", 6, start=100)}
    chosen = choose(shared, {}, heads)
    assert sorted(c.tenancy_id for c in chosen) == ["a", "a", "b", "b", "b", "b"]


def test_a_freed_slot_goes_to_the_tenancy_furthest_below_its_share() -> None:
    shared = Limits(tenancies={"a": TenancyLimit(None, 1), "b": TenancyLimit(None, 2)}, capabilities={"c": 6})
    heads = {("a", "c"): candidates("a", "c", 3), ("b", "c"): candidates("b", "c", 3)}
    # b holds 3 of its share of 4, a holds 2 of its 2: the slot is b's, though a's head is older
    assert [c.tenancy_id for c in choose(shared, {("a", "c"): 2, ("b", "c"): 3}, heads)] == ["b"]
    # a holds 1 of 2, b holds 4 of 4: a's
    assert [c.tenancy_id for c in choose(shared, {("a", "c"): 1, ("b", "c"): 4}, heads)] == ["a"]


def test_a_full_capability_lets_the_tenancys_other_work_through() -> None:
    capped = Limits(tenancies={"a": TenancyLimit(5)}, capabilities={"x": 1})
    heads = {("a", "x"): candidates("a", "x", 3), ("a", "y"): candidates("a", "y", 3, start=10)}
    chosen = choose(capped, {("a", "x"): 1}, heads)
    assert [c.dispatch_id for c in chosen] == ["a-y-10", "a-y-11", "a-y-12"]
    assert free_slots(capped, {("a", "x"): 1}, ("a", "x")) == 0
    assert free_slots(capped, {("a", "x"): 1}, ("a", "y")) == 4
    assert free_slots(Limits(), {}, ("a", "x")) is None
