"""A dispatch as a batch/v1 Job manifest, and the rules a capability spec must keep (pure).

`build_job` maps a `DispatchRef`, its input and its `CapabilitySpec` to the Job dict the API
takes (camelCase keys). Names, labels, resources and sizes are checked here against the
rules the API server applies, so a manifest either builds valid or fails with a typed error
before any request. The input reaches the container as compact JSON in `K8S_DISPATCH_INPUT`;
one too large for the env as a presigned URL and its reference (`artifacts.inputs`); a secret one
from a Secret of the Job's own (`input_secret`), so the Job carries only its name.
A capability with a Kueue `queue` gets a Job created suspended with Kueue's queue-name label:
Kueue's admission unsuspends it (its webhook is not needed).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from k8s_dispatch.container.contract import (
    INPUT_ENV,
    INPUT_REF_ENV,
    INPUT_URL_ENV,
    RESULT_KEY_ENV,
    RESULT_URL_ENV,
    SECRET_INPUT_KEY,
    TERMINATION_MESSAGE_PATH,
    InputDownload,
    ResultUpload,
    encode_input,
    secret_name,
)
from k8s_dispatch.core.errors import (
    InvalidId,
    InvalidManifest,
)
from k8s_dispatch.core.ids import is_dispatch_id
from k8s_dispatch.core.names import is_dns1123_label, is_dns1123_subdomain, is_label_value, is_qualified_name
from k8s_dispatch.core.payloads import canonical_json
from k8s_dispatch.workers import labels as job_labels
from k8s_dispatch.workers.failure_policy import pod_failure_policy, policy_problems
from k8s_dispatch.workers.types import (
    DispatchId,
    DispatchRef,
    check_ref,
    is_capability_name,
    is_worker_name,
)

if TYPE_CHECKING:
    from k8s_dispatch.workers.capability import CapabilitySpec

JOB_NAME_PREFIX = "kd-"  # + the 36-character dispatch id: 39 characters
FINALIZER = "k8s-dispatch.io/result-protection"  # on the Job and, through its template, on its Pods
CONTAINER_NAME = "worker"
TERMINATION_MESSAGE_POLICY = "FallbackToLogsOnError"
MAX_ANNOTATIONS_BYTES = 256 * 1024  # the API server's limit on all annotations of an object
MAX_INT32 = 2**31 - 1
# The `restricted` Pod Security profile, on every Job by default. Each entry is a default a
# capability may switch off (`securityOverrides: {name: reason}`): the field is then left out,
# so the image's or the cluster's default applies, and the reason is recorded on the Job.
SECURITY_DEFAULTS = (
    "runAsNonRoot", "allowPrivilegeEscalation", "capabilities", "seccompProfile", "automountServiceAccountToken",
)  # fmt: skip
SECURITY_OVERRIDES_ANNOTATION = "k8s-dispatch.io/security-overrides"
# Kueue's label naming the LocalQueue of a Job (sigs.k8s.io/kueue pkg/controller/constants).
QUEUE_NAME_LABEL = "kueue.x-k8s.io/queue-name"

RESERVED_ENV = frozenset({INPUT_ENV, RESULT_URL_ENV, RESULT_KEY_ENV, INPUT_URL_ENV, INPUT_REF_ENV})
RESOURCE_KINDS = ("requests", "limits")
# Labels the Job controller puts on a Job's pods itself; a template carrying them is refused.
_CONTROLLER_LABELS = frozenset({"job-name", "controller-uid"})
_CONTROLLER_LABEL_PREFIX = "batch.kubernetes.io/"
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
_QUANTITY = re.compile(
    r"^(?P<number>[0-9]+(\.[0-9]*)?|\.[0-9]+)"  # no sign: resources are never negative
    r"(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][-+]?[0-9]+)?$"
)
_SUFFIX_FACTORS = {
    None: Decimal(1), "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"),
    "k": Decimal("1e3"), "M": Decimal("1e6"), "G": Decimal("1e9"), "T": Decimal("1e12"),
    "P": Decimal("1e15"), "E": Decimal("1e18"),
    "Ki": Decimal(2**10), "Mi": Decimal(2**20), "Gi": Decimal(2**30),
    "Ti": Decimal(2**40), "Pi": Decimal(2**50), "Ei": Decimal(2**60),
}  # fmt: skip


def job_name(dispatch_id: DispatchId | str) -> str:
    """The Job's name, derived from the dispatch id alone: a re-create meets the same name.

    Raises:
        InvalidId: `dispatch_id` is not a canonical lowercase UUID.
    """
    if not is_dispatch_id(dispatch_id):
        raise InvalidId(f"dispatch_id {dispatch_id!r} is not a lowercase canonical UUID")
    return JOB_NAME_PREFIX + dispatch_id


def build_job(
    ref: DispatchRef,
    *,
    input: object,
    spec: CapabilitySpec,
    namespace: str,
    deployment: str,
    attempt: int = 0,
    result_upload: ResultUpload | None = None,
    input_download: InputDownload | None = None,
    secret_input: bool = False,
) -> dict[str, Any]:
    """The batch/v1 Job that runs `ref`'s dispatch; `spec.namespace`, if set, wins over `namespace`.
    `deployment` (`Settings.effective_deployment`) is labelled on the Job and its Pods.
    `result_upload` (`artifacts.result_upload`, for a capability whose results go to the object
    store, and only for one): this attempt's key and the presigned URL that writes it, as env.
    `input_download` (`artifacts.inputs.input_download`, an input too large for the env): the
    URL and reference the runner reads it by, in place of the input. `secret_input`: the input
    comes from the Job's Secret (`input_secret`) and `input` is not looked at: the Job carries
    no trace of it.

    Raises:
        InvalidId, InvalidIdempotencyKey: a field of `ref` is malformed.
        InputNotSerialisable: `input` is not JSON.
        InvalidManifest: `spec` is invalid or for another capability/worker, the namespace,
            deployment or attempt is invalid, or the annotations exceed the API's size limit.
    """
    check_ref(ref)
    if ref.capability != spec.name:
        raise InvalidManifest(f"dispatch is for capability {ref.capability!r}, spec is for {spec.name!r}")
    if ref.worker_name != spec.worker_name:
        raise InvalidManifest(
            f"dispatch is for worker {ref.worker_name!r}, capability {spec.name!r} runs on {spec.worker_name!r}"
        )
    problems = spec_problems(spec)
    if problems:
        raise InvalidManifest(f"capability {spec.name!r}: " + "; ".join(f"{field}: {why}" for field, why in problems))
    target = spec.namespace or namespace
    if not isinstance(target, str) or not is_dns1123_label(target):
        raise InvalidManifest(f"namespace {target!r} is not a DNS-1123 label")
    if not isinstance(deployment, str) or not deployment or not is_label_value(deployment):
        raise InvalidManifest(f"deployment {deployment!r} is not a label value")
    if not _is_int_in(attempt, 0, MAX_INT32):
        raise InvalidManifest(f"attempt {attempt!r} is not a non-negative integer")
    if spec.results_in_object_store != (result_upload is not None):
        raise InvalidManifest(
            f"capability {spec.name!r} has results: {spec.results}, "
            + ("but no upload URL was given" if result_upload is None else "so it takes no upload URL")
        )
    if secret_input and input_download is not None:
        raise InvalidManifest("a secret input is never stored as an object: it takes no download URL")
    text = "" if secret_input or input_download is not None else encode_input(input)

    our_labels, our_annotations = job_labels.encode(ref, deployment=deployment)
    our_annotations[job_labels.ATTEMPT_KEY] = str(attempt)
    # Ours last: a capability's labels can add to them, never replace them.
    labels = {**spec.labels, **our_labels}
    annotations = {**spec.annotations, **our_annotations}
    # Kueue's Job integration reads the queue from the Job's own labels; its Pods need none.
    queue_label = {QUEUE_NAME_LABEL: spec.queue} if spec.queue is not None else {}
    if spec.security_overrides:  # why this Job runs outside `restricted`, for whoever finds it
        annotations[SECURITY_OVERRIDES_ANNOTATION] = canonical_json(dict(spec.security_overrides), what="reasons")
    size = sum(len(k.encode("utf-8")) + len(v.encode("utf-8")) for k, v in annotations.items())
    if size > MAX_ANNOTATIONS_BYTES:
        raise InvalidManifest(f"annotations are {size} bytes, more than the API's limit of {MAX_ANNOTATIONS_BYTES}")

    container: dict[str, Any] = {"name": CONTAINER_NAME, "image": spec.image}
    if spec.command:
        container["command"] = list(spec.command)
    if spec.args:
        container["args"] = list(spec.args)
    container["env"] = [{"name": k, "value": v} for k, v in spec.env.items()]
    if secret_input:
        # optional: false (the default, spelled out): the kubelet holds the container back
        # (CreateContainerConfigError) until the Secret, made just after the Job, exists.
        reference = {"name": secret_name(job_name(ref.dispatch_id)), "key": SECRET_INPUT_KEY, "optional": False}
        container["env"].append({"name": INPUT_ENV, "valueFrom": {"secretKeyRef": reference}})
    elif input_download is not None:
        container["env"] += [
            {"name": INPUT_URL_ENV, "value": input_download.url},
            {"name": INPUT_REF_ENV, "value": input_download.reference()},
        ]
    else:
        container["env"].append({"name": INPUT_ENV, "value": text})
    if result_upload is not None:
        container["env"] += [
            {"name": RESULT_URL_ENV, "value": result_upload.url},
            {"name": RESULT_KEY_ENV, "value": result_upload.key},
        ]
    container["resources"] = {kind: dict(spec.resources[kind]) for kind in RESOURCE_KINDS if kind in spec.resources}
    container["terminationMessagePath"] = TERMINATION_MESSAGE_PATH
    container["terminationMessagePolicy"] = TERMINATION_MESSAGE_POLICY
    pod_security, container_security = _security_contexts(spec)
    if container_security:
        container["securityContext"] = container_security
    pod_spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [container]}
    if pod_security:
        pod_spec["securityContext"] = pod_security
    if "automountServiceAccountToken" not in spec.security_overrides:
        pod_spec["automountServiceAccountToken"] = False  # a capability's Pod never calls the API

    # Disruptions never count against backoffLimit; the capability's exit codes fail at once or retry.
    job_spec: dict[str, Any] = {
        "backoffLimit": spec.backoff_limit,
        "podFailurePolicy": pod_failure_policy(spec, container=CONTAINER_NAME),
    }
    if spec.queue is not None:  # queued until Kueue admits it: no Pod, no start clock (pod_health)
        job_spec["suspend"] = True
    if spec.active_deadline_seconds is not None:
        job_spec["activeDeadlineSeconds"] = spec.active_deadline_seconds
    job_spec["template"] = {
        # The Job controller copies the template's finalizers to every Pod it creates (next to
        # its own job-tracking one): ours keeps a finished Pod, and the result it holds, until
        # the completion is recorded, whatever deletes it (PodGC, a node's loss, a person).
        "metadata": {"labels": dict(labels), "annotations": dict(annotations), "finalizers": [FINALIZER]},
        "spec": pod_spec,  # restartPolicy Never: podFailurePolicy needs it
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": job_name(ref.dispatch_id),
            "namespace": target,
            "labels": {**labels, **queue_label},
            "annotations": annotations,
            "finalizers": [FINALIZER],
        },
        "spec": job_spec,
    }


def input_secret(job: Mapping[str, Any], *, text: str) -> dict[str, Any]:
    """The v1 Secret holding a secret input's JSON `text` for `job` (as the API returned it on
    create: its uid is needed), owned by it, so the garbage collector deletes it with the Job.
    Its labels are the Job's own (ours only, to find it); immutable, as nothing rewrites it.

    Raises:
        InvalidManifest: `job` has no name, namespace or uid.
    """
    meta = job.get("metadata") or {}
    name, namespace, uid = meta.get("name"), meta.get("namespace"), meta.get("uid")
    if not (isinstance(name, str) and isinstance(namespace, str) and isinstance(uid, str) and uid):
        raise InvalidManifest("the Secret of a secret input needs its Job's name, namespace and uid")
    labels = {k: v for k, v in (meta.get("labels") or {}).items() if k.startswith(job_labels.PREFIX)}
    labels[job_labels.MANAGED_BY_LABEL] = (meta.get("labels") or {}).get(job_labels.MANAGED_BY_LABEL, "")
    owner = {"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": uid, "blockOwnerDeletion": False}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": secret_name(name),
            "namespace": namespace,
            "labels": {k: v for k, v in labels.items() if v},
            "ownerReferences": [owner],
        },
        "type": "Opaque",
        "immutable": True,
        "stringData": {SECRET_INPUT_KEY: text},
    }


def _security_contexts(spec: CapabilitySpec) -> tuple[dict[str, Any], dict[str, Any]]:
    """The Pod's and the container's securityContext: `restricted`, less the spec's overrides."""
    off = spec.security_overrides
    pod: dict[str, Any] = {}
    if "runAsNonRoot" not in off:
        pod["runAsNonRoot"] = True
    if spec.run_as_user is not None:
        pod["runAsUser"] = spec.run_as_user
    if spec.run_as_group is not None:
        pod["runAsGroup"] = spec.run_as_group
    if "seccompProfile" not in off:
        pod["seccompProfile"] = {"type": "RuntimeDefault"}
    container: dict[str, Any] = {}
    if "allowPrivilegeEscalation" not in off:
        container["allowPrivilegeEscalation"] = False
    if "capabilities" not in off:
        container["capabilities"] = {"drop": ["ALL"]}
    return pod, container


def _security_problems(spec: CapabilitySpec) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    for name, reason in spec.security_overrides.items():
        if name not in SECURITY_DEFAULTS:
            problems.append(("securityOverrides", f"{name!r} is not one of {', '.join(SECURITY_DEFAULTS)}"))
        elif not isinstance(reason, str) or not reason.strip() or "\x00" in reason:
            problems.append(("securityOverrides", f"{name!r} needs a reason: a non-empty string saying why"))
    for field, value in (("runAsUser", spec.run_as_user), ("runAsGroup", spec.run_as_group)):
        if value is not None and not _is_int_in(value, 0, MAX_INT32):
            problems.append((field, f"{value!r} is not a non-negative integer"))
    if spec.run_as_user == 0 and "runAsNonRoot" not in spec.security_overrides:
        problems.append(("runAsUser", "0 is root, which runAsNonRoot forbids: override runAsNonRoot with a reason"))
    return problems


def spec_problems(spec: CapabilitySpec) -> list[tuple[str, str]]:
    """What keeps `spec` from making a valid Job: (config field name, why) pairs, in field order.

    The resolver reports these as config errors at start; `build_job` checks them again so
    a hand-built spec cannot slip through.
    """
    problems: list[tuple[str, str]] = []
    if not is_capability_name(spec.name):
        problems.append(("name", f"{spec.name!r} is not a capability name (letters, digits, -_.:/, at most 128)"))
    if not is_worker_name(spec.worker_name):
        problems.append(("worker", f"{spec.worker_name!r} is not a DNS-1123 label"))
    if not isinstance(spec.image, str) or not spec.image.isprintable() or spec.image.split() != [spec.image]:
        problems.append(("image", f"{spec.image!r} is not an image reference (non-empty, no spaces)"))
    for field, items in (("command", spec.command), ("args", spec.args)):
        if not all(isinstance(item, str) and "\x00" not in item for item in items):
            problems.append((field, "every element must be a string without NUL characters"))
    for name, value in spec.env.items():
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            problems.append(("env", f"{name!r} is not a valid environment variable name"))
        elif name in RESERVED_ENV:
            problems.append(("env", f"{name!r} is reserved: k8s-dispatch sets it"))
        elif not isinstance(value, str) or "\x00" in value:
            problems.append(("env", f"the value of {name!r} must be a string without NUL characters"))
    problems.extend(("resources", why) for why in _resource_problems(spec.resources))
    if spec.namespace is not None and not (isinstance(spec.namespace, str) and is_dns1123_label(spec.namespace)):
        problems.append(("namespace", f"{spec.namespace!r} is not a DNS-1123 label"))
    if spec.queue is not None and not is_queue_name(spec.queue):
        problems.append(
            ("queue", f"{spec.queue!r} is not a LocalQueue name (a DNS-1123 subdomain usable as a label value)")
        )
    deadline = spec.active_deadline_seconds
    if deadline is not None and not _is_int_in(deadline, 1, MAX_INT32):
        problems.append(("activeDeadlineSeconds", f"{deadline!r} is not a positive integer"))
    limit = spec.backoff_limit
    if not _is_int_in(limit, 0, MAX_INT32):
        problems.append(("backoffLimit", f"{limit!r} is not a non-negative integer"))
    problems.extend(policy_problems(spec))
    problems.extend(("labels", why) for why in _metadata_problems(spec.labels, labels=True))
    problems.extend(("annotations", why) for why in _metadata_problems(spec.annotations, labels=False))
    problems.extend(_security_problems(spec))
    return problems


def is_queue_name(value: object) -> bool:
    """What Kueue accepts as the queue-name label: a LocalQueue's name (DNS-1123 subdomain,
    as its webhook checks it) that is also a label value (at most 63 characters)."""
    return isinstance(value, str) and is_dns1123_subdomain(value) and is_label_value(value)


def _is_int_in(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _metadata_problems(values: Mapping[str, str], *, labels: bool) -> list[str]:
    problems = []
    for key, value in values.items():
        if not isinstance(key, str) or not is_qualified_name(key):
            problems.append(f"{key!r} is not a valid key (optional DNS prefix, '/', name of at most 63)")
        elif key.startswith(job_labels.PREFIX) or key == job_labels.MANAGED_BY_LABEL:
            problems.append(f"{key!r} is reserved: k8s-dispatch sets it")
        elif labels and (key in _CONTROLLER_LABELS or key.startswith(_CONTROLLER_LABEL_PREFIX)):
            problems.append(f"{key!r} is reserved: the Job controller sets it")
        elif labels and key == QUEUE_NAME_LABEL:
            problems.append(f"{key!r} is set from the capability's 'queue' field: name the LocalQueue there")
        elif not isinstance(value, str):
            problems.append(f"the value of {key!r} must be a string")
        elif labels and not is_label_value(value):
            problems.append(f"the value of {key!r}, {value!r}, is not a valid label value")
    return problems


def parse_quantity(text: str) -> Decimal | None:
    """A Kubernetes resource quantity ("100m", "64Mi", "1e3", "2") as a number; None if invalid."""
    match = _QUANTITY.match(text) if isinstance(text, str) else None
    if match is None:
        return None
    suffix = match["suffix"]
    try:
        if suffix and suffix[0] in "eE":
            return Decimal(match["number"]) * (Decimal(10) ** int(suffix[1:]))
        return Decimal(match["number"]) * _SUFFIX_FACTORS[suffix]
    except (ArithmeticError, ValueError):  # decimal's Overflow and InvalidOperation included
        return None


def _resource_problems(resources: Mapping[str, Mapping[str, str]]) -> list[str]:
    problems = []
    parsed: dict[str, dict[str, Decimal]] = {}
    for kind, amounts in resources.items():
        if kind not in RESOURCE_KINDS:
            problems.append(f"{kind!r} is not one of {', '.join(RESOURCE_KINDS)}")
            continue
        if not isinstance(amounts, Mapping):
            problems.append(f"{kind} must map resource names to quantities")
            continue
        for name, quantity in amounts.items():
            number = parse_quantity(quantity)
            if not isinstance(name, str) or not is_qualified_name(name):
                problems.append(f"{kind}: {name!r} is not a valid resource name")
            elif number is None:
                problems.append(f"{kind}: {name}: {quantity!r} is not a quantity (like 100m, 64Mi, 2)")
            else:
                parsed.setdefault(kind, {})[name] = number
    for name, request in parsed.get("requests", {}).items():
        limit = parsed.get("limits", {}).get(name)
        if limit is not None and request > limit:
            request_text, limit_text = resources["requests"][name], resources["limits"][name]
            problems.append(f"requests: {name}: {request_text} is more than its limit {limit_text}")
    return problems
