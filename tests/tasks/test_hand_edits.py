"""Hand edits under the watch poll (a real worker and beat, the namespace's next LIST an hour
away): a running Job whose tenancy label is overwritten is refused when it finishes, and its
dispatch fails `JobTampered` once the tampered grace is over (both clusters); a running Job
labelled `delivered=true` by hand, out of every selector of ours, is found by name from the
database and its dispatch ends once (the real control plane: its watch says which Job left the
selector with the version before the change; localcluster's says it with the new one, labelled
delivered, so there only the LIST finds it). Within seconds, each with exactly one terminal
event, no Job made twice, nothing left behind."""

from __future__ import annotations

from typing import Any

import kubernetes

from k8s_dispatch.delivery import jobwatch
from k8s_dispatch.recovery.plan import JOB_TAMPERED_REASON
from k8s_dispatch.store.models import EventType
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.manifest import job_name

SIM = "localcluster.k8s-dispatch.io/"
CAPABILITIES = {"sim.slow": {"worker": "sim", "image": "sim:1", "annotations": {SIM + "duration-ms": "4000"}}}


def hand_label(cluster, namespace: str, name: str, labels: dict[str, str]) -> None:
    """An operator's `kubectl label --overwrite job NAME k=v`."""
    api = kubernetes.config.new_client_from_config(config_file=str(cluster.kubeconfig))
    try:
        kubernetes.client.BatchV1Api(api).patch_namespaced_job(name, namespace, {"metadata": {"labels": labels}})
    finally:
        api.close()


def started(deploy, cluster, count: int, **settings: str) -> tuple[Any, list[str], dict[str, str]]:
    """A deployment whose watch is healthy and whose namespace was LISTed (the next LIST an hour
    away), with `count` long dispatches running; (deployment, their ids, Job name -> uid)."""
    d = deploy(
        cluster, capabilities=CAPABILITIES, poll_interval_s="0.5", sweep_interval_s="1", sweep_grace_s="1",
        sweep_list_interval_s="3600", tampered_grace_s="2", **settings,
    )  # fmt: skip
    namespace, deployment = d.settings.namespace, d.settings.effective_deployment
    d.start_worker("w1")
    d.start_beat()
    key = jobwatch.key(d.prefix, deployment, namespace)
    d.wait(lambda: jobwatch.is_healthy(d.redis, d.prefix, deployment, namespace), what="the watch healthy")
    d.wait(lambda: d.redis.exists(jobwatch.listed_key(key)), what="a LIST noted")
    ids = d.schedule_batch("sim.slow", count)
    d.wait(lambda: len(d.jobs()) == count, what="the jobs running")
    return d, ids, {j["metadata"]["name"]: j["metadata"]["uid"] for j in d.jobs()}


def test_a_running_job_whose_tenancy_is_overwritten_fails_job_tampered(deploy, any_cluster) -> None:
    d, (dispatch_id,), uids = started(deploy, any_cluster, 1)
    hand_label(any_cluster, d.settings.namespace, job_name(dispatch_id), {job_labels.TENANCY_ID_KEY: "tenant-evil"})
    events = d.wait_terminal([dispatch_id], timeout_s=40)
    ((kind, payload),) = events[dispatch_id]
    assert kind == EventType.WORKER_FAILED.value and payload["reason"] == JOB_TAMPERED_REASON, payload
    assert payload["detail"]["refusal"] == "TenancyMismatch"
    d.wait_no_jobs(timeout_s=30)
    assert list(uids) == [job_name(dispatch_id)]  # one Job, ever
    assert d.terminal_events([dispatch_id]) == events  # and still one end


def test_delivered_true_put_on_a_running_job_by_hand_still_ends_its_dispatch_once(deploy, real_cluster) -> None:
    d, (dispatch_id,), uids = started(deploy, real_cluster, 1)
    hand_label(real_cluster, d.settings.namespace, job_name(dispatch_id), {job_labels.DELIVERED_LABEL: "true"})
    events = d.wait_terminal([dispatch_id], timeout_s=40)
    ((kind, payload),) = events[dispatch_id]
    # Delivered from its Job: its result, or JobDeleted if a bulk delete of delivered Jobs (which
    # its label asks for) came first.
    assert (kind, payload.get("output")) == (
        EventType.WORKER_COMPLETED.value, {"simulated": True, "input": {"i": 0}}
    ) or payload.get("reason") == "JobDeleted", (kind, payload)  # fmt: skip
    d.wait_no_jobs(timeout_s=30)
    assert list(uids) == [job_name(dispatch_id)]
    assert d.terminal_events([dispatch_id]) == events


def test_with_the_delete_policy_a_hand_edited_job_is_removed_and_its_dispatch_runs_again_at_once(
    deploy, any_cluster
) -> None:
    """ORPHAN_POLICY=delete: the sweep removes the refused Job and the dispatch gets a Job of its
    own within seconds, though the namespace's next LIST is an hour away, and ends once."""
    d, (dispatch_id,), _ = started(deploy, any_cluster, 1, orphan_policy="delete")
    name = job_name(dispatch_id)
    hand_label(any_cluster, d.settings.namespace, name, {job_labels.TENANCY_ID_KEY: "tenant-evil"})
    events = d.wait_terminal([dispatch_id], timeout_s=40)
    ((kind, payload),) = events[dispatch_id]
    assert (kind, payload.get("output")) == (EventType.WORKER_COMPLETED.value, {"simulated": True, "input": {"i": 0}})
    d.wait_no_jobs(timeout_s=30)
    assert d.terminal_events([dispatch_id]) == events
