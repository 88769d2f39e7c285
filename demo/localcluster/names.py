"""Kubernetes' name and label syntax as kube-apiserver checks it (k8s.io/apimachinery's
util/validation), written here from those rules on purpose: the cluster the client is judged
against must not share the client's code (core/names.py), or a bug in one would hide in both.
Character by character, no regular expressions (Python's `$` would let a trailing newline by).
"""

from __future__ import annotations

_LOWER_ALNUM = frozenset("abcdefghijklmnopqrstuvwxyz0123456789")
_ALNUM = _LOWER_ALNUM | frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZ")


def _alnum_ends_and_inner(value: str, *, ends: frozenset[str], inner: frozenset[str]) -> bool:
    """Non-empty, first and last characters in `ends`, every character in `ends | inner`."""
    return bool(value) and value[0] in ends and value[-1] in ends and all(c in ends or c in inner for c in value)


def dns1123_label(value: str) -> bool:
    """RFC 1123 label: at most 63 of [a-z0-9-], starting and ending alphanumeric."""
    return len(value) <= 63 and _alnum_ends_and_inner(value, ends=_LOWER_ALNUM, inner=frozenset("-"))


def dns1123_subdomain(value: str) -> bool:
    """RFC 1123 subdomain: at most 253 characters, dot-separated labels (each label's length is
    bounded only by the whole)."""
    if not value or len(value) > 253:
        return False
    return all(_alnum_ends_and_inner(part, ends=_LOWER_ALNUM, inner=frozenset("-")) for part in value.split("."))


def label_value(value: str) -> bool:
    """Empty, or at most 63 of [A-Za-z0-9-_.], starting and ending alphanumeric."""
    return value == "" or (len(value) <= 63 and _alnum_ends_and_inner(value, ends=_ALNUM, inner=frozenset("-_.")))


def qualified_name(key: str) -> bool:
    """A label or annotation key: an optional DNS subdomain prefix and `/`, then a name of at
    most 63 of [A-Za-z0-9-_.], starting and ending alphanumeric."""
    prefix, slash, name = key.rpartition("/")
    if slash and not dns1123_subdomain(prefix):
        return False
    return len(name) <= 63 and _alnum_ends_and_inner(name, ends=_ALNUM, inner=frozenset("-_."))
