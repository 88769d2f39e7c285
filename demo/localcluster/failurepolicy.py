"""A Job's `podFailurePolicy` (pure): the checks kube-apiserver makes of it, and the rule that
matches a failed Pod, as pkg/controller/job's matchPodFailurePolicy applies it (the first rule
that matches wins; only Pods in phase Failed are matched; `Ignore` leaves the Pod uncounted,
`FailJob` fails the Job with reason PodFailurePolicy, `Count` counts it as usual).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from k8s_dispatch.demo.localcluster.apierrors import FieldError, invalid_value, not_supported, required

ACTIONS = ("FailJob", "FailIndex", "Ignore", "Count")
OPERATORS = ("In", "NotIn")
MAX_RULES = 20
MAX_VALUES = 255
REASON = "PodFailurePolicy"


@dataclass(frozen=True)
class Match:
    action: str
    message: str  # what the Job's condition says for FailJob


def validate(spec: dict[str, Any]) -> list[FieldError]:
    """kube-apiserver's checks of `spec.podFailurePolicy` (the parts a Job of ours can meet)."""
    policy = spec.get("podFailurePolicy")
    if policy is None:
        return []
    errs: list[FieldError] = []
    restart = ((spec.get("template") or {}).get("spec") or {}).get("restartPolicy")
    if restart != "Never":
        errs.append(
            invalid_value(
                "spec.template.spec.restartPolicy",
                restart,
                'only "Never" is supported when podFailurePolicy is specified',
            )
        )
    if spec.get("podReplacementPolicy") not in (None, "Failed"):
        errs.append(not_supported("spec.podReplacementPolicy", spec.get("podReplacementPolicy"), ["Failed"]))
    rules = policy.get("rules") if isinstance(policy, dict) else None
    if not isinstance(rules, list):
        return [*errs, required("spec.podFailurePolicy.rules")]
    if len(rules) > MAX_RULES:
        errs.append(invalid_value("spec.podFailurePolicy.rules", len(rules), f"must have at most {MAX_RULES} items"))
    for i, rule in enumerate(rules):
        path = f"spec.podFailurePolicy.rules[{i}]"
        rule = rule if isinstance(rule, dict) else {}
        if rule.get("action") == "FailIndex" and spec.get("backoffLimitPerIndex") is None:
            errs.append(invalid_value(f"{path}.action", "FailIndex", "requires the backoffLimitPerIndex to be set"))
        elif rule.get("action") not in ACTIONS:
            errs.append(not_supported(f"{path}.action", rule.get("action"), list(ACTIONS)))
        codes, conditions = rule.get("onExitCodes"), rule.get("onPodConditions")
        if (codes is None) == (not conditions):
            errs.append(invalid_value(path, rule, "specifying one of OnExitCodes and OnPodConditions is required"))
        if isinstance(codes, dict):
            errs += _codes_errors(codes, f"{path}.onExitCodes")
    return errs


def _codes_errors(codes: dict[str, Any], path: str) -> list[FieldError]:
    errs: list[FieldError] = []
    operator = codes.get("operator")
    if operator not in OPERATORS:
        errs.append(not_supported(f"{path}.operator", operator, list(OPERATORS)))
    values = codes.get("values")
    if not isinstance(values, list) or not values:
        return [*errs, required(f"{path}.values")]
    if len(values) > MAX_VALUES:
        errs.append(invalid_value(f"{path}.values", len(values), f"must have at most {MAX_VALUES} items"))
    previous = None
    for j, value in enumerate(values):
        if operator == "In" and value == 0:
            errs.append(invalid_value(f"{path}.values[{j}]", value, "must not be 0 for the In operator"))
        if previous is not None and value <= previous:
            errs.append(
                invalid_value(
                    f"{path}.values[{j}]", value, "must be ordered" if value < previous else "duplicate value"
                )
            )
        previous = value
    return errs


def default(spec: dict[str, Any]) -> None:
    """The defaults kube-apiserver fills in: a rule's condition status True; Pods replaced only
    once they failed (podReplacementPolicy Failed) when a policy is set."""
    policy = spec.get("podFailurePolicy")
    if not isinstance(policy, dict):
        return
    spec.setdefault("podReplacementPolicy", "Failed")
    for rule in policy.get("rules") or []:
        for cond in (rule.get("onPodConditions") or []) if isinstance(rule, dict) else []:
            if isinstance(cond, dict):
                cond.setdefault("status", "True")


def match(policy: dict[str, Any] | None, pod: dict[str, Any]) -> Match | None:
    """The first rule of `policy` that matches the failed `pod`, or None (count it as usual)."""
    if not policy or (pod.get("status") or {}).get("phase") != "Failed":
        return None
    status = pod.get("status") or {}
    meta = pod.get("metadata") or {}
    for i, rule in enumerate(policy.get("rules") or []):
        action = rule.get("action", "")
        codes = rule.get("onExitCodes")
        if codes is not None:
            hit = _exit_code_match(codes, status)
            if hit is not None:
                container, code = hit
                message = (
                    f"Container {container} for pod {meta.get('namespace', '')}/{meta.get('name', '')} failed with "
                    f"exit code {code} matching {action} rule at index {i}"
                )
                return Match(action, message)
            continue
        for want in rule.get("onPodConditions") or []:
            for cond in status.get("conditions") or []:
                if cond.get("type") == want.get("type") and cond.get("status") == want.get("status", "True"):
                    message = (
                        f"Pod {meta.get('namespace', '')}/{meta.get('name', '')} has condition {want.get('type')} "
                        f"matching {action} rule at index {i}"
                    )
                    return Match(action, message)
    return None


def _exit_code_match(codes: dict[str, Any], status: dict[str, Any]) -> tuple[str, int] | None:
    values = set(codes.get("values") or [])
    name = codes.get("containerName")
    for cs in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        if name and cs.get("name") != name:
            continue
        term = (cs.get("state") or {}).get("terminated") or {}
        code = term.get("exitCode")
        if not isinstance(code, int) or code == 0:
            continue
        if (code in values) == (codes.get("operator") == "In"):
            return cs.get("name", ""), code
    return None
