"""api_load beside a real node (lab/bench/api_load_kubelet.py), its pure pieces: the split by sender
leaves the bench's raw Jobs' namespace out, and the Jobs it runs on both nodes are the same script.
The run itself needs two control planes and a few minutes (`make bench`): the kubelet's figures are
in the issue, not in the suite."""

from __future__ import annotations

import json
from collections import Counter

from k8s_dispatch.lab.bench import api_counts, api_load_kubelet, services, workload


def _line(at: str, *, user: str, verb: str, resource: str, namespace: str, code: int = 200,
          agent: str = "OpenAPI-Generator/31.0.0/python") -> str:  # fmt: skip
    return json.dumps({
        "stage": "ResponseComplete", "verb": verb, "user": {"username": user}, "userAgent": agent,
        "requestURI": f"/api/v1/namespaces/{namespace}/{resource}",
        "objectRef": {"resource": resource, "namespace": namespace}, "responseStatus": {"code": code},
        "requestReceivedTimestamp": f"2026-01-01T00:00:{at}Z", "stageTimestamp": f"2026-01-01T00:00:{at}Z",
    })  # fmt: skip


def test_the_raw_jobs_namespace_is_left_out_of_the_split_by_sender_and_the_scheduler_is_a_sender() -> None:
    scrape = json.dumps({
        "stage": "ResponseComplete", "verb": "get", "user": {"username": "admin"},
        "userAgent": services.BENCH_USER_AGENT, "requestURI": "/metrics", "responseStatus": {"code": 200},
    })  # fmt: skip
    raw = api_load_kubelet.RAW_NAMESPACE
    lines = [
        json.dumps({**json.loads(scrape), "requestReceivedTimestamp": "2026-01-01T00:00:01Z",
                    "stageTimestamp": "2026-01-01T00:00:01Z"}),
        _line("02.0", user="system:kube-scheduler", verb="create", resource="pods", namespace="bench-load", code=201),
        _line("02.1", user="system:kube-scheduler", verb="create", resource="pods", namespace=raw, code=201),
        _line("02.2", user="system:node:n", verb="patch", resource="pods", namespace=raw),
        _line("02.3", user="admin", verb="create", resource="jobs", namespace=raw, code=201,
              agent=f"{services.BENCH_USER_AGENT}-raw"),
        _line("02.4", user="system:node:n", verb="patch", resource="pods", namespace="bench-load"),
        json.dumps({**json.loads(scrape), "requestReceivedTimestamp": "2026-01-01T00:00:03Z",
                    "stageTimestamp": "2026-01-01T00:00:03Z"}),
    ]  # fmt: skip
    split = api_counts.audited(lines, admin="admin", leave_out=frozenset({raw}))
    assert split == {
        api_counts.SCHEDULER: Counter({("POST", "pods", "", 201): 1}),
        api_counts.NODE: Counter({("PATCH", "pods", "", 200): 1}),
        api_counts.BENCH: Counter({("GET", "", "/metrics", 200): 1}),
    }
    assert api_counts.actor_group(api_counts.SCHEDULER) == api_counts.SCHEDULER


def test_the_load_runs_the_same_script_on_both_nodes_and_the_raw_job_is_that_container() -> None:
    caps = api_load_kubelet.capability_config(60.0)["capabilities"]
    assert len(caps) == 61
    last = caps["load.k60"]
    assert (last["worker"], last["image"]) == (workload.WORKER, "busybox:1.36")
    # the agent's exec mode runs it as a host process: the result goes where TERMINATION_MESSAGE_PATH says
    assert last["args"] == [
        """sleep 60.000; printf '{"k": 60}' > "${TERMINATION_MESSAGE_PATH:-/dev/termination-log}\""""
    ]
    assert "cpu" not in last["resources"]["requests"]  # 300 fit on a 2-core node
    job = api_load_kubelet.raw_job("raw-1", "busybox:1.36")
    [container] = job["spec"]["template"]["spec"]["containers"]
    assert (container["image"], container["command"]) == ("busybox:1.36", ["sh", "-c"])
    assert "TERMINATION_MESSAGE_PATH" in container["args"][0] and job["spec"]["ttlSecondsAfterFinished"] == 5


def test_a_pod_counts_as_started_once_its_container_runs_or_has_ended() -> None:
    def pod(state: dict[str, object]) -> dict[str, object]:
        return {"status": {"containerStatuses": [{"state": state}]}}

    assert not api_load_kubelet._container_started({"status": {}})
    assert not api_load_kubelet._container_started(pod({"waiting": {"reason": "ContainerCreating"}}))
    assert api_load_kubelet._container_started(pod({"running": {"startedAt": "x"}}))
    assert api_load_kubelet._container_started(pod({"terminated": {"exitCode": 0}}))
