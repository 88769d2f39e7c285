"""The one error tree of k8s-dispatch.

It lives in the lowest package so that every other package can import it. Two branches
drive behaviour: `Transient` errors are retried with backoff by the tasks; `Permanent`
errors fail at once with a reason the engine can show (`reason` is a short CamelCase word,
as Kubernetes uses for condition reasons).
"""

from __future__ import annotations


class DispatchError(Exception):
    """Base of every error this project raises on purpose."""

    reason: str = "Error"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason

    @property
    def message(self) -> str:
        return str(self)


# --- Transient: retry with backoff -------------------------------------------------------


class Transient(DispatchError):
    """Something outside us is unavailable for now; the same call may succeed later."""

    reason = "Transient"


class ApiUnavailable(Transient):
    """The Kubernetes API answered 5xx or 429, or could not be reached."""

    reason = "ApiUnavailable"


class PodLogUnavailable(ApiUnavailable):
    """A Pod's container log, to be archived before its release, could not be read for now (the
    API or the Pod's node answered 5xx or 429, or did not answer): the Pod keeps our finalizer and
    the release is tried again, as for any API outage (`artifacts.logs.archive_logs`)."""

    reason = "PodLogUnavailable"


class QuotaExceeded(Transient):
    """The namespace's ResourceQuota has no room for the object now (403 "exceeded quota"):
    a Job ending or being deleted frees it, so the create is retried, not failed."""

    reason = "QuotaExceeded"


class AuthorizationNotReady(Transient):
    """A 403 whose reason is that the authorizer has not read its RBAC objects yet ("RBAC:
    clusterrole ... not found": a kube-apiserver in its first second, kubernetes#121635, or a
    binding to a Role being created): retried, so work that never ran is not failed for it."""

    reason = "AuthorizationNotReady"


class DatabaseUnavailable(Transient):
    """The database could not be reached or dropped the connection."""

    reason = "DatabaseUnavailable"


class GuardUnavailable(Transient):
    """Redis (the cross-replica guard) could not be reached."""

    reason = "GuardUnavailable"


# --- Permanent: fail at once ---------------------------------------------------------------


class Permanent(DispatchError):
    """Retrying cannot help: the input, the config or the cluster's answer is wrong."""

    reason = "Permanent"


class ConfigError(Permanent):
    """Settings or the capability file are invalid; raised at start, naming what is wrong."""

    reason = "ConfigError"


class InvalidInput(Permanent):
    """A schedule request is malformed (ids, idempotency key, input)."""

    reason = "InvalidInput"


class InvalidId(InvalidInput):
    reason = "InvalidId"


class InvalidIdempotencyKey(InvalidInput):
    reason = "InvalidIdempotencyKey"


class InputNotSerialisable(InvalidInput):
    reason = "InputNotSerialisable"


class InputTooLarge(InvalidInput):
    reason = "InputTooLarge"


class SecretInputKeyMissing(ConfigError):
    """A secret input was scheduled and no `K8S_DISPATCH_INPUT_KEY` is set: it cannot be kept
    encrypted, so it is not kept at all."""

    reason = "SecretInputKeyMissing"


class SecretInputUnreadable(Permanent):
    """A dispatch's secret input cannot be decrypted with any configured key (its key was
    rotated away while it waited): its Job cannot be given its input."""

    reason = "SecretInputUnreadable"


class IdempotencyConflict(InvalidInput):
    """The idempotency key was used before for a different request (case, capability, input)."""

    reason = "IdempotencyConflict"


class UnknownCase(Permanent):
    reason = "UnknownCase"


class TenancyMismatch(Permanent):
    """The tenancy given (or read from a Job) disagrees with the case's tenancy in the DB."""

    reason = "TenancyMismatch"


class UnknownCapability(Permanent):
    reason = "UnknownCapability"


class UnknownDispatch(Permanent):
    reason = "UnknownDispatch"


class LabelMismatch(Permanent):
    """A Job's labels disagree with its annotations or with the DB: it is never delivered."""

    reason = "LabelMismatch"


class InvalidManifest(Permanent):
    """A Job manifest cannot be built from these values (a name or label is invalid)."""

    reason = "InvalidManifest"


class ApiRejected(Permanent):
    """The Kubernetes API refused the request for good (400, 403, 422)."""

    reason = "ApiRejected"


class NotFound(Permanent):
    """The Kubernetes object does not exist (404)."""

    reason = "NotFound"


class AlreadyExists(Permanent):
    """The Kubernetes object exists already (409 AlreadyExists)."""

    reason = "AlreadyExists"


class Conflict(Transient):
    """An update raced another (409 Conflict): re-read and try again."""

    reason = "Conflict"


class BrokerUnavailable(Transient):
    """The Celery broker could not take a message (an enqueue or a notification)."""

    reason = "BrokerUnavailable"


class ScheduleNotRecorded(Transient):
    """A schedule sent by task call was not recorded before the deadline (no worker ran it, or
    it refused the request): sending again with the same idempotency key is safe."""

    reason = "ScheduleNotRecorded"
