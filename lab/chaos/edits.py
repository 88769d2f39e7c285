"""The chaos run's hands on the system from outside it: cancels whose follow-up message is lost,
and hand edits of running Jobs (what an operator with kubectl, or a careless controller, does).

Each edit is one of `EDITS`: the tenancy label overwritten (the Job then finishes with labels that
disagree with the database), `k8s-dispatch.io/delivered=true` added (it leaves every selector of
undelivered Jobs while our finalizer keeps it), the attempt annotation made unreadable. A lost
cancel is the engine's `cancel_in_session`, committed, with the broker losing its `cancel` message.
Whatever becomes of these dispatches, each must end in exactly one terminal event (any reason) and
leave no Job: `chosen` says which, for the checks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from k8s_dispatch.workers.labels import (
    ATTEMPT_KEY,
    CAPABILITY_KEY,
    DELIVERED,
    DELIVERED_LABEL,
    DISPATCH_ID_KEY,
    TENANCY_ID_KEY,
    is_delivered,
)

EDITED_TENANCY = "tenant-edited"  # in no limit: the observer's peaks of real tenancies stay honest
MALFORMED_ATTEMPT = "one"
# (what, the merge patch's metadata)
EDITS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("tenancy label overwritten", {"labels": {TENANCY_ID_KEY: EDITED_TENANCY}}),
    (f"{DELIVERED_LABEL}={DELIVERED} added", {"labels": {DELIVERED_LABEL: DELIVERED}}),
    ("attempt annotation malformed", {"annotations": {ATTEMPT_KEY: MALFORMED_ATTEMPT}}),
)


@dataclass(frozen=True)
class Target:
    namespace: str
    name: str
    dispatch_id: str


def running_targets(jobs: Iterable[Mapping[str, Any]], *, capability: str, skip: set[str]) -> list[Target]:
    """Jobs of `capability` (API dicts) still running, not delivered and not of a dispatch in `skip`,
    oldest name first (pure): the edits' candidates, long enough to finish after the edit."""
    found = []
    for job in jobs:
        metadata = job.get("metadata") or {}
        labels = metadata.get("labels") or {}
        status = job.get("status") or {}
        dispatch_id = labels.get(DISPATCH_ID_KEY)
        if (
            labels.get(CAPABILITY_KEY) != capability
            or not dispatch_id
            or dispatch_id in skip
            or is_delivered(labels)
            or metadata.get("deletionTimestamp")
            or any(c.get("type") in ("Complete", "Failed") for c in status.get("conditions") or [])
        ):
            continue
        found.append(Target(metadata["namespace"], metadata["name"], dispatch_id))
    return sorted(found, key=lambda t: (t.namespace, t.name))


def edit_jobs(
    api: Any, targets: Sequence[Target], *, edits: Sequence[tuple[str, dict[str, Any]]] = EDITS
) -> list[tuple[Target, str]]:
    """Apply `edits` in turn to `targets` (a kubernetes ApiClient), one each; each (target, edit)
    done. A Job gone meanwhile (404: delivered and deleted) is skipped."""
    from kubernetes import client

    batch = client.BatchV1Api(api)
    done = []
    for target, (what, metadata) in zip(targets, edits, strict=False):
        try:
            batch.patch_namespaced_job(target.name, target.namespace, {"metadata": metadata}, _request_timeout=10)
        except client.ApiException as e:
            if e.status == 404:
                continue
            raise
        done.append((target, what))
    return done


class LostMessages:
    """A broker that accepts every message and delivers none (the `via` of the engine's calls)."""

    def send_task(self, *args: Any, **kwargs: Any) -> None:
        return None


def cancel_losing_follow_up(sessions: Any, dispatch_ids: Sequence[str]) -> list[str]:
    """`cancel_in_session` for each of `dispatch_ids`, committed, its `cancel` message lost; the
    ids this call ended (the others had ended already)."""
    from typing import cast

    from celery import Celery

    from k8s_dispatch.store.db import transaction
    from k8s_dispatch.tasks.scheduling import cancel_in_session

    ended = []
    for dispatch_id in dispatch_ids:
        with transaction(sessions) as session:
            if cancel_in_session(session, dispatch_id, via=cast(Celery, LostMessages())):
                ended.append(dispatch_id)
    return ended


def running_dispatches(sessions: Any, ids: Sequence[str], *, capability: str, limit: int) -> list[str]:
    """Up to `limit` of `ids` of `capability` whose Job is made and not ended (state CREATED)."""
    import sqlalchemy as sa

    from k8s_dispatch.store.db import transaction
    from k8s_dispatch.store.models import Dispatch, DispatchState

    with transaction(sessions) as session:
        return list(
            session.scalars(
                sa.select(Dispatch.dispatch_id)
                .where(
                    Dispatch.dispatch_id.in_(list(ids)),
                    Dispatch.capability == capability,
                    Dispatch.state == DispatchState.CREATED,
                )
                .order_by(Dispatch.dispatch_id)
                .limit(limit)
            )
        )
