"""workers/resolver.py: the clocks of a capability (queue, start, image pull, config error) are
read, defaulted and checked when the resolver is built, each bad value naming file, capability
and field."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from k8s_dispatch.core.errors import ConfigError
from k8s_dispatch.workers.capability import StartPolicy
from k8s_dispatch.workers.resolver import CapabilityResolver


def minimal(**fields: Any) -> dict[str, Any]:
    return {"capabilities": {"cap.one": {"worker": "w1", "image": "img:1", **fields}}}


def test_the_clocks_default_to_no_queue_limit_and_600_300_60() -> None:
    spec = CapabilityResolver.from_mapping(minimal()).spec("cap.one")
    assert spec.queue_timeout_seconds is None
    assert spec.start_policy == StartPolicy(start_timeout_s=600, image_pull_timeout_s=300, config_error_timeout_s=60)


def test_the_clocks_are_read_from_a_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "caps.yaml"
    path.write_text(
        "capabilities:\n  cap.one:\n    worker: w1\n    image: img:1\n    queueTimeoutSeconds: 900\n"
        "    startTimeoutSeconds: 120\n    imagePullTimeoutSeconds: 45\n    configErrorTimeoutSeconds: 5\n"
    )
    spec = CapabilityResolver.from_file(path).spec("cap.one")
    assert spec.queue_timeout_seconds == 900
    assert spec.start_policy == StartPolicy(start_timeout_s=120, image_pull_timeout_s=45, config_error_timeout_s=5)


def test_a_null_queue_timeout_means_no_limit() -> None:
    assert (
        CapabilityResolver.from_mapping(minimal(queueTimeoutSeconds=None)).spec("cap.one").queue_timeout_seconds is None
    )


@pytest.mark.parametrize(
    ("fields", "complaint"),
    [
        ({"queueTimeoutSeconds": 0}, "field 'queueTimeoutSeconds': 0 is not a positive integer"),
        ({"queueTimeoutSeconds": "60"}, "field 'queueTimeoutSeconds': must be an integer, not str"),
        ({"startTimeoutSeconds": None}, "field 'startTimeoutSeconds': must be an integer, not null"),
        ({"startTimeoutSeconds": -5}, "field 'startTimeoutSeconds': -5 is not a positive integer"),
        ({"startTimeoutSeconds": 2**31}, "field 'startTimeoutSeconds': 2147483648 is not a positive integer"),
        ({"imagePullTimeoutSeconds": 1.5}, "field 'imagePullTimeoutSeconds': must be an integer, not float"),
        ({"imagePullTimeoutSeconds": 0}, "field 'imagePullTimeoutSeconds': 0 is not a positive integer"),
        ({"configErrorTimeoutSeconds": True}, "field 'configErrorTimeoutSeconds': must be an integer, not bool"),
        ({"startTimeout": 5}, "field 'startTimeout': unknown field"),
    ],
)
def test_bad_clocks_stop_the_start_naming_file_capability_and_field(fields: dict[str, Any], complaint: str) -> None:
    with pytest.raises(ConfigError) as raised:
        CapabilityResolver.from_mapping(minimal(**fields), source="caps.yaml")
    assert f"caps.yaml: capability 'cap.one': {complaint}" in str(raised.value)


def test_every_bad_clock_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as raised:
        CapabilityResolver.from_mapping(minimal(startTimeoutSeconds=0, configErrorTimeoutSeconds=0), source="c.json")
    text = str(raised.value)
    assert "'startTimeoutSeconds'" in text and "'configErrorTimeoutSeconds'" in text


def test_a_hand_built_spec_with_a_bad_clock_is_refused_too() -> None:
    spec = CapabilityResolver.from_mapping(minimal()).spec("cap.one")
    with pytest.raises(ConfigError, match="field 'imagePullTimeoutSeconds'"):
        CapabilityResolver({"cap.one": replace(spec, image_pull_timeout_seconds=0)}, source="<code>")
