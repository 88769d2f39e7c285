"""Validation of Jobs, Pods and Namespaces as the API server words it (pure): each function
returns the list of field errors, empty when the object is valid. Name and label syntax come
from demo/localcluster/names.py, written from Kubernetes' rules apart from the client's own.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from k8s_dispatch.demo.localcluster import failurepolicy, indexes
from k8s_dispatch.demo.localcluster.apierrors import (
    FieldError,
    FieldErrorType,
    GoText,
    forbidden,
    invalid_value,
    not_supported,
    required,
    too_long,
)
from k8s_dispatch.demo.localcluster.names import dns1123_label as is_dns1123_label
from k8s_dispatch.demo.localcluster.names import dns1123_subdomain as is_dns1123_subdomain
from k8s_dispatch.demo.localcluster.names import label_value as _is_label_value
from k8s_dispatch.demo.localcluster.names import qualified_name as _is_qualified_name

ANNOTATIONS_MAX_BYTES = 256 * 1024

DNS1123_SUBDOMAIN_MSG = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
    "and must start and end with an alphanumeric character (e.g. 'example.com', regex used for "
    "validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
DNS1123_LABEL_MSG = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must "
    "start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for "
    "validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
)
LABEL_VALUE_MSG = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and "
    "must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', "
    "regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')"
)
QUALIFIED_NAME_MSG = (
    "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with "
    "an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation "
    "is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]') with an optional DNS subdomain prefix and '/' "
    "(e.g. 'example.com/MyName')"
)
is_qualified_name = functools.lru_cache(maxsize=8192)(_is_qualified_name)  # the same keys come back all the time
is_label_value = functools.lru_cache(maxsize=8192)(_is_label_value)  # a Job's labels come back on its template
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
RESTART_POLICIES = ["Always", "OnFailure", "Never"]
JOB_RESTART_POLICIES = ["OnFailure", "Never"]
MESSAGE_POLICIES = ["File", "FallbackToLogsOnError"]
PULL_POLICIES = ["Always", "IfNotPresent", "Never"]


def validate_name(
    name: str, *, field: str = "metadata.name", label: bool = False, max_len: int | None = None
) -> list[FieldError]:
    if label:
        if not is_dns1123_label(name):
            return [
                invalid_value(
                    field, name, DNS1123_LABEL_MSG if len(name) <= 63 else "must be no more than 63 characters"
                )
            ]
        return []
    if not is_dns1123_subdomain(name):
        detail = DNS1123_SUBDOMAIN_MSG if len(name) <= 253 else "must be no more than 253 characters"
        return [invalid_value(field, name, detail)]
    if max_len is not None and len(name) > max_len:
        return [invalid_value(field, name, f"must be no more than {max_len} characters")]
    return []


def validate_labels(labels: Any, field: str) -> list[FieldError]:
    if labels is None:
        return []
    errs = []
    for key, value in labels.items():
        if not is_qualified_name(key):
            errs.append(invalid_value(field, key, QUALIFIED_NAME_MSG))
        if isinstance(value, str) and len(value.encode()) > 63:
            errs.append(invalid_value(field, value, "must be no more than 63 bytes"))
        elif not isinstance(value, str) or not is_label_value(value):
            errs.append(invalid_value(field, value, LABEL_VALUE_MSG))
    return errs


def validate_annotations(annotations: Any, field: str) -> list[FieldError]:
    if annotations is None:
        return []
    errs = [invalid_value(field, k, QUALIFIED_NAME_MSG) for k in annotations if not is_qualified_name(k.lower())]
    size = sum(len(k) + len(v or "") for k, v in annotations.items())
    if size > ANNOTATIONS_MAX_BYTES:
        errs.append(too_long(field, ANNOTATIONS_MAX_BYTES))
    return errs


def validate_metadata(
    meta: dict[str, Any], *, namespaced: bool, label_name: bool = False, max_len: int | None = None
) -> list[FieldError]:
    errs: list[FieldError] = []
    name = meta.get("name") or ""
    if not name:
        errs.append(required("metadata.name", "name or generateName is required"))
    else:
        errs += validate_name(name, label=label_name, max_len=max_len)
    if namespaced and not meta.get("namespace"):
        errs.append(required("metadata.namespace"))
    errs += validate_labels(meta.get("labels"), "metadata.labels")
    errs += validate_annotations(meta.get("annotations"), "metadata.annotations")
    for i, fin in enumerate(meta.get("finalizers") or []):
        if not is_qualified_name(fin):
            errs.append(invalid_value(f"metadata.finalizers[{i}]", fin, QUALIFIED_NAME_MSG))
    return errs


def _non_negative(spec: dict[str, Any], key: str, prefix: str) -> list[FieldError]:
    value = spec.get(key)
    if value is not None and value < 0:
        return [invalid_value(f"{prefix}.{key}", value, "must be greater than or equal to 0")]
    return []


def validate_container(c: dict[str, Any], path: str) -> list[FieldError]:
    errs: list[FieldError] = []
    name = c.get("name") or ""
    if not name:
        errs.append(required(f"{path}.name"))
    else:
        errs += validate_name(name, field=f"{path}.name", label=True)
    if not c.get("image"):
        errs.append(required(f"{path}.image"))
    for i, env in enumerate(c.get("env") or []):
        ename = env.get("name") or ""
        if not ename:
            errs.append(required(f"{path}.env[{i}].name"))
        elif not _ENV_NAME.match(ename):
            errs.append(
                invalid_value(
                    f"{path}.env[{i}].name",
                    ename,
                    "a valid environment variable name must consist of alphabetic characters, digits, '_', '-', or '.', "
                    "and must not start with a digit (e.g. 'my.env-name',  or 'MY_ENV.NAME',  or 'MyEnvName1', regex "
                    "used for validation is '[-._a-zA-Z][-._a-zA-Z0-9]*')",
                )
            )
        if env.get("value") and env.get("valueFrom"):
            errs.append(
                invalid_value(f"{path}.env[{i}].valueFrom", "", "may not be specified when `value` is not empty")
            )
    policy = c.get("terminationMessagePolicy")
    if policy is not None and policy not in MESSAGE_POLICIES:
        errs.append(not_supported(f"{path}.terminationMessagePolicy", policy, MESSAGE_POLICIES))
    pull = c.get("imagePullPolicy")
    if pull is not None and pull not in PULL_POLICIES:
        errs.append(not_supported(f"{path}.imagePullPolicy", pull, PULL_POLICIES))
    return errs


def validate_pod_spec(spec: dict[str, Any] | None, path: str, *, restart_policies: list[str]) -> list[FieldError]:
    spec = spec or {}
    errs: list[FieldError] = []
    containers = spec.get("containers") or []
    if not containers:
        errs.append(required(f"{path}.containers"))
    seen: set[str] = set()
    for i, c in enumerate(containers):
        errs += validate_container(c, f"{path}.containers[{i}]")
        if c.get("name") in seen:
            errs.append(FieldError(FieldErrorType.DUPLICATE, f"{path}.containers[{i}].name", c.get("name")))
        seen.add(c.get("name"))
    policy = spec.get("restartPolicy")
    if restart_policies == JOB_RESTART_POLICIES and policy not in restart_policies:
        # a Job's template: kube-apiserver words a missing and a refused policy alike
        errs.append(required(f"{path}.restartPolicy", "valid values: " + ", ".join(f'"{p}"' for p in restart_policies)))
    elif policy is None:
        errs.append(required(f"{path}.restartPolicy"))
    elif policy not in restart_policies:
        errs.append(not_supported(f"{path}.restartPolicy", policy, restart_policies))
    deadline = spec.get("activeDeadlineSeconds")
    if deadline is not None and deadline <= 0:
        errs.append(
            invalid_value(f"{path}.activeDeadlineSeconds", deadline, "must be between 1 and 2147483647, inclusive")
        )
    errs += _non_negative(spec, "terminationGracePeriodSeconds", path)
    return errs


def validate_job(job: dict[str, Any], *, selector_matches: bool) -> list[FieldError]:
    """`selector_matches`: whether spec.selector selects the template's labels (computed by the caller)."""
    meta = job.get("metadata") or {}
    name = meta.get("name") or ""
    errs = validate_metadata(meta, namespaced=True)
    # The name may be a 253-character subdomain, but it becomes the value of the job-name labels:
    # kube-apiserver reports that once, at spec.template.labels, and not for each copy of the label.
    name_label_error = isinstance(name, str) and len(name.encode()) > 63
    if name_label_error:
        errs = [e for e in errs if not (e.field == "metadata.labels" and e.value == name)]
        errs.append(invalid_value("spec.template.labels", name, "must be no more than 63 bytes"))
    spec = job.get("spec") or {}
    for key in ("parallelism", "completions", "backoffLimit", "ttlSecondsAfterFinished", "backoffLimitPerIndex"):
        errs += _non_negative(spec, key, "spec")
    deadline = spec.get("activeDeadlineSeconds")
    if deadline is not None and deadline <= 0:
        errs.append(invalid_value("spec.activeDeadlineSeconds", deadline, "must be greater than or equal to 0"))
    mode = spec.get("completionMode")
    if mode not in (None, "NonIndexed", "Indexed"):
        errs.append(not_supported("spec.completionMode", mode, ["NonIndexed", "Indexed"]))
    errs += _indexed_errors(spec)
    template = spec.get("template") or {}
    tmeta = template.get("metadata") or {}
    errs += [
        e
        for e in validate_labels(tmeta.get("labels"), "spec.template.metadata.labels")
        if not (name_label_error and e.value == name)
    ]
    errs += validate_annotations(tmeta.get("annotations"), "spec.template.metadata.annotations")
    if spec.get("selector") is None:
        errs.append(required("spec.selector"))
    elif not selector_matches:
        errs.append(
            invalid_value(
                "spec.template.metadata.labels",
                tmeta.get("labels") or {},
                "`selector` does not match template `labels`",
            )
        )
    errs += validate_pod_spec(template.get("spec"), "spec.template.spec", restart_policies=JOB_RESTART_POLICIES)
    errs += failurepolicy.validate(spec)
    completions = spec.get("completions")
    if mode == "Indexed" and isinstance(completions, int) and completions > 0 and isinstance(name, str):
        # the Pods' hostnames are <job>-<index>: the last one must be a DNS label
        host = f"{name}-{completions - 1}"
        if not is_dns1123_label(host):
            errs.append(
                invalid_value("metadata.name", name, f"will not able to create pod with invalid DNS label: {host}")
            )
    return errs


MAX_INDEXED_PARALLELISM = 100_000
MAX_FAILED_INDEXES = 100_000
COMPLETIONS_SOFT_LIMIT = 100_000
HIGH_COMPLETIONS_LIMIT = 10_000  # parallelism and maxFailedIndexes above the soft limit
MAX_SUCCESS_RULES = 20
MAX_SUCCEEDED_INDEXES = 64 * 1024


def _indexed_errors(spec: dict[str, Any]) -> list[FieldError]:
    """kube-apiserver's checks of completionMode, backoffLimitPerIndex, maxFailedIndexes and
    successPolicy (pkg/apis/batch/validation validateJobSpec)."""
    errs: list[FieldError] = []
    mode = spec.get("completionMode")
    completions, parallelism = spec.get("completions"), spec.get("parallelism")
    per_index, max_failed = spec.get("backoffLimitPerIndex"), spec.get("maxFailedIndexes")
    if max_failed is not None:
        errs += _non_negative(spec, "maxFailedIndexes", "spec")
        if per_index is None:
            errs.append(required("spec.backoffLimitPerIndex", "when maxFailedIndexes is specified"))
    if mode == "Indexed":
        if completions is None:
            errs.append(required("spec.completions", "when completion mode is Indexed"))
        if parallelism is not None and parallelism > MAX_INDEXED_PARALLELISM:
            errs.append(invalid_value("spec.parallelism", parallelism,
                                      f"must be less than or equal to {MAX_INDEXED_PARALLELISM} when completion mode is Indexed"))  # fmt: skip
        if completions is not None and max_failed is not None and max_failed > completions:
            errs.append(invalid_value("spec.maxFailedIndexes", max_failed, "must be less than or equal to completions"))
        if max_failed is not None and max_failed > MAX_FAILED_INDEXES:
            errs.append(
                invalid_value(
                    "spec.maxFailedIndexes", max_failed, f"must be less than or equal to {MAX_FAILED_INDEXES}"
                )
            )
        if completions is not None and completions > COMPLETIONS_SOFT_LIMIT and per_index is not None:
            tail = f"when completions are above {COMPLETIONS_SOFT_LIMIT} and used with backoff limit per index"
            if max_failed is None:
                errs.append(
                    required(
                        "spec.maxFailedIndexes", f"must be specified when completions is above {COMPLETIONS_SOFT_LIMIT}"
                    )
                )
            if parallelism is not None and parallelism > HIGH_COMPLETIONS_LIMIT:
                errs.append(
                    invalid_value(
                        "spec.parallelism",
                        parallelism,
                        f"must be less than or equal to {HIGH_COMPLETIONS_LIMIT} {tail}",
                    )
                )
            if max_failed is not None and max_failed > HIGH_COMPLETIONS_LIMIT:
                errs.append(
                    invalid_value(
                        "spec.maxFailedIndexes",
                        max_failed,
                        f"must be less than or equal to {HIGH_COMPLETIONS_LIMIT} {tail}",
                    )
                )
    elif mode in (None, "NonIndexed"):
        if per_index is not None:
            errs.append(invalid_value("spec.backoffLimitPerIndex", per_index, "requires indexed completion mode"))
        if max_failed is not None:
            errs.append(invalid_value("spec.maxFailedIndexes", max_failed, "requires indexed completion mode"))
    policy = spec.get("successPolicy")
    if policy is not None:
        if mode != "Indexed":
            errs.append(
                invalid_value("spec.successPolicy", _go_success_policy(policy), "requires indexed completion mode")
            )
        else:
            errs += _success_policy_errors(policy, completions or 0)
    return errs


def _go_success_policy(policy: Any) -> GoText:
    """batch.SuccessPolicy as the API server shows it in an error (the internal struct's JSON)."""
    rules = (policy.get("rules") if isinstance(policy, dict) else None) or []
    go = [
        {"SucceededIndexes": r.get("succeededIndexes"), "SucceededCount": r.get("succeededCount")}
        for r in rules
        if isinstance(r, dict)
    ]
    return GoText(json.dumps({"Rules": go if rules else None}, separators=(",", ":")))


def _success_policy_errors(policy: Any, completions: int) -> list[FieldError]:
    rules = (policy.get("rules") if isinstance(policy, dict) else None) or []
    errs: list[FieldError] = []
    if not rules:
        errs.append(
            required(
                "spec.successPolicy.rules", "at least one rules must be specified when the successPolicy is specified"
            )
        )
    if len(rules) > MAX_SUCCESS_RULES:
        errs.append(
            FieldError(
                FieldErrorType.TOO_MANY,
                "spec.successPolicy.rules",
                len(rules),
                f"must have at most {MAX_SUCCESS_RULES} items",
            )
        )
    for i, rule in enumerate(rules):
        path = f"spec.successPolicy.rules[{i}]"
        rule = rule if isinstance(rule, dict) else {}
        wanted, count = rule.get("succeededIndexes"), rule.get("succeededCount")
        if wanted is None and count is None:
            errs.append(required(path, "at least one of succeededCount or succeededIndexes must be specified"))
        total = 0
        if wanted is not None:
            if len(wanted) > MAX_SUCCEEDED_INDEXES:
                errs.append(too_long(f"{path}.succeededIndexes", MAX_SUCCEEDED_INDEXES))
            total, problem = indexes.validate_format(wanted, completions)
            if problem is not None:
                errs.append(
                    invalid_value(f"{path}.succeededIndexes", wanted, f"error parsing succeededIndexes: {problem}")
                )
        if count is not None:
            if count < 0:
                errs.append(invalid_value(f"{path}.succeededCount", count, "must be greater than or equal to 0"))
            if count > completions:
                errs.append(invalid_value(f"{path}.succeededCount", count,
                                          f"must be less than or equal to {completions} (the number of specified completions)"))  # fmt: skip
            if wanted is not None and count > total:
                errs.append(invalid_value(f"{path}.succeededCount", count,
                                          f"must be less than or equal to {total} (the number of indexes in the specified succeededIndexes field)"))  # fmt: skip
    return errs


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def validate_job_update(old: dict[str, Any], new: dict[str, Any]) -> list[FieldError]:
    errs: list[FieldError] = []
    ospec, nspec = old.get("spec") or {}, new.get("spec") or {}
    for key in ("selector", "completionMode", "podFailurePolicy", "backoffLimitPerIndex", "managedBy", "successPolicy"):
        if _canon(ospec.get(key)) != _canon(nspec.get(key)):
            errs.append(invalid_value(f"spec.{key}", nspec.get(key), "field is immutable"))
    if _canon(ospec.get("template")) != _canon(nspec.get("template")) and not ospec.get("suspend"):
        errs.append(invalid_value("spec.template", nspec.get("template"), "field is immutable"))
    if ospec.get("completions") != nspec.get("completions"):
        if nspec.get("completionMode") != "Indexed":
            errs.append(invalid_value("spec.completions", nspec.get("completions"), "field is immutable"))
        elif nspec.get("completions") is not None and nspec.get("completions") != nspec.get("parallelism"):
            errs.append(invalid_value("spec.completions", nspec.get("completions"),
                                      "can only be modified in tandem with spec.parallelism"))  # fmt: skip
    return errs


def validate_job_status(job: dict[str, Any], old: dict[str, Any] | None = None) -> list[FieldError]:
    """What kube-apiserver checks of a status written through the status subresource (the part of
    it we have met): as its status strategy, a check runs only when its fields change from `old`."""
    status, spec = job.get("status") or {}, job.get("spec") or {}
    ostatus = (old or {}).get("status") or {}
    done, failed = status.get("completedIndexes") or "", status.get("failedIndexes")
    done_changed = done != (ostatus.get("completedIndexes") or "")
    failed_changed = failed != ostatus.get("failedIndexes")
    completions = spec.get("completions")
    errs: list[FieldError] = []
    if done_changed and completions is not None:
        _, problem = indexes.validate_format(done, completions)
        if problem is not None:
            errs.append(invalid_value("status.completedIndexes", done, f"error parsing completedIndexes: {problem}"))
    if (
        failed_changed
        and completions is not None
        and spec.get("backoffLimitPerIndex") is not None
        and failed is not None
    ):
        _, problem = indexes.validate_format(failed, completions)
        if problem is not None:
            errs.append(invalid_value("status.failedIndexes", failed, f"error parsing failedIndexes: {problem}"))
    if done_changed and done and spec.get("completionMode") != "Indexed":
        errs.append(invalid_value("status.completedIndexes", done,
                                  "cannot set non-empty completedIndexes when non-indexed completion mode"))  # fmt: skip
    if failed_changed and spec.get("backoffLimitPerIndex") is None and failed is not None:
        errs.append(invalid_value("status.failedIndexes", failed,
                                  "cannot set non-null failedIndexes when backoffLimitPerIndex is null"))  # fmt: skip
    if (failed_changed or done_changed) and completions is not None and failed:
        at = indexes.overlap(done, failed, completions)
        if at is not None:
            errs.append(
                invalid_value(
                    "status.failedIndexes", failed, f"failedIndexes and completedIndexes overlap at index: {at}"
                )
            )
    return errs


def validate_pod(pod: dict[str, Any]) -> list[FieldError]:
    errs = validate_metadata(pod.get("metadata") or {}, namespaced=True)
    errs += validate_pod_spec(pod.get("spec"), "spec", restart_policies=RESTART_POLICIES)
    return errs


def validate_pod_update(old: dict[str, Any], new: dict[str, Any]) -> list[FieldError]:
    """Pod specs are immutable but for images, activeDeadlineSeconds and tolerations."""

    def mutable_removed(spec: dict[str, Any]) -> dict[str, Any]:
        spec = dict(spec or {})
        spec.pop("activeDeadlineSeconds", None)
        spec.pop("tolerations", None)
        spec["containers"] = [{k: v for k, v in c.items() if k != "image"} for c in spec.get("containers") or []]
        return spec

    if _canon(mutable_removed(old.get("spec") or {})) != _canon(mutable_removed(new.get("spec") or {})):
        return [
            forbidden(
                "spec",
                "pod updates may not change fields other than `spec.containers[*].image`,"
                "`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` "
                "(only additions to existing tolerations),`spec.terminationGracePeriodSeconds` "
                "(allow it to be set to 1 if it was previously negative)",
            )
        ]
    return []


def validate_namespace(ns: dict[str, Any]) -> list[FieldError]:
    return validate_metadata(ns.get("metadata") or {}, namespaced=False, label_name=True)


def validate_metadata_update(old: dict[str, Any], new: dict[str, Any]) -> list[FieldError]:
    """Finalizers cannot be added to an object that is being deleted."""
    ometa, nmeta = old.get("metadata") or {}, new.get("metadata") or {}
    if ometa.get("deletionTimestamp"):
        added = set(nmeta.get("finalizers") or []) - set(ometa.get("finalizers") or [])
        if added:
            return [
                forbidden(
                    "metadata.finalizers",
                    f"no new finalizers can be added if the object is being deleted, found new finalizers {sorted(added)!r}",
                )
            ]
    return []
