"""Secrets and ConfigMaps as kube-apiserver takes them (pure): decoding (`data` and `binaryData`
values are base64, refused as Go's decoder refuses them; `stringData` is merged into `data` and
not stored; a Secret's `type` defaults to Opaque) and validation (config keys, the 1 MiB limit,
the keys each built-in Secret type requires, `type` and an `immutable` object's data unchangeable).

What a container's env reads from them is resolved by the node (containerenv.py).
"""

from __future__ import annotations

import base64
from typing import Any

from k8s_dispatch.demo.localcluster.apierrors import FieldError, forbidden, invalid_value, required, too_long

MAX_SIZE = 1 << 20  # corev1.MaxSecretSize, the limit of a ConfigMap too
_ALPHABET = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")
_KEY_CHARS = frozenset("-._abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
_KEY_MSG = (
    "a valid config key must consist of alphanumeric characters, '-', '_' or '.' (e.g. 'key.name',  or "
    "'KEY_NAME',  or 'key-name', regex used for validation is '[-._a-zA-Z0-9]+')"
)
IMMUTABLE_MSG = "field is immutable when `immutable` is set"
# The keys each built-in Secret type must hold (pkg/apis/core/validation ValidateSecret).
REQUIRED_KEYS = {
    "kubernetes.io/dockercfg": (".dockercfg",),
    "kubernetes.io/dockerconfigjson": (".dockerconfigjson",),
    "kubernetes.io/ssh-auth": ("ssh-privatekey",),
    "kubernetes.io/tls": ("tls.crt", "tls.key"),
}
SERVICE_ACCOUNT_NAME = "kubernetes.io/service-account.name"


def base64_error(text: str) -> int | None:
    """The offset Go's base64.StdEncoding names in `illegal base64 data at input byte N`, or None
    when `text` decodes (newlines are skipped, padding is required, nothing may follow it)."""
    j, si, n = 0, 0, len(text)
    while si < n:
        c = text[si]
        si += 1
        if c in "\r\n":
            continue
        if c == "=":
            if j < 2:
                return si - 1
            if j == 2:  # a second `=` must follow
                while si < n and text[si] in "\r\n":
                    si += 1
                if si == n:
                    return n
                if text[si] != "=":
                    return si - 1
                si += 1
            while si < n and text[si] in "\r\n":
                si += 1
            return si if si < n else None
        if c not in _ALPHABET:
            return si - 1
        j = (j + 1) % 4
    return None if j == 0 else si - j


def decode_bytes(text: str) -> bytes:
    """The bytes of a value `base64_error` accepted."""
    return base64.b64decode(text.replace("\r", "").replace("\n", ""))


def decode(obj: dict[str, Any], kind: str) -> str | None:
    """Bring a decoded Secret or ConfigMap to its stored form in place, as kube-apiserver's
    decoding and defaulting do; the decode error's text if a value is not base64."""
    fields = ("data",) if kind == "Secret" else ("binaryData",)
    for name in fields:
        values = obj.get(name) or {}
        for key, value in values.items():
            at = base64_error(value)
            if at is not None:
                return f"illegal base64 data at input byte {at}"
            values[key] = base64.b64encode(decode_bytes(value)).decode()  # written back canonical
    if kind == "Secret":
        strings = obj.pop("stringData", None) or {}
        if strings:
            data = dict(obj.get("data") or {})
            data.update({k: base64.b64encode(v.encode()).decode() for k, v in strings.items()})
            obj["data"] = data
        if not obj.get("type"):
            obj["type"] = "Opaque"
    return None


def key_errors(field: str, key: str) -> list[FieldError]:
    """IsConfigMapKey, one error per message, at `field[key]`."""
    path = f"{field}[{key}]"
    errs = []
    if len(key) > 253:
        errs.append(invalid_value(path, key, "must be no more than 253 characters"))
    if not key or any(c not in _KEY_CHARS for c in key):
        errs.append(invalid_value(path, key, _KEY_MSG))
    if key == ".":
        errs.append(invalid_value(path, key, "must not be '.'"))
    elif key == "..":
        errs.append(invalid_value(path, key, "must not be '..'"))
    elif key.startswith(".."):
        errs.append(invalid_value(path, key, "must not start with '..'"))
    return errs


def validate_secret(secret: dict[str, Any]) -> list[FieldError]:
    data = secret.get("data") or {}
    errs: list[FieldError] = []
    size = 0
    for key, value in data.items():
        errs += key_errors("data", key)
        size += len(key) + len(decode_bytes(value))
    if size > MAX_SIZE:
        errs.append(too_long("data", MAX_SIZE))
    kind = secret.get("type") or "Opaque"
    if kind == "kubernetes.io/service-account-token":
        annotations = (secret.get("metadata") or {}).get("annotations") or {}
        if not annotations.get(SERVICE_ACCOUNT_NAME):
            errs.append(required(f"metadata.annotations[{SERVICE_ACCOUNT_NAME}]"))
    elif kind == "kubernetes.io/basic-auth" and "username" not in data and "password" not in data:
        errs += [required("data[username]"), required("data[password]")]
    for key in REQUIRED_KEYS.get(kind, ()):
        if key not in data:
            errs.append(required(f"data[{key}]"))
    return errs


def validate_config_map(config_map: dict[str, Any]) -> list[FieldError]:
    data = config_map.get("data") or {}
    binary = config_map.get("binaryData") or {}
    errs: list[FieldError] = []
    size = 0
    for key, value in data.items():
        errs += key_errors("data", key)
        size += len(key) + len(value.encode())
    for key, value in binary.items():
        errs += key_errors("binaryData", key)
        if key in data:
            errs.append(invalid_value(f"binaryData[{key}]", key, "duplicate of key present in data"))
        size += len(key) + len(decode_bytes(value))
    if size > MAX_SIZE:
        errs.append(too_long("", MAX_SIZE))
    return errs


def validate_update(old: dict[str, Any], new: dict[str, Any], kind: str) -> list[FieldError]:
    """What may not change: a Secret's type, and an immutable object's data and immutability."""
    errs: list[FieldError] = []
    if kind == "Secret" and new.get("type") != old.get("type"):
        errs.append(invalid_value("type", new.get("type"), "field is immutable"))
    if old.get("immutable"):
        if not new.get("immutable"):
            errs.append(forbidden("immutable", IMMUTABLE_MSG))
        for name in ("data",) if kind == "Secret" else ("data", "binaryData"):
            if (new.get(name) or {}) != (old.get(name) or {}):
                errs.append(forbidden(name, IMMUTABLE_MSG))
    return errs
