"""Kubernetes name and label syntax, shared by the manifest builder and the settings (the client's
one definition of what Kubernetes accepts; localcluster has its own, written apart, and a test
holds the two to the same table). `fullmatch`: Python's `$` would let a trailing newline by."""

from __future__ import annotations

import re

DNS1123_LABEL_MAX = 63
DNS1123_SUBDOMAIN_MAX = 253
LABEL_VALUE_MAX = 63
LABEL_NAME_MAX = 63

_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def is_dns1123_label(value: str) -> bool:
    return len(value) <= DNS1123_LABEL_MAX and bool(_DNS1123_LABEL.fullmatch(value))


def is_dns1123_subdomain(value: str) -> bool:
    return len(value) <= DNS1123_SUBDOMAIN_MAX and bool(_DNS1123_SUBDOMAIN.fullmatch(value))


def is_label_value(value: str) -> bool:
    return len(value) <= LABEL_VALUE_MAX and bool(_LABEL_VALUE.fullmatch(value))


def is_qualified_name(key: str) -> bool:
    """A label or annotation key: optional DNS-1123 subdomain prefix, `/`, and a name."""
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or not is_dns1123_subdomain(prefix)):
        return False
    return len(name) <= LABEL_NAME_MAX and bool(_QUALIFIED_NAME.fullmatch(name))
