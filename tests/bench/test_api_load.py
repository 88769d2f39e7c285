"""The API-load benchmark (issue 8, figures 2 and 3; issue 14's real control plane) at its smoke
size: a few Jobs for a few seconds against the real services, on localcluster and on the real
kube-apiserver. The figures must come out, and sane: requests counted by the server for every
Job that finished, the request types each pattern (and on the real server, each sender) makes,
and latencies between zero and a few poll intervals. Not a timed assertion: the smoke size says
nothing about speed."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from k8s_dispatch.lab.bench import api_counts, api_load, services
from k8s_dispatch.lab.bench.__main__ import CLUSTERS
from k8s_dispatch.lab.bench.results import BenchResult
from k8s_dispatch.lab.bench.sizes import SIZES

PG_ADMIN_URL = os.environ.get("K8S_DISPATCH_TEST_PG_ADMIN_URL", services.PG_ADMIN_URL)


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[BenchResult]:
    with services.redis_prefix(redis_url) as prefix:
        ctx = services.BenchContext(
            work_dir=Path(tmp_path_factory.mktemp("api-load")), pg_admin_url=PG_ADMIN_URL,
            redis_url=redis_url, key_prefix=prefix, clusters=CLUSTERS["both"],
        )  # fmt: skip
        yield api_load.run(ctx, SIZES["smoke"])


def figure(result: BenchResult, name: str) -> float:
    return next(f.median for f in result.figures if f.name == name)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_requests_per_job_and_per_second_are_counted_for_both_patterns(result: BenchResult) -> None:
    for n in api_load.KNOBS["smoke"].jobs:
        for variant in ("ours", "baseline"):
            counted = result.params[f"{variant}_{n}"]
            assert counted["jobs_finished"] > 0, counted
            # at least the create of each finished Job's successor, and far fewer than a GET a second
            assert 1 <= figure(result, f"requests_per_job_{variant}_{n}") <= 20, counted
            assert figure(result, f"requests_per_s_{variant}_{n}") > 0
        ours, baseline = (
            result.params[f"ours_{n}"]["requests_by_verb"],
            result.params[f"baseline_{n}"]["requests_by_verb"],
        )
        # poll reads a slice of a watch: the server counts a WATCH when its stream ends, so a stream kept
        # open across a short window counts none (test_bench_smoke's MAY_BE_ZERO); never a GET per Job
        assert not any(key.startswith("GET jobs ") for key in ours), ours
        assert any(key.startswith("POST jobs 201") for key in ours), ours
        assert any(key.startswith("GET jobs ") for key in baseline), baseline  # a GET per Job
        ratio = next(r for r in result.ratios if r.name == f"baseline_vs_ours_requests_per_s_{n}")
        assert ratio.median > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_completion_latency_is_between_zero_and_a_few_poll_intervals(result: BenchResult) -> None:
    for n in api_load.KNOBS["smoke"].jobs:
        p50 = figure(result, f"completion_latency_p50_s_{n}")
        p99 = figure(result, f"completion_latency_p99_s_{n}")
        assert 0 < p50 <= p99 < 10 * api_load.POLL_INTERVAL_S, (p50, p99)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_real_control_plane_splits_every_request_by_who_sent_it(result: BenchResult) -> None:
    for n in api_load.KNOBS["smoke"].real_jobs:
        counted = result.params[f"real_{n}"]
        assert counted["jobs_finished"] > 0, counted
        by_sender = counted["requests_by_sender"]
        # what each sender is there for: ours creates and finds Jobs, the Job controller makes
        # their Pods and status, the node agent binds and reports the Pods
        ours = set(by_sender["ours"])
        # Poll by watch, never by LIST: the audit log has a watch once it ends, and the run's last
        # slice may still be open when the window closes (on a busy machine, the only one).
        assert "POST jobs 201" in ours and ("WATCH jobs 200" in ours or "LIST jobs 200" not in ours), ours
        assert {"POST pods 201", "PUT jobs/status 200"} <= set(by_sender["job-controller"]), by_sender
        assert {"POST pods/binding 201", "PATCH pods/status 200"} <= set(by_sender["node"]), by_sender["node"]
        assert "bench" not in by_sender  # the bench's own scrapes and watch are no one's load
        # the audit log's split covers what the server counted (the same window, up to its edges)
        assert abs(counted["requests_audited"] - counted["requests"]) <= max(5, 0.1 * counted["requests"]), counted
        total = figure(result, f"requests_per_job_real_{n}")
        parts = [figure(result, f"requests_per_job_{who}_real_{n}") for who in ("ours", "controllers", "node")]
        assert all(part >= 1 for part in parts) and sum(parts) <= 1.2 * total, (total, parts)
        assert figure(result, f"requests_per_s_real_{n}") > 0
        p50 = figure(result, f"completion_latency_p50_s_real_{n}")
        p99 = figure(result, f"completion_latency_p99_s_real_{n}")
        assert 0 < p50 <= p99 < 10 * api_load.POLL_INTERVAL_S, (p50, p99)
        assert {"kube-apiserver", "etcd", "kube-controller-manager", "node", "worker"} <= set(
            counted["cpu_percent_of_a_core"]
        )


def _audit_line(at: str, *, user: str, verb: str, resource: str = "", sub: str = "", code: int = 200,
                agent: str = "OpenAPI-Generator/31.0.0/python", uri: str = "/apis/batch/v1/namespaces/ns/jobs",
                stage: str = "ResponseComplete") -> str:  # fmt: skip
    ref = {"resource": resource, **({"subresource": sub} if sub else {})} if resource else None
    return json.dumps({
        "stage": stage, "verb": verb, "user": {"username": user}, "userAgent": agent, "requestURI": uri,
        **({"objectRef": ref} if ref else {}), "responseStatus": {"code": code},
        "requestReceivedTimestamp": f"2026-01-01T00:00:{at}Z", "stageTimestamp": f"2026-01-01T00:00:{at}Z",
    })  # fmt: skip


def test_audited_counts_the_requests_answered_between_the_two_scrapes_by_sender() -> None:
    scrape = {"user": "admin", "verb": "get", "agent": services.BENCH_USER_AGENT, "uri": "/metrics"}
    lines = [
        _audit_line("01.000000", user="admin", verb="create", resource="jobs", code=201),  # before the window
        _audit_line("02.000000", **scrape),
        _audit_line("02.500000", user="admin", verb="create", resource="jobs", code=201),
        _audit_line("02.600000", user="admin", verb="create", resource="jobs", code=201, stage="RequestReceived"),
        _audit_line("03.000000", user="admin", verb="deletecollection", resource="jobs"),
        _audit_line("03.100000", user="system:serviceaccount:kube-system:job-controller", verb="update",
                    resource="jobs", sub="status"),
        _audit_line("03.200000", user="system:node:n1", verb="create", resource="pods", sub="binding", code=201),
        _audit_line("03.300000", user="admin", verb="watch", resource="jobs", agent=services.BENCH_USER_AGENT),
        _audit_line("03.400000", user="system:apiserver", verb="get", uri="/healthz"),
        _audit_line("04.000000", **scrape),
        _audit_line("04.500000", user="admin", verb="list", resource="jobs"),  # after the window
        '{"stage": "ResponseComplete", "verb"',  # half-written
    ]  # fmt: skip
    assert api_load.audited(lines, admin="admin") == {
        "ours": Counter({("POST", "jobs", "", 201): 1, ("DELETE", "jobs", "", 200): 1}),
        "job-controller": Counter({("PUT", "jobs", "status", 200): 1}),
        "node": Counter({("POST", "pods", "binding", 201): 1}),
        "bench": Counter({("WATCH", "jobs", "", 200): 1, ("GET", "", "/metrics", 200): 1}),
        "system:apiserver": Counter({("GET", "", "/healthz", 200): 1}),
    }
    assert api_load.audited(lines[:3], admin="admin") == {}  # one scrape: no window


@pytest.mark.parametrize(
    ("counts", "behind"),
    [
        ({api_load.CREATED: 10, ("POST", "pods", "", 201): 10, ("POST", "pods", "binding", 201): 10}, 0),
        # the Job controller behind, then the node agent behind: whichever is further back counts
        ({api_load.CREATED: 10, ("POST", "pods", "", 201): 4, ("POST", "pods", "binding", 201): 4}, 6),
        ({api_load.CREATED: 10, ("POST", "pods", "", 201): 9, ("POST", "pods", "binding", 201): 7}, 3),
        (
            {
                api_load.CREATED: 3,
                ("POST", "pods", "", 201): 3,
                ("POST", "pods", "binding", 201): 3,
                ("POST", "jobs", "", 409): 5,
            },
            0,
        ),  # a refused create makes no Job
    ],
)
def test_pods_behind_counts_the_jobs_without_a_bound_pod(counts: dict[api_load.Key, int], behind: int) -> None:
    assert api_load.pods_behind(Counter(counts)) == behind


@pytest.mark.parametrize(
    ("user", "agent", "group"),
    [
        ("admin", "OpenAPI-Generator/31.0.0/python", api_load.OURS),
        ("admin", services.BENCH_USER_AGENT, api_load.BENCH),
        ("system:node:k8s-dispatch-node", "localcluster-node/v1", api_load.NODE),
        ("system:serviceaccount:kube-system:job-controller", "kube-controller-manager/v1.36.3", api_load.CONTROLLERS),
        ("system:serviceaccount:kube-system:generic-garbage-collector", "", api_load.CONTROLLERS),
        ("system:kube-controller-manager", "", api_load.CONTROLLERS),
        ("system:kube-scheduler", "kube-scheduler/v1.36.3", api_counts.SCHEDULER),
        ("system:apiserver", "", api_load.OTHER),
    ],
)
def test_each_request_is_put_down_to_its_sender_by_user(user: str, agent: str, group: str) -> None:
    assert api_load.actor_group(api_load.actor(user, agent, admin="admin")) == group


def test_the_first_jobs_run_times_are_spread_over_the_whole_job_length() -> None:
    steps = api_load.initial_steps(600)
    assert min(steps) == 0 and max(steps) == api_load.STEPS
    # evenly: each tenth of the run length holds a tenth of the Jobs, and so does each tenth of
    # the Jobs in creation order (created over a while, they still finish at an even rate)
    first_tenth = Counter(min(9, k * 10 // api_load.STEPS) for k in steps[:60])
    assert all(4 <= t <= 8 for t in first_tenth.values()) and len(first_tenth) == 10, first_tenth
    tenths = Counter(min(9, k * 10 // api_load.STEPS) for k in steps)
    assert sorted(tenths) == list(range(10))
    assert all(50 <= t <= 70 for t in tenths.values()), tenths


@pytest.mark.parametrize(
    ("requests", "finished", "per_job"),
    [
        # steady: 10 creates, 10 finished, 10 patches and 5 LIST pages: all requests / finished
        ({api_load.CREATED: 10, ("PATCH", "jobs", "", 200): 10, ("LIST", "jobs", "", 200): 5}, 10, 2.5),
        # behind on creates (2 of 10): the missing creates are still counted, one per Job
        ({api_load.CREATED: 2, ("PATCH", "jobs", "", 200): 10, ("LIST", "jobs", "", 200): 5}, 10, 2.5),
        # failed requests count too
        ({api_load.CREATED: 4, ("GET", "jobs", "", 200): 30, ("DELETE", "jobs", "", 404): 2}, 4, 9.0),
    ],
)
def test_requests_per_job_counts_one_create_per_job_and_every_other_request(
    requests: dict[api_load.Key, int], finished: int, per_job: float
) -> None:
    window = api_load.Window(
        seconds=10.0, requests=Counter(requests), finished={f"j{i}": 0.0 for i in range(finished)}, in_flight=(1, 1)
    )
    assert window.per_job == pytest.approx(per_job)


def test_task_times_reads_the_workers_latest_start() -> None:
    log = "\n".join([
        "--- start #1: celery worker",
        "[..] Task k8s-dispatch.poll[a] succeeded in 9.0s: {}",
        "--- start #2: celery worker",
        "[..] Task k8s-dispatch.poll[b] succeeded in 0.25s: {'seen': 3}",
        "[..] Task k8s-dispatch.poll[c] succeeded in 0.75s: {'seen': 3}",
        "[..] Task k8s-dispatch.create_job[d] succeeded in 0.1s: 'created'",
    ])  # fmt: skip
    assert api_load.task_times(log) == "create_job 1x p50 0.10s p99 0.10s, poll 2x p50 0.25s p99 0.75s"


def test_task_times_within_a_window_counts_the_tasks_that_ended_in_it() -> None:
    log = "\n".join([
        "--- start #1: celery worker",
        "[2026-12-01 22:00:09,900: INFO/MainProcess] Task k8s-dispatch.poll[a] succeeded in 9.0s: {}",
        "[2026-12-01 22:00:10,100: INFO/MainProcess] Task k8s-dispatch.poll[b] succeeded in 0.25s: {}",
        "[2026-12-01 22:00:39,999: INFO/MainProcess] Task k8s-dispatch.poll[c] succeeded in 0.5s: {}",
        "[2026-12-01 22:00:40,001: INFO/MainProcess] Task k8s-dispatch.poll[d] succeeded in 7.0s: {}",
        "[..] Task k8s-dispatch.poll[e] succeeded in 8.0s: {}",  # no time: in no window
    ])  # fmt: skip
    opened = datetime(2026, 12, 1, 22, 0, 10).timestamp()  # Celery writes local time, as this reads it
    assert api_load.task_times(log, within=(opened, opened + 30)) == "poll 2x p50 0.25s p99 0.50s"
