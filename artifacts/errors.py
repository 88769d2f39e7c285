"""The object store's errors, in the project's one tree (`core.errors`): a store that cannot be
reached is Transient (delivery tries again, nothing is recorded), a result that is not what its
reference says is Permanent (the dispatch fails with that reason)."""

from __future__ import annotations

from k8s_dispatch.core.errors import Permanent, Transient


class ObjectStoreUnavailable(Transient):
    """The store did not answer, answered 5xx, or refused our credentials."""

    reason = "ObjectStoreUnavailable"


class InvalidResultReference(Permanent):
    """A termination message that should name an uploaded result does not (malformed, or
    naming a key that is not its attempt's)."""

    reason = "InvalidResultReference"


class ResultObjectMissing(Permanent):
    """The reference names an object the store does not hold (an upload that never finished)."""

    reason = "ResultObjectMissing"


class ResultObjectMismatch(Permanent):
    """The object's size or SHA-256 differs from its reference."""

    reason = "ResultObjectMismatch"


class ResultTooLarge(Permanent):
    """The result is larger than its capability's `maxResultBytes`."""

    reason = "ResultTooLarge"


class NoStoredResult(Permanent):
    """The dispatch has no result in the object store (not ended, failed, or a small result)."""

    reason = "NoStoredResult"
