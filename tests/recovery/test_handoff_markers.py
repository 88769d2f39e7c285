"""Hand-off markers on real Redis (`delivery.handoff`): poll marks, the sweep reads, markers expire.

(Not test_handoff.py: tests/tasks/test_handoff.py has that basename, and the test directories
are not packages, so two modules of one name cannot be collected together.)
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis

from k8s_dispatch.delivery import handoff
from k8s_dispatch.ops.processes import free_port, wait_until


def job(name: str, uid: str | None = None) -> dict[str, Any]:
    return {"metadata": {"name": name, "uid": uid or str(uuid.uuid4())}, "status": {"succeeded": 1}}


def test_the_key_names_namespace_job_and_uid() -> None:
    assert handoff.key("p", "ns", job("j-1", "u-1")) == "p:handoff:ns/j-1/u-1"


def test_mark_marks_each_job_once_per_ttl_and_pending_sees_it(client: redis.Redis, prefix: str) -> None:
    a, b, c = job("a"), job("b"), job("c")
    assert handoff.pending(client, prefix, "ns", [a, b, c]) == [False, False, False]
    assert handoff.mark(client, prefix, "ns", [a, b], 60.0) == [True, True]
    assert handoff.mark(client, prefix, "ns", [a, b, c], 60.0) == [False, False, True]  # only c is new
    assert handoff.pending(client, prefix, "ns", [c, a, b]) == [True, True, True]
    assert 0 < client.pttl(handoff.key(prefix, "ns", a)) <= 60_000


def test_renew_keeps_a_marker_alive_without_handing_its_job_off_again(client: redis.Redis, prefix: str) -> None:
    a, b = job("a"), job("b")
    assert handoff.mark(client, prefix, "ns", [a], 0.5) == [True]
    assert handoff.mark(client, prefix, "ns", [a, b], 60.0, renew=True) == [False, True]  # a: renewed, not new
    assert client.pttl(handoff.key(prefix, "ns", a)) > 50_000 and client.pttl(handoff.key(prefix, "ns", b)) > 50_000
    assert handoff.mark(client, prefix, "ns", [a], 0.5) == [False]  # without renew: left as it is
    assert client.pttl(handoff.key(prefix, "ns", a)) > 50_000


def test_a_marker_is_the_jobs_own_not_its_namesakes(client: redis.Redis, prefix: str) -> None:
    first = job("same-name")
    handoff.mark(client, prefix, "ns", [first], 60.0)
    recreated = job("same-name")  # a new uid: a Job re-created under the same name
    assert handoff.pending(client, prefix, "ns", [first, recreated]) == [True, False]
    assert handoff.pending(client, prefix, "other-ns", [first]) == [False]
    assert handoff.mark(client, prefix, "ns", [recreated], 60.0) == [True]


def test_no_jobs_asks_redis_nothing() -> None:
    unreachable = redis.Redis(port=free_port(), socket_connect_timeout=1)
    assert handoff.mark(unreachable, "p", "ns", [], 10.0) == []
    assert handoff.pending(unreachable, "p", "ns", []) == []
    unreachable.close()


def test_a_marker_expires_after_its_ttl_and_the_job_can_be_handed_again(client: redis.Redis, prefix: str) -> None:
    a = job("a")
    assert handoff.mark(client, prefix, "ns", [a], 0.2) == [True]
    assert handoff.pending(client, prefix, "ns", [a]) == [True]
    wait_until(lambda: handoff.pending(client, prefix, "ns", [a]) == [False], what="the marker expired", timeout=5.0)
    assert handoff.mark(client, prefix, "ns", [a], 60.0) == [True]


def test_pending_raises_a_redis_error_when_redis_is_unreachable() -> None:
    unreachable = redis.Redis(port=free_port(), socket_connect_timeout=1)
    with pytest.raises(redis.RedisError):
        handoff.pending(unreachable, "p", "ns", [job("a")])
    with pytest.raises(redis.RedisError):
        handoff.mark(unreachable, "p", "ns", [job("a")], 10.0)
    unreachable.close()
