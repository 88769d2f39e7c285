"""A capability's Pod failure policy as the Job's `podFailurePolicy` (pure), and its rules' checks.

Every Job carries one: a Pod the cluster disrupted (evicted, preempted, its node drained or
lost: the `DisruptionTarget` condition) is replaced without counting against `backoffLimit`
(`Ignore`), since it says nothing of the work; an exit code in `failOnExitCodes` fails the Job
at once (`FailJob`, reason `PodFailurePolicy`); one in `retryOnExitCodes` is counted against
`backoffLimit` (`Count`) and so retried while the limit allows. Kubernetes' Job controller applies
the first rule that matches a failed Pod, and accepts the policy only with `restartPolicy: Never`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from k8s_dispatch.workers.capability import CapabilitySpec

DISRUPTION_CONDITION = "DisruptionTarget"
MAX_EXIT_CODES = 255  # the API's limit on the values of one onExitCodes rule
MIN_EXIT_CODE, MAX_EXIT_CODE = 1, 255  # 0 is refused by the API for `In`; Linux exit codes end at 255


def pod_failure_policy(spec: CapabilitySpec, *, container: str) -> dict[str, Any]:
    """The Job's `podFailurePolicy` for `spec`: disruptions ignored, then FailJob and Count rules
    on `container`'s exit codes (sorted, as the API wants them)."""
    rules: list[dict[str, Any]] = [
        {"action": "Ignore", "onPodConditions": [{"type": DISRUPTION_CONDITION, "status": "True"}]}
    ]
    for action, codes in (("FailJob", spec.fail_on_exit_codes), ("Count", spec.retry_on_exit_codes)):
        if codes:
            rules.append(
                {
                    "action": action,
                    "onExitCodes": {"containerName": container, "operator": "In", "values": sorted(set(codes))},
                }
            )
    return {"rules": rules}


def policy_problems(spec: CapabilitySpec) -> list[tuple[str, str]]:
    """What keeps the failure fields of `spec` from making a valid policy: (field, why) pairs."""
    problems: list[tuple[str, str]] = []
    for field, codes in (("retryOnExitCodes", spec.retry_on_exit_codes), ("failOnExitCodes", spec.fail_on_exit_codes)):
        problems.extend((field, why) for why in _codes_problems(codes))
    both = sorted(set(_ints(spec.retry_on_exit_codes)) & set(_ints(spec.fail_on_exit_codes)))
    if both:
        problems.append(("failOnExitCodes", f"{both} also in retryOnExitCodes: an exit code is retried or fatal"))
    if spec.retry_on_exit_codes and _is_int(spec.backoff_limit) and spec.backoff_limit == 0:
        problems.append(("retryOnExitCodes", "needs backoffLimit of at least 1: with 0 nothing is retried"))
    limit = spec.max_disruptions
    if not _is_int(limit) or not 0 <= limit <= 1000:
        problems.append(("maxDisruptions", f"{limit!r} is not an integer from 0 to 1000"))
    return problems


def _codes_problems(codes: Sequence[object]) -> list[str]:
    if not isinstance(codes, (list, tuple)):
        return [f"{codes!r} is not a list of exit codes"]
    problems = []
    if len(codes) > MAX_EXIT_CODES:
        problems.append(f"at most {MAX_EXIT_CODES} exit codes, not {len(codes)}")
    for code in codes:
        if not _is_int(code) or not MIN_EXIT_CODE <= code <= MAX_EXIT_CODE:
            problems.append(f"{code!r} is not an exit code from {MIN_EXIT_CODE} to {MAX_EXIT_CODE}")
    ints = _ints(codes)
    duplicates = sorted({c for c in ints if ints.count(c) > 1})
    if duplicates:
        problems.append(f"{duplicates} listed more than once")
    return problems


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ints(codes: Sequence[object]) -> list[int]:
    return (
        [c for c in codes if isinstance(c, int) and not isinstance(c, bool)] if isinstance(codes, (list, tuple)) else []
    )
