"""workers/resolver.py: capability config is loaded and fully checked when the resolver is built."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from k8s_dispatch.core.errors import ConfigError, UnknownCapability
from k8s_dispatch.core.settings import load_settings
from k8s_dispatch.workers.backends import Worker
from k8s_dispatch.workers.capability import DEFAULT_ACTIVE_DEADLINE_S, CapabilitySpec
from k8s_dispatch.workers.resolver import CapabilityResolver, demo_config, demo_resolver

GOOD_YAML = """\
capabilities:
  text.upper:
    worker: text-worker
    image: registry.example.com/text:1.2
    command: [python, -m, k8s_dispatch.container.runner]
    args: ["text.funcs:upper"]
    env: {LOG_LEVEL: info}
    resources:
      requests: {cpu: 100m, memory: 64Mi}
      limits: {cpu: 1, memory: 128Mi}
    namespace: jobs
    activeDeadlineSeconds: 600
    backoffLimit: 2
    labels: {team: text}
    annotations: {example.com/owner: "me"}
  text.lower:
    worker: text-worker
    image: registry.example.com/text:1.2
  images/thumbnail:
    worker: images
    image: registry.example.com/img:3
    activeDeadlineSeconds: null
"""


def minimal(**fields: Any) -> dict[str, Any]:
    """A config with one capability `cap.one`: worker and image set, `fields` merged in."""
    return {"capabilities": {"cap.one": {"worker": "w1", "image": "img:1", **fields}}}


def test_yaml_file_loads_every_field(tmp_path: Path) -> None:
    path = tmp_path / "caps.yaml"
    path.write_text(GOOD_YAML)
    resolver = CapabilityResolver.from_file(path)
    assert resolver.capabilities() == {"text.upper", "text.lower", "images/thumbnail"}
    spec = resolver.spec("text.upper")
    assert spec == CapabilitySpec(
        name="text.upper",
        worker_name="text-worker",
        image="registry.example.com/text:1.2",
        command=("python", "-m", "k8s_dispatch.container.runner"),
        args=("text.funcs:upper",),
        env={"LOG_LEVEL": "info"},
        resources={"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"cpu": "1", "memory": "128Mi"}},
        namespace="jobs",
        active_deadline_seconds=600,
        backoff_limit=2,
        labels={"team": "text"},
        annotations={"example.com/owner": "me"},
    )
    assert resolver.worker_for("images/thumbnail") == "images"
    assert resolver.workers() == (
        Worker("images", frozenset({"images/thumbnail"})),
        Worker("text-worker", frozenset({"text.upper", "text.lower"})),
    )
    assert resolver.namespaces("default") == {"jobs", "default"}
    assert "text.lower" in resolver and "text.LOWER" not in resolver
    assert resolver.source == str(path)


def test_defaults(tmp_path: Path) -> None:
    path = tmp_path / "caps.yaml"
    path.write_text(GOOD_YAML)
    resolver = CapabilityResolver.from_file(path)
    lower = resolver.spec("text.lower")
    assert (lower.command, lower.args, dict(lower.env), dict(lower.resources)) == ((), (), {}, {})
    assert lower.namespace is None
    assert lower.active_deadline_seconds == DEFAULT_ACTIVE_DEADLINE_S == 3600
    assert lower.backoff_limit == 0
    assert resolver.spec("images/thumbnail").active_deadline_seconds is None  # null: no deadline


def test_spec_is_read_only() -> None:
    spec = CapabilityResolver.from_mapping(minimal(env={"A": "1"})).spec("cap.one")
    with pytest.raises(TypeError):
        spec.env["A"] = "2"  # type: ignore[index]


@pytest.mark.parametrize("suffix", [".json", ".JSON", ".yml", ".yaml"])
def test_json_and_yaml_by_extension(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"caps{suffix}"
    path.write_text(json.dumps(minimal(backoffLimit=1)))  # JSON is YAML too; both parsers read it
    assert CapabilityResolver.from_file(path).spec("cap.one").backoff_limit == 1


def test_unknown_capability() -> None:
    resolver = demo_resolver()
    with pytest.raises(UnknownCapability, match=r"'demo.nope'.*demo.primes, demo.sha256, demo.wordcount"):
        resolver.spec("demo.nope")
    with pytest.raises(UnknownCapability):
        resolver.worker_for("demo.nope")


# Every config error names the file, the capability and the field.
@pytest.mark.parametrize(
    ("config", "capability", "field"),
    [
        # missing fields
        ({"capabilities": {"cap.one": {"image": "img"}}}, "cap.one", "worker"),
        ({"capabilities": {"cap.one": {"worker": "w1"}}}, "cap.one", "image"),
        # wrong types
        (minimal(worker=None), "cap.one", "worker"),
        (minimal(worker=7), "cap.one", "worker"),
        (minimal(image=["img"]), "cap.one", "image"),
        (minimal(command="python -m x"), "cap.one", "command"),
        (minimal(args=["a", 1]), "cap.one", "args"),
        (minimal(env={"A": 1}), "cap.one", "env"),
        (minimal(env=["A=1"]), "cap.one", "env"),
        (minimal(namespace=5), "cap.one", "namespace"),
        (minimal(activeDeadlineSeconds="60"), "cap.one", "activeDeadlineSeconds"),
        (minimal(activeDeadlineSeconds=1.5), "cap.one", "activeDeadlineSeconds"),
        (minimal(backoffLimit=True), "cap.one", "backoffLimit"),
        (minimal(backoffLimit=None), "cap.one", "backoffLimit"),
        (minimal(labels={"team": 1}), "cap.one", "labels"),
        (minimal(annotations="owner=me"), "cap.one", "annotations"),
        ({"capabilities": {"cap.one": "img:1"}}, "cap.one", "(all)"),
        ({"capabilities": {"cap.one": None}}, "cap.one", "(all)"),
        # bad names and values
        ({"capabilities": {"cap one": {"worker": "w1", "image": "img"}}}, "cap one", "name"),
        ({"capabilities": {"cap,two": {"worker": "w1", "image": "img"}}}, "cap,two", "name"),
        ({"capabilities": {"-cap": {"worker": "w1", "image": "img"}}}, "-cap", "name"),
        ({"capabilities": {"c" * 129: {"worker": "w1", "image": "img"}}}, "c" * 129, "name"),
        ({"capabilities": {42: {"worker": "w1", "image": "img"}}}, 42, "name"),  # YAML reads 42 as a number
        (minimal(worker="Worker_1"), "cap.one", "worker"),
        (minimal(worker="w" * 64), "cap.one", "worker"),
        (minimal(image=""), "cap.one", "image"),
        (minimal(image="img 1"), "cap.one", "image"),
        (minimal(namespace="Jobs"), "cap.one", "namespace"),
        (minimal(activeDeadlineSeconds=0), "cap.one", "activeDeadlineSeconds"),
        (minimal(backoffLimit=-1), "cap.one", "backoffLimit"),
        (minimal(env={"1A": "x"}), "cap.one", "env"),
        (minimal(env={"K8S_DISPATCH_INPUT": "{}"}), "cap.one", "env"),
        (minimal(labels={"k8s-dispatch.io/tenancy-id": "x"}), "cap.one", "labels"),
        (minimal(labels={"app.kubernetes.io/managed-by": "me"}), "cap.one", "labels"),
        (minimal(labels={"team": "a b"}), "cap.one", "labels"),
        (minimal(annotations={"k8s-dispatch.io/attempt": "1"}), "cap.one", "annotations"),
        # bad resources
        (minimal(resources=["cpu"]), "cap.one", "resources"),
        (minimal(resources={"requests": "100m"}), "cap.one", "resources"),
        (minimal(resources={"requests": {"cpu": "fast"}}), "cap.one", "resources"),
        (minimal(resources={"requests": {"cpu": True}}), "cap.one", "resources"),
        (minimal(resources={"requests": {"cpu": -1}}), "cap.one", "resources"),
        (minimal(resources={"requests": {"memory": [1]}}), "cap.one", "resources"),
        (minimal(resources={"wants": {"cpu": "1"}}), "cap.one", "resources"),
        (minimal(resources={"requests": {"bad name": "1"}}), "cap.one", "resources"),
        (minimal(resources={"requests": {"cpu": "2"}, "limits": {"cpu": "1500m"}}), "cap.one", "resources"),
        # bad failure policy
        (minimal(failOnExitCodes=3), "cap.one", "failOnExitCodes"),
        (minimal(failOnExitCodes=[0]), "cap.one", "failOnExitCodes"),
        (minimal(failOnExitCodes=[256]), "cap.one", "failOnExitCodes"),
        (minimal(failOnExitCodes=[3, 3]), "cap.one", "failOnExitCodes"),
        (minimal(failOnExitCodes=["3"]), "cap.one", "failOnExitCodes"),
        (minimal(failOnExitCodes=[True]), "cap.one", "failOnExitCodes"),
        (minimal(failOnExitCodes=[*range(1, 256), 1]), "cap.one", "failOnExitCodes"),
        (minimal(retryOnExitCodes=[4], failOnExitCodes=[4], backoffLimit=1), "cap.one", "failOnExitCodes"),
        (minimal(retryOnExitCodes=[4]), "cap.one", "retryOnExitCodes"),  # backoffLimit 0 retries nothing
        (minimal(maxDisruptions=-1), "cap.one", "maxDisruptions"),
        (minimal(maxDisruptions="3"), "cap.one", "maxDisruptions"),
        (minimal(maxDisruptions=1001), "cap.one", "maxDisruptions"),
        # unknown keys
        (minimal(backoff_limit=1), "cap.one", "backoff_limit"),
        (minimal(replicas=3), "cap.one", "replicas"),
    ],
)
def test_config_errors_name_file_capability_and_field(
    tmp_path: Path, config: dict[str, Any], capability: object, field: str
) -> None:
    path = tmp_path / "broken-caps.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError) as raised:
        CapabilityResolver.from_file(path)
    problem_lines = str(raised.value).splitlines()[1:]
    assert problem_lines, str(raised.value)
    expected_prefix = f"{path}: capability {capability!r}: field {field!r}: "
    assert any(line.startswith(expected_prefix) for line in problem_lines), str(raised.value)


def test_failure_fields_are_read_with_their_defaults() -> None:
    config = {
        "capabilities": {
            "plain": {"worker": "w", "image": "img"},
            "strict": {
                "worker": "w",
                "image": "img",
                "backoffLimit": 2,
                "failOnExitCodes": [3, 2],
                "retryOnExitCodes": [75],
                "maxDisruptions": 0,
            },
        }
    }
    resolver = CapabilityResolver.from_mapping(config)
    plain, strict = resolver.spec("plain"), resolver.spec("strict")
    assert (plain.fail_on_exit_codes, plain.retry_on_exit_codes, plain.max_disruptions) == ((), (), 3)
    assert (strict.fail_on_exit_codes, strict.retry_on_exit_codes, strict.max_disruptions) == ((3, 2), (75,), 0)


def test_every_problem_is_reported_at_once() -> None:
    config = {
        "capabilities": {
            "a": {"worker": "BAD", "image": "img", "backoffLimit": -1},
            "b": {"image": "img", "colour": "red"},
            "c": {"worker": "ok", "image": "img"},
        }
    }
    with pytest.raises(ConfigError) as raised:
        CapabilityResolver.from_mapping(config, source="caps.json")
    lines = str(raised.value).splitlines()[1:]
    assert lines == [
        "caps.json: capability 'a': field 'worker': 'BAD' is not a DNS-1123 label",
        "caps.json: capability 'a': field 'backoffLimit': -1 is not a non-negative integer",
        "caps.json: capability 'b': field 'colour': unknown field (known: worker, image, command, args, env, "
        "resources, namespace, activeDeadlineSeconds, backoffLimit, labels, annotations, "
        "runAsUser, runAsGroup, securityOverrides, queueTimeoutSeconds, "
        "startTimeoutSeconds, imagePullTimeoutSeconds, configErrorTimeoutSeconds, "
        "retryOnExitCodes, failOnExitCodes, maxDisruptions, queue, results, maxResultBytes, archiveLogs)",
        "caps.json: capability 'b': field 'worker': is required",
    ]


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("capabilities: [a, b]\n", "'capabilities' must be a non-empty mapping"),
        ("capabilities: {}\n", "'capabilities' must be a non-empty mapping"),
        ("capabilities:\n", "'capabilities' must be a non-empty mapping"),
        ("{}\n", "'capabilities' must be a non-empty mapping"),
        ("- a\n", "top level must be a mapping"),
        ("", "top level must be a mapping"),
        ("capabilities: {a: {worker: w, image: i}}\nextra: 1\n", "unknown top-level keys \\['extra'\\]"),
        ("capabilities: {a: {worker: w, image: i\n", "not valid YAML"),
        ("capabilities:\n  a: {worker: w, image: i}\n  a: {worker: v, image: j}\n", "duplicate key 'a'"),
        ("capabilities:\n  a: {worker: w, worker: v, image: i}\n", "duplicate key 'worker'"),
    ],
)
def test_file_level_errors_name_the_file(tmp_path: Path, text: str, complaint: str) -> None:
    path = tmp_path / "caps.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=complaint) as raised:
        CapabilityResolver.from_file(path)
    assert str(path) in str(raised.value)


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        (
            '{"capabilities": {"a": {"worker": "w", "image": "i"}, "a": {"worker": "v", "image": "j"}}}',
            "duplicate keys \\['a'\\]",
        ),
        ('{"capabilities": ', "not valid JSON"),
        ("capabilities: {}", "not valid JSON"),  # YAML in a .json file
    ],
)
def test_json_file_errors(tmp_path: Path, text: str, complaint: str) -> None:
    path = tmp_path / "caps.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=complaint) as raised:
        CapabilityResolver.from_file(path)
    assert str(path) in str(raised.value)


def test_unreadable_files(tmp_path: Path) -> None:
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError, match=f"{missing}: cannot read"):
        CapabilityResolver.from_file(missing)
    wrong_kind = tmp_path / "caps.toml"
    wrong_kind.write_text("[capabilities]\n")
    with pytest.raises(ConfigError, match=f"{wrong_kind}: capability file must end in"):
        CapabilityResolver.from_file(wrong_kind)
    binary = tmp_path / "caps.yaml"
    binary.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ConfigError, match=f"{binary}: cannot read"):
        CapabilityResolver.from_file(binary)


def test_direct_construction_checks_specs_too() -> None:
    good = demo_resolver().spec("demo.sha256")
    with pytest.raises(ConfigError, match=r"'demo.sha256': field 'name'"):
        CapabilityResolver({"demo.sha256": replace(good, name="other")}, source="code")
    with pytest.raises(ConfigError, match="code: no capability is defined"):
        CapabilityResolver({}, source="code")


def test_demo_resolver() -> None:
    resolver = demo_resolver(image="local:dev", python="/usr/bin/python3")
    assert resolver.capabilities() == {"demo.wordcount", "demo.sha256", "demo.primes"}
    assert [str(w) for w in resolver.workers()] == ["demo-math:demo.primes", "demo-text:demo.sha256,demo.wordcount"]
    spec = resolver.spec("demo.primes")
    assert spec.image == "local:dev"
    assert spec.command == ("/usr/bin/python3", "-m", "k8s_dispatch.container.runner")
    assert spec.args == ("k8s_dispatch.demo.functions:primes",)


def test_demo_config_can_be_extended() -> None:
    config = demo_config()
    config["capabilities"]["demo.sleep"] = {
        **config["capabilities"]["demo.primes"],
        "args": ["k8s_dispatch.demo.functions:sleep"],
        "activeDeadlineSeconds": 2,
    }
    resolver = CapabilityResolver.from_mapping(config, source="test")
    assert resolver.spec("demo.sleep").active_deadline_seconds == 2
    assert len(demo_resolver().capabilities()) == 3  # the original is untouched


def test_from_settings(tmp_path: Path) -> None:
    assert CapabilityResolver.from_settings(load_settings({})).source == "<demo>"
    path = tmp_path / "caps.yaml"
    path.write_text(GOOD_YAML)
    resolver = CapabilityResolver.from_settings(load_settings({"K8S_DISPATCH_CAPABILITIES": str(path)}))
    assert resolver.source == str(path) and "text.upper" in resolver
