"""API errors as the real server reports them: `Status` objects with code, reason, message
and details (apimachinery `pkg/api/errors`), and field errors for 422 Invalid.

Handlers raise `ApiError`; the server turns it into the JSON body clients parse.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Any

from k8s_dispatch.demo.localcluster.resources import Resource


class FieldErrorType(Enum):
    REQUIRED = ("FieldValueRequired", "Required value")
    INVALID = ("FieldValueInvalid", "Invalid value")
    NOT_SUPPORTED = ("FieldValueNotSupported", "Unsupported value")
    FORBIDDEN = ("FieldValueForbidden", "Forbidden")
    TOO_LONG = ("FieldValueTooLong", "Too long")
    DUPLICATE = ("FieldValueDuplicate", "Duplicate value")
    TOO_MANY = ("FieldValueTooMany", "Too many")

    @property
    def reason(self) -> str:
        return self.value[0]

    @property
    def label(self) -> str:
        return self.value[1]


_NO_VALUE = object()


class GoText(str):
    """A value already written as kube-apiserver writes it (a Go struct's JSON, its fields in
    declaration order and capitalised): shown as is."""


def _go_value(value: Any) -> str:
    if isinstance(value, GoText):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return str(value)
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


@dataclass(frozen=True)
class FieldError:
    """One field error, worded as k8s.io/apimachinery/pkg/util/validation/field does."""

    type: FieldErrorType
    field: str
    value: Any = _NO_VALUE
    detail: str = ""

    def body(self) -> str:
        text = self.type.label
        shows_value = self.type in (
            FieldErrorType.INVALID,
            FieldErrorType.NOT_SUPPORTED,
            FieldErrorType.DUPLICATE,
            FieldErrorType.TOO_MANY,
        )
        if shows_value and self.value is not _NO_VALUE:
            text += f": {_go_value(self.value)}"
        if self.detail:
            text += f": {self.detail}"
        return text

    def __str__(self) -> str:
        return f"{self.field}: {self.body()}"


def required(field: str, detail: str = "") -> FieldError:
    return FieldError(FieldErrorType.REQUIRED, field, detail=detail)


def invalid_value(field: str, value: Any, detail: str) -> FieldError:
    return FieldError(FieldErrorType.INVALID, field, value, detail)


def not_supported(field: str, value: Any, supported: list[str]) -> FieldError:
    detail = "supported values: " + ", ".join(json.dumps(s) for s in supported)
    return FieldError(FieldErrorType.NOT_SUPPORTED, field, value, detail)


def forbidden(field: str, detail: str) -> FieldError:
    return FieldError(FieldErrorType.FORBIDDEN, field, detail=detail)


def too_long(field: str, limit: int) -> FieldError:
    return FieldError(FieldErrorType.TOO_LONG, field, detail=f"may not be more than {limit} bytes")


class ApiError(Exception):
    """An error answer: HTTP code, Status reason, message and optional details/headers."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        *,
        details: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details
        self.headers = headers or {}

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
        }
        if self.details is not None:
            body["details"] = self.details
        body["code"] = self.code
        return body


def _details(resource: Resource, name: str) -> dict[str, Any]:
    details: dict[str, Any] = {"name": name, "kind": resource.plural}
    if resource.group:
        details["group"] = resource.group
    return details


def not_found(resource: Resource, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{resource.qualified} "{name}" not found', details=_details(resource, name))


def already_exists(resource: Resource, name: str) -> ApiError:
    return ApiError(
        409, "AlreadyExists", f'{resource.qualified} "{name}" already exists', details=_details(resource, name)
    )


def conflict(resource: Resource, name: str, why: str) -> ApiError:
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {resource.qualified} "{name}": {why}',
        details=_details(resource, name),
    )


STALE_WRITE = "the object has been modified; please apply your changes to the latest version and try again"


def invalid(resource: Resource, name: str, errors: list[FieldError]) -> ApiError:
    listed = str(errors[0]) if len(errors) == 1 else "[" + ", ".join(str(e) for e in errors) + "]"
    details: dict[str, Any] = {"name": name, "kind": resource.kind}
    if resource.group:
        details["group"] = resource.group
    details["causes"] = [{"reason": e.type.reason, "message": e.body(), "field": e.field} for e in errors]
    return ApiError(422, "Invalid", f'{resource.qualified_kind} "{name}" is invalid: {listed}', details=details)


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def forbidden_request(resource: Resource, name: str, message: str) -> ApiError:
    return ApiError(403, "Forbidden", message, details=_details(resource, name))


def unauthorized() -> ApiError:
    return ApiError(401, "Unauthorized", "Unauthorized")


def gone(message: str) -> ApiError:
    return ApiError(410, "Expired", message)


def method_not_allowed() -> ApiError:
    return ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")


def unsupported_media_type(content_type: str) -> ApiError:
    return ApiError(
        415,
        "UnsupportedMediaType",
        f"the body of the request was in an unknown format - accepted media types include: application/json, application/merge-patch+json, application/strategic-merge-patch+json, application/json-patch+json (got {content_type!r})",
    )


def not_acceptable() -> ApiError:
    return ApiError(406, "NotAcceptable", "only the following media types are accepted: application/json")


def path_not_found() -> ApiError:
    return ApiError(404, "NotFound", "the server could not find the requested resource")
