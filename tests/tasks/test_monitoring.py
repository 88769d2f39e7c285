"""A real worker's monitoring: its Prometheus endpoint on K8S_DISPATCH_METRICS_PORT counts the
state changes, failures by reason, sweeps and polls it made; its log has one state-change line
per change, each carrying dispatch id, case id and tenancy.
"""

from __future__ import annotations

import re
import time
import urllib.request
import uuid

from prometheus_client.parser import text_string_to_metric_families

from k8s_dispatch import celeryconfig as names
from k8s_dispatch.ops import processes

SIM = "localcluster.k8s-dispatch.io/"
CAPABILITIES = {
    "sim.ok": {"worker": "sim", "image": "sim:1", "annotations": {SIM + "duration-ms": "20"}},
    "sim.fail": {"worker": "sim", "image": "sim:1", "annotations": {SIM + "outcome": "fail", SIM + "exit-code": "2"}},
}


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_the_worker_serves_metrics_and_logs_one_line_per_state_change(deploy, sim_cluster) -> None:
    port = processes.free_port()
    d = deploy(sim_cluster, capabilities=CAPABILITIES, metrics_port=str(port))
    started = time.time()
    worker = d.start_worker("w1")
    d.start_beat()
    case_id = d.new_case()
    ok_ids = [str(uuid.uuid4()) for _ in range(3)]
    fail_id = str(uuid.uuid4())
    for dispatch_id, capability in [*((i, "sim.ok") for i in ok_ids), (fail_id, "sim.fail")]:
        d.send(names.SCHEDULE_TASK, case_id, "tenant-a", capability, {}, f"k-{dispatch_id}", dispatch_id=dispatch_id)
    d.wait_terminal([*ok_ids, fail_id])

    def settled() -> dict | None:
        samples = scrape(port)
        polls = samples.get(("k8s_dispatch_poll_last_timestamp_seconds", ()), 0)
        ended = samples.get(("k8s_dispatch_dispatch_state_changes_total", (("state", "COMPLETED"),)), 0)
        return samples if polls > started and ended == len(ok_ids) else None

    samples = d.wait(settled, what="metrics of the finished dispatches")
    changes = "k8s_dispatch_dispatch_state_changes_total"
    assert samples[(changes, (("state", "SCHEDULED"),))] == 4
    assert samples[(changes, (("state", "CREATED"),))] == 4
    assert samples[(changes, (("state", "FAILED"),))] == 1
    assert samples[("k8s_dispatch_dispatch_failures_total", (("reason", "BackoffLimitExceeded"),))] == 1
    assert samples[("k8s_dispatch_recovery_sweeps_total", ())] >= 1  # the start-up sweep at least
    assert ("k8s_dispatch_recovery_findings_total", (("category", "scheduled_without_job"),)) in samples
    assert samples[("k8s_dispatch_poll_lag_seconds", ())] >= 0
    assert samples[("k8s_dispatch_poll_jobs_past_deadline", ())] == 0
    assert ("k8s_dispatch_recovery_last_findings", (("category", "scheduled_without_job"),)) in samples
    # Every terminal event this worker wrote: one latency each (the sweep's too, if it got there first).
    assert samples[("k8s_dispatch_completion_latency_seconds_count", ())] == len(ok_ids) + 1
    # Its Kubernetes requests, by verb and answer: the creates and the poll's LISTs at least.
    requests = "k8s_dispatch_api_requests_total"
    assert samples[(requests, (("code", "201"), ("verb", "create")))] >= 4
    assert samples[(requests, (("code", "200"), ("verb", "list")))] >= 1

    log = worker.log()
    for dispatch_id in [*ok_ids, fail_id]:
        lines = [line for line in log.splitlines() if f"dispatch_id={dispatch_id}" in line and "state-change" in line]
        states = [re.search(r"state=(\w+)", line).group(1) for line in lines]  # type: ignore[union-attr]
        ending = "FAILED" if dispatch_id == fail_id else "COMPLETED"
        assert states == ["SCHEDULED", "CREATED", ending], lines
        assert all(f"case_id={case_id} tenancy_id=tenant-a" in line for line in lines)
    [failed_line] = [line for line in log.splitlines() if f"dispatch_id={fail_id}" in line and "state=FAILED" in line]
    assert "reason=BackoffLimitExceeded" in failed_line and "capability=sim.fail" in failed_line
