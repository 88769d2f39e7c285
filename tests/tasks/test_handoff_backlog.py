"""Under a backlog of completions, poll hands each finished Job off once, however long its
message waits; a message lost from the queue is still handed off again. Real `celery -A k8s_dispatch.tasks`
worker and beat, Redis, PostgreSQL and localcluster; the complete queue is left unconsumed
(the worker listens on the other queues only) for longer than the hand-off TTL.

Before, each marker expired after the TTL while its message still waited, and poll queued the
same Job again: every TTL of backlog added a copy of every waiting Job, so the work per Job
grew with the backlog.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections import Counter

from k8s_dispatch import celeryconfig as names
from k8s_dispatch.delivery import handoff
from k8s_dispatch.ops import processes
from k8s_dispatch.store.db import transaction
from k8s_dispatch.tasks.scheduling import schedule_in_session
from k8s_dispatch.workers.manifest import job_name
from k8s_dispatch.workers.resolver import CapabilityResolver
from tests.tasks.conftest import Proc

COUNT = 10


def queued_handoffs(d) -> Counter[str]:
    """Job name -> how many `complete_batch` messages waiting in the complete queue carry it."""
    counts: Counter[str] = Counter()
    for message in d.redis.lrange(f"{d.prefix}:{names.COMPLETE_QUEUE}", 0, -1):
        envelope = json.loads(message)
        assert envelope["headers"]["task"] == names.COMPLETE_BATCH_TASK
        (_namespace, jobs), _kwargs, _embed = json.loads(base64.b64decode(envelope["body"]))
        counts.update(job["metadata"]["name"] for job in jobs)
    return counts


def test_a_job_waiting_in_a_backlog_is_handed_off_once_and_a_lost_message_again(deploy, sim_cluster):
    d = deploy(sim_cluster, sweep_interval_s="600")  # no sweep in the window: poll's work alone
    queues = f"{names.JOBS_QUEUE},{names.SWEEP_QUEUE}"  # not the complete queue: a backlog
    busy = Proc(processes.celery_worker("w-busy", env=d.env, log_dir=d.tmp, concurrency=4, extra=("-Q", queues)))
    d.procs.append(busy)
    busy.wait_for_log(" ready.")
    d.start_beat()
    case_id = d.new_case()
    resolver = CapabilityResolver.from_settings(d.settings)
    with transaction(d.sessions) as session:
        ids = [
            schedule_in_session(
                session, via=d.producer, case_id=case_id, tenancy_id="tenant-a", capability="demo.wordcount",
                input={"text": f"w {i}"}, idempotency_key=f"key-{uuid.uuid4()}", router=resolver,
                max_input_bytes=d.settings.max_input_bytes,
            ).dispatch_id
            for i in range(COUNT)
        ]  # fmt: skip
    names_ = {job_name(i) for i in ids}
    d.wait(lambda: set(queued_handoffs(d)) == names_, what="every finished Job handed off", timeout_s=60)

    ttl_s = handoff.ttl_s(d.settings.poll_interval_s)
    deadline = time.monotonic() + ttl_s * 1.5 + 2  # polls every 0.2 s all through it
    while time.monotonic() < deadline:
        counts = queued_handoffs(d)
        assert set(counts) == names_ and max(counts.values()) == 1, f"handed off again while queued: {counts}"
        time.sleep(0.5)

    # The queued messages are lost (a broker flush): the markers expire and poll hands off again.
    d.redis.delete(f"{d.prefix}:{names.COMPLETE_QUEUE}")
    d.wait(lambda: set(queued_handoffs(d)) == names_, what="the lost hand-offs sent again", timeout_s=ttl_s + 20)
    d.start_worker("w-complete")
    events = d.wait_terminal(ids, timeout_s=60)
    assert all(len(e) == 1 and e[0][0] == "WORKER_COMPLETED" for e in events.values())
