"""Poll by watch end to end (real worker and beat, both clusters): every dispatch ends once while
the polls read watch events, not LISTs of every Job, and a Job that ends is delivered by a prompt
poll without waiting for beat's; a Job that leaves undelivered is found by beat's sweep through
the watch's note, without a LIST of the namespace's Jobs."""

from __future__ import annotations

import base64
import json
import re
import time
from collections import Counter

from prometheus_client.parser import text_string_to_metric_families

from k8s_dispatch.celeryconfig import COMPLETE_QUEUE, JOBS_QUEUE, POLL_TASK, SWEEP_QUEUE
from k8s_dispatch.core.errors import NotFound
from k8s_dispatch.delivery import jobwatch
from k8s_dispatch.store.models import EventType
from k8s_dispatch.tasks import supersede
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.manifest import FINALIZER, job_name

SIM = "localcluster.k8s-dispatch.io/"
CAPABILITIES = {
    "sim.ok": {"worker": "sim", "image": "sim:1", "annotations": {SIM + "duration-ms": "1500"}},
    "sim.long": {"worker": "sim", "image": "sim:1", "annotations": {SIM + "duration-ms": "600000"}},
}


def job_requests(cluster) -> Counter[str]:
    """The server's own count of requests on jobs (every sender's), by verb."""
    if hasattr(cluster, "raw"):
        _, _, body = cluster.raw("GET", "/metrics")
    else:
        import urllib.request

        with urllib.request.urlopen(f"{cluster.url}/metrics") as r:
            body = r.read()
    out: Counter[str] = Counter()
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            labels = s.labels
            if s.name == "apiserver_request_total" and labels.get("resource") == "jobs" and not labels["subresource"]:
                out[labels["verb"]] += int(s.value)
    return out


POLL_DONE = re.compile(r"Task k8s-dispatch\.poll\[[^\]]*\] succeeded")


def test_dispatches_complete_once_each_while_polls_read_the_watch(deploy, any_cluster):
    d = deploy(any_cluster, capabilities=CAPABILITIES, poll_interval_s="0.5", sweep_interval_s="2")
    worker = d.start_worker("w1")
    d.start_beat()
    before, polls_before = job_requests(any_cluster), len(POLL_DONE.findall(worker.log()))
    ids = d.schedule_batch("sim.ok", 30)
    events = d.wait_terminal(ids, timeout_s=90)
    assert all(kinds == [(EventType.WORKER_COMPLETED.value, kinds[0][1])] for kinds in events.values())
    counted: list[tuple[int, Counter[str]]] = []

    def polls_went_on() -> bool:
        after = job_requests(any_cluster)
        after.subtract(before)
        counted.append((len(POLL_DONE.findall(worker.log())) - polls_before, after))
        return counted[-1][0] >= 16

    d.wait(polls_went_on, timeout_s=30, what="16 polls")
    position = jobwatch.load(d.redis, jobwatch.key(d.prefix, d.settings.effective_deployment, d.settings.namespace))
    assert position.version and not position.finished  # the position stands, every Job delivered
    polls, requests = counted[-1]
    # A LIST poll makes a LIST per poll; by watch, only the start-up sweep, the first poll, and
    # beat's first sweep (its LIST due) list Jobs.
    assert requests["LIST"] <= 8, requests
    # One worker's polls follow each other: they read the stream kept open, not a WATCH each.
    assert 1 <= requests["WATCH"] <= polls // 2, (polls, requests)
    d.wait_no_jobs()


def test_a_finished_job_is_delivered_by_a_prompt_poll_with_no_poll_of_beats_to_come(deploy, any_cluster):
    """Prompt polls (`tasks.prompt_poll`). No beat: the test sends the three polls after which the
    worker's watch stream is kept (the second watch follows the first), as beat would, then
    schedules Jobs. Nothing polls after that, so only the kept stream's doorbell can deliver them:
    each is recorded once, within seconds though beat's interval is 30 s, and the prompt polls read
    the stream already open (no WATCH each)."""
    d = deploy(any_cluster, capabilities=CAPABILITIES, poll_interval_s="30", sweep_interval_s="3600")
    worker = d.start_worker("w1")
    for n in range(1, 4):
        d.redis.delete(supersede.key(d.prefix, POLL_TASK))  # the test's polls stand in for beat's, one per interval
        d.send(POLL_TASK)
        d.wait(lambda n=n: len(POLL_DONE.findall(worker.log())) >= n, timeout_s=30, what=f"poll {n}")
    before = job_requests(any_cluster)
    ids = []
    for _ in range(3):  # one after the other: each a ring of its own
        ids += d.schedule_batch("sim.ok", 1)
        events = d.wait_terminal(ids[-1:], timeout_s=15)  # its Job runs 1.5 s
        assert [kind for kind, _ in events[ids[-1]]] == [EventType.WORKER_COMPLETED.value]
    after = job_requests(any_cluster)
    after.subtract(before)
    assert len(POLL_DONE.findall(worker.log())) == 3  # no poll but the doorbell's
    # Read from the kept stream. A server counts a watch when it ends: the second test poll's,
    # closed after its slice, may be counted after `before`.
    assert after["WATCH"] <= 1, after
    released = [job for job in d.jobs() if job_labels.is_delivered(job["metadata"].get("labels"))]
    assert len(released) == 3  # each released (beat's cleanup, not running here, would delete them)


def queued_completions(d) -> Counter[str]:
    """How many times each Job is in the completions' queue (its messages kept)."""
    names: Counter[str] = Counter()
    for message in d.redis.lrange(f"{d.prefix}:{COMPLETE_QUEUE}", 0, -1):
        args, _kwargs, _embed = json.loads(base64.b64decode(json.loads(message)["body"]))
        names.update(job["metadata"]["name"] for job in args[1])
    return names


def test_prompt_polls_renew_the_markers_of_completions_still_queued(deploy, sim_cluster):
    """A backlog of completions (no worker reads their queue here) while prompt polls run and
    beat's do not: each prompt poll renews the markers of the Jobs it handed off before, so none
    is sent a second time once its marker's TTL is over."""
    d = deploy(sim_cluster, capabilities=CAPABILITIES, poll_interval_s="30", sweep_interval_s="3600")
    worker = d.start_worker("w1", queues=f"{JOBS_QUEUE},{SWEEP_QUEUE}")
    for n in range(1, 4):  # the polls after which the worker's watch stream is kept, as in the test above
        d.redis.delete(supersede.key(d.prefix, POLL_TASK))
        d.send(POLL_TASK)
        d.wait(lambda n=n: len(POLL_DONE.findall(worker.log())) >= n, timeout_s=30, what=f"poll {n}")
    first = job_name(d.schedule_batch("sim.ok", 1)[0])
    d.wait(lambda: queued_completions(d)[first] == 1, timeout_s=15, what="the first Job handed off by a prompt poll")
    marker = next(iter(d.redis.keys(f"{d.prefix}:handoff:*/{first}/*")))
    left_ms, read_at = d.redis.pttl(marker), time.monotonic()
    second = job_name(d.schedule_batch("sim.ok", 1)[0])  # its Job runs 1.5 s: the first marker ages
    d.wait(lambda: queued_completions(d)[second] == 1, timeout_s=15, what="the second Job handed off")
    aged_ms = (time.monotonic() - read_at) * 1000
    assert aged_ms > 1000
    # Renewed by the second Job's prompt poll, which found a backlog: younger than it would be.
    assert d.redis.pttl(marker) > left_ms - aged_ms + 500
    assert queued_completions(d) == Counter({first: 1, second: 1})


def test_a_job_gone_undelivered_is_recreated_by_the_sweep_from_the_watchs_note(deploy, any_cluster):
    d = deploy(
        any_cluster, capabilities=CAPABILITIES, poll_interval_s="0.5", sweep_interval_s="1", sweep_grace_s="1",
        sweep_list_interval_s="3600",
    )  # fmt: skip
    d.start_worker("w1")
    d.start_beat()
    [dispatch_id] = d.schedule_batch("sim.long", 1)
    namespace, name = d.settings.namespace, job_name(dispatch_id)
    first = d.wait(lambda: next(iter(d.jobs(namespace)), None), what="the job created")
    uid = first["metadata"]["uid"]
    key = jobwatch.key(d.prefix, d.settings.effective_deployment, namespace)
    d.wait(lambda: jobwatch.is_healthy(d.redis, d.prefix, d.settings.effective_deployment, namespace),
           what="the watch healthy")  # fmt: skip
    # Someone strips our finalizer and deletes the running Job: it is gone without a result.
    d.kube.release_job(namespace, name, finalizer=FINALIZER)
    d.kube.delete_job(namespace, name)
    before = job_requests(any_cluster)

    def recreated() -> dict | None:
        try:
            job = d.kube.get_job(namespace, name)  # a GET: the LISTs below are the system's own
        except NotFound:
            return None
        return job if job["metadata"]["uid"] != uid else None

    job = d.wait(recreated, timeout_s=30, what="the lost job created again")
    after = job_requests(any_cluster)
    after.subtract(before)
    labels = job["metadata"]["labels"]
    assert labels[job_labels.DISPATCH_ID_KEY] == dispatch_id
    # The sweep forgets the note once it has acted on it, just after the Job is created again.
    d.wait(lambda: not jobwatch.gone(d.redis, key), timeout_s=10, what="the note checked and forgotten")
    # Found without listing the namespace's Jobs: the sweep looked the one dispatch up by label.
    assert after["LIST"] <= 3, after


def test_a_position_ahead_of_a_restored_cluster_is_dropped_by_the_sweeps_list(deploy, real_cluster):
    """The cluster's store restored from a backup (or replaced) under the same Redis: poll's position
    stands at a version the cluster has not reached, and kube-apiserver holds a watch from it open
    without a single event, so the watch looks healthy and sees nothing. The worker's start-up
    sweep LISTs, finds the position ahead of its LIST and drops it; the next poll LISTs and
    resumes, and a dispatch ends within seconds though beat's LISTs are an hour apart."""
    d = deploy(
        real_cluster, capabilities=CAPABILITIES, poll_interval_s="0.5", sweep_interval_s="1",
        sweep_list_interval_s="3600",
    )  # fmt: skip
    key = jobwatch.key(d.prefix, d.settings.effective_deployment, d.settings.namespace)
    future = "999999999"  # far ahead of any version this cluster has given
    d.redis.hset(key, "rv", future)
    d.start_worker("w1")
    d.start_beat()
    [dispatch_id] = d.schedule_batch("sim.ok", 1)
    events = d.wait_terminal([dispatch_id], timeout_s=30)
    assert [kind for kind, _ in events[dispatch_id]] == [EventType.WORKER_COMPLETED.value]
    version = jobwatch.stored_version(d.redis, key)
    assert version is not None and int(version) < int(future)
    d.wait_no_jobs()
