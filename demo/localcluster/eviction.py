"""POST pods/NAME/eviction, as kube-apiserver's Eviction subresource does it
(pkg/registry/core/pod/storage/eviction.go): a Pod that has ended is simply deleted; a running
one first gets the `DisruptionTarget` condition (reason EvictionByEvictionAPI), then a graceful
delete with the Eviction's deleteOptions. localcluster has no PodDisruptionBudgets, so every
eviction is allowed. The Job controller then sees a disrupted Pod, which a podFailurePolicy's
`Ignore` rule leaves uncounted.
"""

from __future__ import annotations

from typing import Any

from k8s_dispatch.demo.localcluster import apierrors
from k8s_dispatch.demo.localcluster.registry import DeleteOptions, Registry, is_terminal_pod
from k8s_dispatch.demo.localcluster.resources import PODS
from k8s_dispatch.demo.localcluster.timestamps import now, rfc3339

REASON = "EvictionByEvictionAPI"
MESSAGE = "Eviction API: evicting"


def disruption_condition(ts: float) -> dict[str, Any]:
    return {
        "type": "DisruptionTarget",
        "status": "True",
        "lastProbeTime": None,
        "lastTransitionTime": rfc3339(ts),
        "reason": REASON,
        "message": MESSAGE,
    }


def evict(registry: Registry, namespace: str, name: str, body: Any) -> None:
    """Evict the Pod `namespace/name` as the Eviction `body` asks.

    Raises:
        ApiError: 400 for a body that is no Eviction of this Pod, 404 for no such Pod, 409 for a
            precondition that fails.
    """
    if not isinstance(body, dict) or body.get("kind") not in (None, "Eviction"):
        raise apierrors.bad_request("the body of the request must be a policy/v1 Eviction")
    if (body.get("metadata") or {}).get("name") not in (None, name):
        raise apierrors.bad_request("name in URL does not match name in Eviction object")
    raw = body.get("deleteOptions") or {}
    options = DeleteOptions(
        propagation_policy=raw.get("propagationPolicy"),
        grace_period_seconds=raw.get("gracePeriodSeconds"),
        preconditions=raw.get("preconditions") or {},
        dry_run=bool(raw.get("dryRun")),
    )
    pod = registry.get(PODS, namespace, name)
    uid = options.preconditions.get("uid")
    if uid and uid != pod.uid:
        raise apierrors.conflict(
            PODS, name, f"Precondition failed: UID in precondition: {uid}, UID in object meta: {pod.uid}"
        )
    if not is_terminal_pod(pod.obj) and not pod.meta.get("deletionTimestamp") and not options.dry_run:
        status = dict(pod.obj.get("status") or {})
        conditions = [c for c in status.get("conditions") or [] if c.get("type") != "DisruptionTarget"]
        status["conditions"] = [*conditions, disruption_condition(now())]
        pod = registry.write(pod, {**pod.obj, "status": status})
    registry.delete(PODS, namespace, name, options)
