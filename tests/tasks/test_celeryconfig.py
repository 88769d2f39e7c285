"""The Celery settings: what makes delivery safe is really set, and every broker key is prefixed."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import redis
from celery import Celery
from celery.beat import PersistentScheduler, Scheduler
from kombu.utils.imports import symbol_by_name

from k8s_dispatch import celeryconfig
from k8s_dispatch.core.settings import load_settings
from k8s_dispatch.tasks import app


def settings_for(prefix: str, **values: str):
    return load_settings(
        {"K8S_DISPATCH_KEY_PREFIX": prefix, **{f"K8S_DISPATCH_{k.upper()}": v for k, v in values.items()}}
    )


def test_the_config_carries_the_safety_settings_from_the_environment():
    settings = settings_for(
        "cfg-test", broker_visibility_timeout_s="120", worker_concurrency="3", poll_interval_s="0.5",
        broker_url="redis://127.0.0.1:6379/3",
    )  # fmt: skip
    conf = celeryconfig.config(settings)
    assert conf["broker_url"] == "redis://127.0.0.1:6379/3"
    assert conf["task_acks_late"] is True
    assert conf["task_reject_on_worker_lost"] is True
    assert conf["worker_prefetch_multiplier"] == 1
    assert conf["broker_transport_options"] == {"visibility_timeout": 120, "global_keyprefix": "cfg-test:"}
    assert (conf["worker_pool"], conf["worker_concurrency"]) == ("threads", 3)
    assert conf["task_ignore_result"] is True
    assert conf["worker_send_task_events"] is True and conf["task_send_sent_event"] is True
    assert [q.name for q in conf["task_queues"]] == [
        celeryconfig.JOBS_QUEUE,
        celeryconfig.COMPLETE_QUEUE,
        celeryconfig.SWEEP_QUEUE,
    ]
    assert conf["task_default_queue"] == celeryconfig.JOBS_QUEUE
    assert conf["task_routes"][celeryconfig.COMPLETE_TASK] == {"queue": celeryconfig.COMPLETE_QUEUE}
    assert conf["task_routes"][celeryconfig.COMPLETE_BATCH_TASK] == {"queue": celeryconfig.COMPLETE_QUEUE}
    assert conf["task_routes"][celeryconfig.POLL_TASK] == {"queue": celeryconfig.SWEEP_QUEUE}
    poll = conf["beat_schedule"]["poll"]
    assert (poll["task"], poll["schedule"]) == (celeryconfig.POLL_TASK, timedelta(seconds=0.5))
    # Celery's in-memory scheduler (intervals only: no schedule file), plus beat's heartbeat.
    scheduler = symbol_by_name(conf["beat_scheduler"])
    assert scheduler.__mro__[1] is Scheduler and not issubclass(scheduler, PersistentScheduler)


def test_the_package_app_is_configured_from_celeryconfig():
    assert app.main == "k8s-dispatch"
    assert app.conf.task_acks_late is True
    assert app.conf.worker_pool == "threads"
    assert set(app.conf.task_routes) >= {
        celeryconfig.CREATE_JOB_TASK,
        celeryconfig.COMPLETE_TASK,
        celeryconfig.POLL_TASK,
    }


def test_every_broker_key_lives_under_the_prefix(redis_url, key_prefix):
    prefix = f"{key_prefix}-cfg-{uuid.uuid4().hex[:6]}"
    producer = Celery("cfg-producer", set_as_current=False)
    producer.conf.update(celeryconfig.config(settings_for(prefix, redis_url=redis_url)))
    client = redis.Redis.from_url(redis_url)
    try:
        producer.send_task(celeryconfig.CREATE_JOB_TASK, args=["some-id"])  # routed by the config
        producer.send_task(celeryconfig.COMPLETE_TASK, args=["ns", "job"])
        keys = {k.decode() for k in client.scan_iter(match=f"{prefix}:*")}
        assert f"{prefix}:{celeryconfig.JOBS_QUEUE}" in keys
        assert f"{prefix}:{celeryconfig.COMPLETE_QUEUE}" in keys
        [raw] = client.lrange(f"{prefix}:{celeryconfig.JOBS_QUEUE}", 0, -1)
        assert json.loads(raw)["headers"]["task"] == celeryconfig.CREATE_JOB_TASK
        # Nothing of ours outside the prefix.
        assert not client.exists(celeryconfig.JOBS_QUEUE, celeryconfig.COMPLETE_QUEUE)
    finally:
        producer.close()
        client.close()
