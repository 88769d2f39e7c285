"""A deploy that is safe as it stands: `kubectl apply -k deploy/` applies no credentials (the
example Secret is the operator's to make, with the keys the pods read) and needs no CRD (KEDA is
a component, added on purpose); the Helm chart takes the README's `--set-file` without a
warning and installs the PodMonitor, the PrometheusRule and the dashboard when asked, the same
as deploy/monitoring's."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import yaml
from deploy_files import (
    CHART,
    DEPLOY,
    RELEASE,
    SECRET_EXAMPLE,
    Doc,
    helm_binary,
    load_docs,
    render_chart,
    render_kustomization,
    run,
)

MONITORING = DEPLOY / "monitoring"
# The API groups every cluster serves: nothing else may be in the default kustomization.
BUILT_IN = {"v1", "apps/v1", "batch/v1", "policy/v1", "rbac.authorization.k8s.io/v1", "networking.k8s.io/v1"}


def _with_components(tmp_path: Path, *components: str) -> list[Doc]:
    """deploy/ with `components`, through an overlay of the operator's own (outside deploy/)."""
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    relative = [os.path.relpath(DEPLOY / c, overlay) for c in components]
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump({"resources": [os.path.relpath(DEPLOY, overlay)], "components": relative})
    )
    done = run(["kubectl", "kustomize", str(overlay)])
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def _keys(docs: list[Doc]) -> set[tuple[str, str]]:
    return {(d["kind"], d["metadata"]["name"]) for d in docs}


def test_the_default_kustomization_applies_no_secret_and_no_crd_kind() -> None:
    docs = render_kustomization()
    assert {d["apiVersion"] for d in docs} <= BUILT_IN, {d["apiVersion"] for d in docs} - BUILT_IN
    assert "Secret" not in {d["kind"] for d in docs}
    assert "CHANGE-ME" not in yaml.safe_dump_all(docs)


def test_the_keda_component_adds_exactly_its_scaledobject(tmp_path: Path) -> None:
    default, with_keda = render_kustomization(), _with_components(tmp_path, "components/keda")
    added = _keys(with_keda) - _keys(default)
    assert added == {("ScaledObject", "k8s-dispatch-worker"), ("TriggerAuthentication", "k8s-dispatch-redis")}
    assert _keys(default) <= _keys(with_keda)
    assert all(d["metadata"]["namespace"] == "k8s-dispatch" for d in with_keda if d["kind"] != "Namespace")


def test_the_documented_secret_command_makes_the_keys_the_pods_read() -> None:
    (example,) = load_docs(DEPLOY / SECRET_EXAMPLE)
    comment = (DEPLOY / "kustomization.yaml").read_text()
    assert set(re.findall(r"--from-literal=([a-z-]+)=", comment)) == set(example["stringData"])
    read = set()
    for doc in [*render_kustomization(), *load_docs(DEPLOY / "components/keda/worker-scaledobject.yaml")]:
        text = json.dumps(doc)
        read |= {m for m in example["stringData"] if f'"key": "{m}"' in text}
    assert read == set(example["stringData"])  # each key is read by some pod or KEDA, none is missing


def _capabilities(*args: str) -> tuple[str, str]:
    """`helm template` with `args`: (its stderr, the capabilities ConfigMap's file)."""
    done = run([str(helm_binary()), "template", RELEASE, str(CHART), *args])
    assert done.returncode == 0, done.stderr
    (config_map,) = [d for d in yaml.safe_load_all(done.stdout) if d and d["kind"] == "ConfigMap"]
    return done.stderr, config_map["data"]["capabilities.yaml"]


def test_capabilities_as_text_or_as_a_mapping_render_without_a_warning(tmp_path: Path) -> None:
    example = DEPLOY / "capabilities.example.yaml"
    assert _capabilities("--set-file", f"capabilities.inline={example}") == ("", example.read_text())
    mapping = {"capabilities": {"echo": {"worker": "shell", "image": "busybox:1.36", "command": ["echo"]}}}
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"capabilities": {"inline": mapping}}))
    warnings, text = _capabilities("--values", str(values))
    assert warnings == "" and yaml.safe_load(text) == mapping
    warnings, text = _capabilities()  # unset: the chart's own file
    assert warnings == "" and text == (CHART / "files" / "capabilities.yaml").read_text()


def test_the_charts_monitoring_files_are_deploy_monitorings() -> None:
    for name in ("rules.yaml", "dashboard.json"):
        assert (CHART / "files" / name).read_bytes() == (MONITORING / name).read_bytes(), name


def test_the_chart_installs_the_monitoring_objects_when_asked(tmp_path: Path) -> None:
    assert not {"PodMonitor", "PrometheusRule"} & {d["kind"] for d in render_chart(workdir=tmp_path)}
    on = {"monitoring": {part: {"enabled": True} for part in ("podMonitor", "prometheusRule", "dashboard")}}
    docs = render_chart(on, workdir=tmp_path)
    by_kind = {d["kind"]: d for d in docs if d["kind"] in ("PodMonitor", "PrometheusRule")}
    (rule,) = load_docs(MONITORING / "prometheusrule.yaml")
    assert by_kind["PrometheusRule"]["spec"] == rule["spec"]
    assert by_kind["PrometheusRule"]["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    monitor = by_kind["PodMonitor"]
    (worker,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-worker")]
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= worker["spec"]["template"]["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert {"targetLabel": "job", "replacement": "k8s-dispatch-worker"} in endpoint["relabelings"]
    assert {"targetLabel": "deployment", "replacement": RELEASE} in endpoint["relabelings"]
    (dashboard,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard")]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["k8s-dispatch.json"]) == json.loads((MONITORING / "dashboard.json").read_text())
