"""What the benchmarks create: the bench capabilities (simulated Jobs of 0-50 ms), their Job
manifests as the project builds them, and backlogs of dispatches in the database.

Every Job here is `workers.manifest.build_job`'s output, so the API server stores and lists the
same labels, annotations and env a real deployment's Jobs carry.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy.orm import Session, sessionmaker

from k8s_dispatch.ops.processes import wait_until
from k8s_dispatch.store import dispatches, scheduling
from k8s_dispatch.store.db import transaction
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.job_status import job_state
from k8s_dispatch.workers.kube import KubeClient
from k8s_dispatch.workers.manifest import build_job
from k8s_dispatch.workers.resolver import CapabilityResolver
from k8s_dispatch.workers.types import (
    CapabilityName,
    CaseId,
    DispatchId,
    DispatchRef,
    IdempotencyKey,
    TenancyId,
    WorkerName,
)

SIM = "localcluster.k8s-dispatch.io/"
WORKER = "bench"
TENANCY = "bench-tenant"
DEPLOYMENT = "bench"  # the deployment label of Jobs no deployment delivers (raw creates and lists)
DURATIONS_MS = (0, 10, 20, 30, 40, 50)  # one capability each: dispatch i runs DURATIONS_MS[i % 6]
INSTANT = "bench.d0"
MAX_INPUT_BYTES = 32 * 1024  # the settings' default


def capability(duration_ms: int) -> str:
    return f"bench.d{duration_ms}"


def capability_config() -> dict[str, Any]:
    """The bench capabilities: simulated Jobs that succeed after their duration."""
    return {
        "capabilities": {
            capability(ms): {
                "worker": WORKER,
                "image": "k8s-dispatch-bench:simulated",
                "annotations": {f"{SIM}duration-ms": str(ms)},
                "activeDeadlineSeconds": 300,
                "backoffLimit": 0,
            }
            for ms in DURATIONS_MS
        }
    }


def write_capabilities(path: Path) -> Path:
    path.write_text(yaml.safe_dump(capability_config()))
    return path


def resolver() -> CapabilityResolver:
    return CapabilityResolver.from_mapping(capability_config(), source="<bench>")


def capability_for(i: int) -> str:
    return capability(DURATIONS_MS[i % len(DURATIONS_MS)])


def input_for(i: int) -> dict[str, Any]:
    return {"n": i, "text": f"bench dispatch {i}"}


def job_bodies(
    count: int, *, namespace: str, caps: CapabilityResolver, suspend: bool = False, deployment: str = DEPLOYMENT
) -> list[dict[str, Any]]:
    """`count` Job manifests of fresh dispatches (not in any database), 0-50 ms each."""
    bodies = []
    for i in range(count):
        cap = capability_for(i)
        dispatch_id = str(uuid.uuid4())
        ref = DispatchRef(
            dispatch_id=DispatchId(dispatch_id),
            case_id=CaseId(f"case-{dispatch_id[:8]}"),
            tenancy_id=TenancyId(TENANCY),
            capability=CapabilityName(cap),
            worker_name=WorkerName(WORKER),
            idempotency_key=IdempotencyKey(f"key-{dispatch_id}"),
        )
        body = build_job(ref, input=input_for(i), spec=caps.spec(cap), namespace=namespace, deployment=deployment)
        if suspend:
            body["spec"]["suspend"] = True
        bodies.append(body)
    return bodies


def new_case(sessions: sessionmaker[Session]) -> str:
    case_id = f"case-{uuid.uuid4().hex[:12]}"
    with transaction(sessions) as session:
        scheduling.create_case(session, case_id=case_id, tenancy_id=TENANCY)
    return case_id


def created_dispatches(
    sessions: sessionmaker[Session],
    caps: CapabilityResolver,
    *,
    count: int,
    namespace: str,
    deployment: str,
    max_input_bytes: int = MAX_INPUT_BYTES,
    capability_of: Callable[[int], str] = lambda i: INSTANT,
) -> list[tuple[DispatchRef, dict[str, Any]]]:
    """`count` dispatches written as an engine would (SCHEDULED), then marked created, in one
    transaction and a few statements (`scheduling.schedule_many`, `dispatches.mark_created_many`): each
    one's ref and Job manifest (not created in the cluster), labelled for `deployment` (the
    settings' `effective_deployment` of the workers that are to deliver them). Instant Jobs
    unless `capability_of(i)` names another capability for dispatch i."""
    case_id = new_case(sessions)
    requests = [
        scheduling.ScheduleRequest(case_id, TENANCY, capability_of(i), input_for(i), f"key-{uuid.uuid4()}")
        for i in range(count)
    ]
    made = []
    with transaction(sessions) as session:
        results = scheduling.schedule_many(session, requests, router=caps, max_input_bytes=max_input_bytes)
        for _i, (request, result) in enumerate(zip(requests, results, strict=True)):
            ref = DispatchRef(
                dispatch_id=DispatchId(result.dispatch_id),
                case_id=CaseId(case_id),
                tenancy_id=TenancyId(TENANCY),
                capability=CapabilityName(request.capability),
                worker_name=WorkerName(WORKER),
                idempotency_key=IdempotencyKey(request.idempotency_key),
            )
            body = build_job(
                ref, input=request.input, spec=caps.spec(request.capability), namespace=namespace, deployment=deployment
            )
            made.append((ref, body))
        dispatches.mark_created_many(
            session,
            [
                dispatches.CreatedJob(ref.dispatch_id, body["metadata"]["name"], namespace, attempt=0)
                for ref, body in made
            ],
        )
    return made


def wait_jobs_terminal(kube: KubeClient, namespace: str, count: int, *, timeout: float = 300.0) -> None:
    """Wait until the namespace holds `count` managed Jobs, all finished."""

    def all_done() -> bool:
        finished = total = 0
        for page in kube.iter_jobs(namespace, label_selector=job_labels.selector()):
            total += len(page)
            finished += sum(1 for job in page if job_state(job).terminal)
        return total == count and finished == count

    wait_until(all_done, timeout=timeout, interval=0.2, what=f"{count} finished Jobs in {namespace}")
