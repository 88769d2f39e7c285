"""What Flower is shown of our tasks (`tasks.task_events`), as Celery builds the messages:
housekeeping sends no event, a batch's arguments name its dispatches, a failed dispatch's echo
fails. Flower itself, reading a real worker's events, is tests/tasks/test_flower*.py."""

from __future__ import annotations

import pytest

from k8s_dispatch import celeryconfig as names
from k8s_dispatch.tasks import artifacts_tasks, jobs, recovery_tasks  # noqa: F401 (registers the tasks)
from k8s_dispatch.tasks.app import app
from k8s_dispatch.tasks.task_events import SHOWN_IDS, DispatchFailed, shown_args
from k8s_dispatch.workers import labels as job_labels


def snapshot(dispatch_id: str) -> dict[str, object]:
    return {"metadata": {"name": f"j-{dispatch_id}", "labels": {job_labels.DISPATCH_ID_KEY: dispatch_id}}, "status": {}}


def message(name: str, args: list[object]):
    return app.amqp.create_task_message("task-1", name, args, {}, create_sent_event=True)


def test_a_complete_batch_shows_its_namespace_and_dispatch_ids_where_celery_shows_dicts() -> None:
    msg = message(names.COMPLETE_BATCH_TASK, ["ns-a", [snapshot("d-1"), snapshot("d-2"), {"metadata": {}}]])
    assert msg.headers["argsrepr"] == "('ns-a', [d-1, d-2, ?])"
    assert msg.sent_event["args"] == msg.headers["argsrepr"]  # what Flower reads and searches


def test_a_long_dispatch_id_is_shown_whole_from_its_annotation_not_as_its_labels_hash() -> None:
    long_id = "d-" + "x" * 70  # over a label's 63 characters: the label holds its hash
    job = {"metadata": {"labels": {job_labels.DISPATCH_ID_KEY: job_labels.value_hash(long_id)},
                        "annotations": {job_labels.DISPATCH_ID_KEY: long_id}}}  # fmt: skip
    assert job_labels.needs_hash(long_id)
    assert shown_args(names.COMPLETE_BATCH_TASK, ["ns-a", [job]]) == f"('ns-a', [{long_id}])"


def test_a_long_batch_shows_its_first_ids_and_how_many_more() -> None:
    ids = [f"d-{i}" for i in range(SHOWN_IDS + 5)]
    shown = shown_args(names.CREATE_JOBS_TASK, [ids])
    assert shown is not None and f"d-{SHOWN_IDS - 1}," in shown and f"d-{SHOWN_IDS}," not in shown
    assert shown.endswith(", ... 5 more],)")


@pytest.mark.parametrize("args", [["one-id"], ["ns", "not a list"], []])
def test_other_arguments_keep_celerys_repr(args: list[object]) -> None:
    assert shown_args(names.COMPLETE_BATCH_TASK, args) is None
    assert shown_args(names.CREATE_JOB_TASK, ["d-1"]) is None
    assert message(names.CREATE_JOB_TASK, ["d-1"]).headers["argsrepr"] == "['d-1']"


def test_housekeeping_sends_no_event_and_the_work_does() -> None:
    for name in names.HOUSEKEEPING_TASKS:
        assert message(name, []).sent_event is None, name
        assert app.tasks[name].send_events is False, name
    ours = {name for name in app.tasks if name.startswith("k8s-dispatch.")}
    assert ours > names.HOUSEKEEPING_TASKS
    for name in ours - names.HOUSEKEEPING_TASKS:
        assert message(name, []).sent_event is not None, name
        assert app.tasks[name].send_events is True, name


def test_a_failed_dispatchs_echo_fails_naming_it_and_is_not_retried() -> None:
    task = app.tasks[names.DISPATCH_FAILED_TASK]
    with pytest.raises(DispatchFailed, match=r"^dispatch d-1 failed: ContainerFailed: exit 3$"):
        task.run("d-1", "ContainerFailed", "exit 3")
    with pytest.raises(DispatchFailed, match=r"^dispatch d-1 failed: JobLost$"):
        task.run("d-1", "JobLost")
    assert DispatchFailed in task.throws and not getattr(task, "autoretry_for", ())
    assert app.amqp.router.route({}, names.DISPATCH_FAILED_TASK)["queue"].name == names.COMPLETE_QUEUE
