"""A capability's spec: how to run it, with the defaults of every field (pure data).
Built by the resolver from the capabilities file; read by the manifest builder, the Pod failure
policy and the start clocks, which therefore never import the resolver."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from k8s_dispatch.workers.types import CapabilityName, WorkerName

# No deadline by default would let a pod that never starts (a bad image: ImagePullBackOff)
# hold its dispatch open for ever; one hour ends it with DeadlineExceeded. `null` opts out.
DEFAULT_ACTIVE_DEADLINE_S = 3600
# One pod per dispatch: a failure is reported at once instead of after minutes of pod
# retries, and work that is not idempotent is not run twice behind the engine's back.
# Retrying is the engine's decision; a capability that wants pod retries sets backoffLimit.
DEFAULT_BACKOFF_LIMIT = 0

# The clocks of a dispatch whose Job exists, until its container starts (workers/pod_health.py).
DEFAULT_START_TIMEOUT_S = 600
DEFAULT_IMAGE_PULL_TIMEOUT_S = 300
DEFAULT_CONFIG_ERROR_TIMEOUT_S = 60  # the Secret or ConfigMap may appear meanwhile
# A dispatch disrupted more often than this (evictions, preemptions, nodes lost) fails Disrupted.
DEFAULT_MAX_DISRUPTIONS = 3

EMPTY: Mapping[str, Any] = MappingProxyType({})

# Where a capability's results go: its container's termination message (JSON, at most 4 KiB),
# or the object store (any bytes, up to `max_result_bytes`), the message then a reference.
RESULTS_TERMINATION_MESSAGE = "terminationMessage"
RESULTS_OBJECT_STORE = "objectStore"
RESULTS_KINDS = (RESULTS_TERMINATION_MESSAGE, RESULTS_OBJECT_STORE)
DEFAULT_MAX_RESULT_BYTES = 1 << 30  # 1 GiB: a result larger than this fails ResultTooLarge
MAX_RESULT_BYTES_LIMIT = 5 * (1 << 40)  # S3's largest object

# Whose container log is copied to the object store before our finalizer leaves its Pod.
ARCHIVE_LOGS_ON_FAILURE = "onFailure"  # a Pod that failed (the logs worth keeping, at little cost)
ARCHIVE_LOGS_ALWAYS = "always"
ARCHIVE_LOGS_NEVER = "never"
ARCHIVE_LOGS_KINDS = (ARCHIVE_LOGS_ON_FAILURE, ARCHIVE_LOGS_ALWAYS, ARCHIVE_LOGS_NEVER)


@dataclass(frozen=True)
class StartPolicy:
    """A capability's clocks once its Job exists (seconds): the container must start within
    `start_timeout_s` of the Job's creation (of its resume, if it was queued); a Pod waiting on an image pull is given up after
    `image_pull_timeout_s`, one waiting on its config (a missing Secret) after
    `config_error_timeout_s`, both counted from the Pod's scheduling; InvalidImageName at once."""

    start_timeout_s: int = DEFAULT_START_TIMEOUT_S
    image_pull_timeout_s: int = DEFAULT_IMAGE_PULL_TIMEOUT_S
    config_error_timeout_s: int = DEFAULT_CONFIG_ERROR_TIMEOUT_S


@dataclass(frozen=True)
class CapabilitySpec:
    """How to run one capability: everything `manifest.build_job` needs besides the dispatch."""

    name: CapabilityName
    worker_name: WorkerName
    image: str
    command: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=lambda: EMPTY)
    resources: Mapping[str, Mapping[str, str]] = field(default_factory=lambda: EMPTY)
    namespace: str | None = None
    active_deadline_seconds: int | None = DEFAULT_ACTIVE_DEADLINE_S
    backoff_limit: int = DEFAULT_BACKOFF_LIMIT
    labels: Mapping[str, str] = field(default_factory=lambda: EMPTY)
    annotations: Mapping[str, str] = field(default_factory=lambda: EMPTY)
    # The Job runs under the `restricted` Pod Security profile except for these (name -> reason).
    run_as_user: int | None = None
    run_as_group: int | None = None
    security_overrides: Mapping[str, str] = field(default_factory=lambda: EMPTY)
    # The clocks of a dispatch before its container runs (workers/pod_health.py): None = no limit.
    queue_timeout_seconds: int | None = None
    start_timeout_seconds: int = DEFAULT_START_TIMEOUT_S
    image_pull_timeout_seconds: int = DEFAULT_IMAGE_PULL_TIMEOUT_S
    config_error_timeout_seconds: int = DEFAULT_CONFIG_ERROR_TIMEOUT_S
    # The Job's podFailurePolicy (workers/failure_policy.py) and how many disruptions a dispatch
    # survives before it fails with reason Disrupted.
    retry_on_exit_codes: tuple[int, ...] = ()
    fail_on_exit_codes: tuple[int, ...] = ()
    max_disruptions: int = DEFAULT_MAX_DISRUPTIONS
    # A Kueue LocalQueue in the Job's namespace: the Job is created suspended with Kueue's
    # queue-name label, and runs when Kueue admits (unsuspends) it. None: it runs at once.
    queue: str | None = None
    # `objectStore`: results are uploaded through a presigned URL of the attempt and verified
    # (size, SHA-256) before they are recorded; at most `max_result_bytes`.
    results: str = RESULTS_TERMINATION_MESSAGE
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES
    # Which Pods' logs are archived (`artifacts.logs`); a no-op without an object store.
    archive_logs: str = ARCHIVE_LOGS_ON_FAILURE

    @property
    def results_in_object_store(self) -> bool:
        return self.results == RESULTS_OBJECT_STORE

    def archives_log(self, *, failed: bool) -> bool:
        """Whether a Pod of this capability that ended so (`failed`) has its log archived."""
        return self.archive_logs == ARCHIVE_LOGS_ALWAYS or (failed and self.archive_logs == ARCHIVE_LOGS_ON_FAILURE)

    @property
    def start_policy(self) -> StartPolicy:
        return StartPolicy(
            start_timeout_s=self.start_timeout_seconds,
            image_pull_timeout_s=self.image_pull_timeout_seconds,
            config_error_timeout_s=self.config_error_timeout_seconds,
        )
