"""deploy/helm/k8s-dispatch: linted and rendered by helm (built from its Go module), the same
deployment as the kustomization (objects, processes, RBAC), its values reaching the objects, and
both renders, with default and with other values, accepted by the real control plane (server-side
apply, dry-run=server).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from clusters import ClusterHandle
from deploy_files import (
    CHART,
    DEPLOY,
    RELEASE,
    Doc,
    by_kind_name,
    helm_binary,
    render_chart,
    render_kustomization,
    role_rules,
    run,
    write_docs,
)

from k8s_dispatch.workers.resolver import CapabilityResolver

NAMESPACE = "k8s-dispatch"

# Everything else than the defaults: KEDA on, an existing ConfigMap and Secrets of other names,
# two more namespaces for the Role, scheduling, annotations, another image and sizes.
CUSTOM: dict[str, Any] = {
    "image": {"repository": "registry.example.com/team/k8s-dispatch", "tag": "9.9.9", "pullPolicy": "Always"},
    "secret": {"name": "kd-connections", "databaseUrlKey": "db", "redisUrlKey": "broker", "redisPasswordKey": "pw"},
    "capabilities": {"existingConfigMap": "team-capabilities", "key": "caps.yaml"},
    "podAnnotations": {"example.com/team": "search"},
    "podLabels": {"example.com/cost-centre": "c42"},
    "nodeSelector": {"kubernetes.io/os": "linux", "example.com/pool": "batch"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "batch", "effect": "NoSchedule"}],
    "worker": {
        "replicas": 5,
        "concurrency": 16,
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
    },
    "metrics": {"enabled": True, "port": 9900, "scrapeAnnotations": False},
    "keda": {"enabled": True, "minReplicas": 3, "maxReplicas": 30, "keyPrefix": "team"},
    "flower": {"auth": {"existingSecret": "flower-login", "key": "htpasswd"}},
    "rbac": {"extraNamespaces": ["kd-batch-a", "kd-batch-b"]},
    "networkPolicy": {
        "apiServer": {"cidrs": ["10.0.0.1/32", "192.0.2.10/32"], "ports": [443]},
        "flowerIngressFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress"}}}],
    },
}
# The smallest deployment: no Flower, migrate, PDB, metrics or NetworkPolicy.
MINIMAL: dict[str, Any] = {
    "flower": {"enabled": False},
    "migrate": {"enabled": False},
    "pdb": {"enabled": False},
    "metrics": {"enabled": False},
    "networkPolicy": {"enabled": False},
}


@pytest.fixture(scope="module")
def helm() -> Path:
    return helm_binary()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("chart")


@pytest.fixture(scope="module")
def chart_default(workdir: Path) -> list[Doc]:
    return render_chart(workdir=workdir)


@pytest.fixture(scope="module")
def chart_custom(workdir: Path) -> list[Doc]:
    return render_chart(CUSTOM, workdir=workdir)


@pytest.fixture(scope="module")
def kustomized() -> list[Doc]:
    return render_kustomization()


def _named(docs: list[Doc], kind: str, name: str) -> Doc:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _pod(doc: Doc) -> Doc:
    return doc["spec"]["template"]["spec"]


def _workloads(docs: list[Doc]) -> list[Doc]:
    return [d for d in docs if d["kind"] in ("Deployment", "Job")]


# --- helm lint and template ---------------------------------------------------------------------


@pytest.mark.parametrize("values", [None, CUSTOM, MINIMAL], ids=["default", "custom", "minimal"])
def test_helm_lint_passes_strictly(helm: Path, tmp_path: Path, values: dict[str, Any] | None) -> None:
    args = [str(helm), "lint", "--strict", str(CHART), "--namespace", NAMESPACE]
    if values is not None:
        (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
        args += ["--values", str(tmp_path / "values.yaml")]
    done = run(args)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in done.stdout


def test_helm_is_the_pinned_version(helm: Path) -> None:
    pinned = (Path(__file__).resolve().parents[2] / "tools" / "helm" / "go.mod").read_text()
    (version,) = [line.split()[-1] for line in pinned.splitlines() if line.startswith("require helm.sh/helm/v3 ")]
    done = run([str(helm), "version", "--short"])
    assert done.returncode == 0 and done.stdout.startswith(version), done.stdout + done.stderr


def test_flower_cannot_be_rendered_without_a_login_secret(workdir: Path) -> None:
    done = run(
        [str(helm_binary()), "template", RELEASE, str(CHART), "--set", "flower.auth.existingSecret="],
    )
    assert done.returncode != 0
    assert "Flower never runs without a login" in done.stderr


# --- the same deployment as the kustomization ----------------------------------------------------


def test_default_render_has_the_kustomizations_objects(chart_default: list[Doc], kustomized: list[Doc]) -> None:
    # The chart leaves out what a chart should not own: the Namespace (helm's --namespace), the
    # connection Secret (bring your own) and, by default, KEDA's objects (needs KEDA's CRDs).
    not_in_chart = {"Namespace", "Secret", "ScaledObject", "TriggerAuthentication"}
    expected = {
        # The generated ConfigMap's name ends in kustomize's content hash.
        (d["kind"], d["metadata"]["name"].rsplit("-", 1)[0] if d["kind"] == "ConfigMap" else d["metadata"]["name"])
        for d in kustomized
        if d["kind"] not in not_in_chart
    }
    assert {(d["kind"], d["metadata"]["name"]) for d in chart_default} == expected
    assert all(d["metadata"]["namespace"] == NAMESPACE for d in chart_default)


def _comparable(doc: Doc) -> Doc:
    """A workload's pod spec with what legitimately differs between the two taken out: labels
    (the chart adds instance and chart labels), the capabilities ConfigMap's name (kustomize
    hashes it) and comments."""
    pod = copy.deepcopy(_pod(doc))
    for volume in pod.get("volumes", []):
        if "configMap" in volume:
            volume["configMap"]["name"] = "<capabilities>"
    return pod


@pytest.mark.parametrize(
    ("kind", "name"),
    [
        ("Deployment", "k8s-dispatch-worker"),
        ("Deployment", "k8s-dispatch-beat"),
        ("Deployment", "k8s-dispatch-flower"),
        ("Job", "k8s-dispatch-migrate"),
    ],
)
def test_default_pods_are_the_kustomizations(
    chart_default: list[Doc], kustomized: list[Doc], kind: str, name: str
) -> None:
    """Same processes, environment, probes, resources, security contexts, volumes and token."""
    assert _comparable(_named(chart_default, kind, name)) == _comparable(_named(kustomized, kind, name))


def test_default_selectors_and_strategies_are_the_kustomizations(
    chart_default: list[Doc], kustomized: list[Doc]
) -> None:
    for name in ("k8s-dispatch-worker", "k8s-dispatch-beat", "k8s-dispatch-flower"):
        ours, theirs = _named(chart_default, "Deployment", name), _named(kustomized, "Deployment", name)
        assert ours["spec"].get("strategy") == theirs["spec"].get("strategy"), name
        assert ours["spec"].get("replicas") == theirs["spec"].get("replicas"), name
        # The chart's selector adds the release (two releases in one namespace never meet).
        selector = ours["spec"]["selector"]["matchLabels"]
        assert selector.items() >= theirs["spec"]["selector"]["matchLabels"].items()
        assert selector["app.kubernetes.io/instance"] == RELEASE
        assert selector.items() <= ours["spec"]["template"]["metadata"]["labels"].items()
    pdb = _named(chart_default, "PodDisruptionBudget", "k8s-dispatch-worker")["spec"]
    assert pdb["selector"] == _named(chart_default, "Deployment", "k8s-dispatch-worker")["spec"]["selector"]


def test_kustomization_and_chart_grant_the_same_rbac_rules(
    chart_default: list[Doc], chart_custom: list[Doc], kustomized: list[Doc]
) -> None:
    (expected,) = role_rules(kustomized).values()
    assert role_rules(chart_default) == {NAMESPACE: expected}
    # With extra namespaces, the same rules in each, bound to the one ServiceAccount.
    assert role_rules(chart_custom) == {ns: expected for ns in (NAMESPACE, "kd-batch-a", "kd-batch-b")}
    (account,) = [d for d in chart_custom if d["kind"] == "ServiceAccount"]
    for binding in (d for d in chart_custom if d["kind"] == "RoleBinding"):
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
        ]
        namespace = binding["metadata"]["namespace"]
        assert ("Role", namespace, binding["roleRef"]["name"]) in by_kind_name(chart_custom)
    assert (
        _pod(_named(chart_custom, "Deployment", "k8s-dispatch-worker"))["serviceAccountName"]
        == (account["metadata"]["name"])
    )


def test_default_inline_capabilities_are_a_valid_capability_file(chart_default: list[Doc]) -> None:
    (config_map,) = [d for d in chart_default if d["kind"] == "ConfigMap"]
    resolver = CapabilityResolver.from_mapping(yaml.safe_load(config_map["data"]["capabilities.yaml"]))
    assert resolver.capabilities() == {"echo"}
    worker = _named(chart_default, "Deployment", "k8s-dispatch-worker")
    # A change of the capabilities rolls the pods (the resolver reads the file once, at start).
    assert "checksum/capabilities" in worker["spec"]["template"]["metadata"]["annotations"]


def test_capabilities_given_as_the_files_text_are_that_file(workdir: Path) -> None:
    # What `--set-file capabilities.inline=deploy/capabilities.example.yaml` does: the text, as is.
    text = (DEPLOY / "capabilities.example.yaml").read_text(encoding="utf-8")
    docs = render_chart({"capabilities": {"inline": text}}, workdir=workdir)
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert config_map["data"]["capabilities.yaml"] == text
    assert CapabilityResolver.from_mapping(yaml.safe_load(text)).capabilities() == {"echo", "checksum"}


# --- the values reach the objects ----------------------------------------------------------------


def test_custom_values_reach_every_pod(chart_custom: list[Doc]) -> None:
    for doc in _workloads(chart_custom):
        pod, meta = _pod(doc), doc["spec"]["template"]["metadata"]
        assert pod["nodeSelector"] == CUSTOM["nodeSelector"], doc["metadata"]["name"]
        assert pod["tolerations"] == CUSTOM["tolerations"], doc["metadata"]["name"]
        assert meta["annotations"]["example.com/team"] == "search", doc["metadata"]["name"]
        assert meta["labels"]["example.com/cost-centre"] == "c42", doc["metadata"]["name"]
        for container in pod["containers"]:
            assert container["image"] == "registry.example.com/team/k8s-dispatch:9.9.9"
            assert container["imagePullPolicy"] == "Always"
            refs = [
                v["valueFrom"]["secretKeyRef"] for v in container["env"] if "secretKeyRef" in v.get("valueFrom", {})
            ]
            urls = {(r["name"], r["key"]) for r in refs if r["name"] == "kd-connections"}
            assert ("kd-connections", "db") in urls, doc["metadata"]["name"]
            assert all(r["name"] in ("kd-connections", "flower-login") for r in refs)
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        if "capabilities" in volumes:
            assert volumes["capabilities"]["configMap"]["name"] == "team-capabilities"
            env = {v["name"]: v.get("value") for v in pod["containers"][0]["env"]}
            assert env["K8S_DISPATCH_CAPABILITIES"] == "/etc/k8s-dispatch/caps.yaml"
    # An existing ConfigMap: the chart makes none.
    assert not [d for d in chart_custom if d["kind"] == "ConfigMap"]


def test_custom_worker_keda_metrics_and_flower(chart_custom: list[Doc]) -> None:
    worker = _named(chart_custom, "Deployment", "k8s-dispatch-worker")
    container = _pod(worker)["containers"][0]
    env = {v["name"]: v.get("value") for v in container["env"]}
    assert env["K8S_DISPATCH_WORKER_CONCURRENCY"] == "16"
    assert env["K8S_DISPATCH_METRICS_PORT"] == "9900"
    assert container["ports"] == [{"name": "metrics", "containerPort": 9900}]
    assert container["resources"] == {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}
    assert "prometheus.io/scrape" not in worker["spec"]["template"]["metadata"]["annotations"]
    # KEDA owns the count: no replicas in the Deployment for a re-apply to fight over.
    assert "replicas" not in worker["spec"]
    scaled = _named(chart_custom, "ScaledObject", "k8s-dispatch-worker")["spec"]
    assert (scaled["minReplicaCount"], scaled["maxReplicaCount"]) == (3, 30)
    (trigger,) = scaled["triggers"]
    assert trigger["metadata"]["listName"] == "team:k8s-dispatch.jobs"
    auth = _named(chart_custom, "TriggerAuthentication", trigger["authenticationRef"]["name"])
    assert auth["spec"]["secretTargetRef"] == [{"parameter": "password", "name": "kd-connections", "key": "pw"}]
    flower = _pod(_named(chart_custom, "Deployment", "k8s-dispatch-flower"))["containers"][0]
    (login,) = [v for v in flower["env"] if v["name"] == "FLOWER_BASIC_AUTH"]
    assert login["valueFrom"]["secretKeyRef"] == {"name": "flower-login", "key": "htpasswd"}
    policy = _named(chart_custom, "NetworkPolicy", "k8s-dispatch-flower")
    assert policy["spec"]["ingress"][0]["from"] == CUSTOM["networkPolicy"]["flowerIngressFrom"]
    egress = _named(chart_custom, "NetworkPolicy", "k8s-dispatch-egress")["spec"]["egress"]
    api = [rule for rule in egress if any("ipBlock" in peer for peer in rule["to"])]
    assert [peer["ipBlock"]["cidr"] for rule in api for peer in rule["to"]] == ["10.0.0.1/32", "192.0.2.10/32"]


def test_minimal_values_leave_the_optional_parts_out(workdir: Path) -> None:
    docs = render_chart(MINIMAL, workdir=workdir)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert kinds == {
        ("ServiceAccount", "k8s-dispatch-worker"),
        ("Role", "k8s-dispatch-worker"),
        ("RoleBinding", "k8s-dispatch-worker"),
        ("ConfigMap", "k8s-dispatch-capabilities"),
        ("Deployment", "k8s-dispatch-worker"),
        ("Deployment", "k8s-dispatch-beat"),
    }
    container = _pod(_named(docs, "Deployment", "k8s-dispatch-worker"))["containers"][0]
    assert "ports" not in container
    assert "K8S_DISPATCH_METRICS_PORT" not in {v["name"] for v in container["env"]}
    assert "exec" in container["readinessProbe"]  # no metrics endpoint to be ready on


# --- accepted by the real control plane -----------------------------------------------------------

# KEDA is not installed there: its two kinds as schemaless CRDs, so the API server can take them.
_KEDA_CRDS = [
    {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.keda.sh"},
        "spec": {
            "group": "keda.sh",
            "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural, "singular": kind.lower(), "listKind": f"{kind}List"},
            "versions": [
                {
                    "name": "v1alpha1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
                }
            ],
        },
    }
    for kind, plural in (("ScaledObject", "scaledobjects"), ("TriggerAuthentication", "triggerauthentications"))
]


@pytest.fixture(scope="module")
def control_plane(real_cluster: ClusterHandle, tmp_path_factory: pytest.TempPathFactory) -> ClusterHandle:
    """The real control plane with the namespaces the renders use and KEDA's kinds known."""
    for namespace in (NAMESPACE, "kd-batch-a", "kd-batch-b"):
        real_cluster.ensure_namespace(namespace)
    crds = write_docs(tmp_path_factory.mktemp("crds") / "keda.yaml", _KEDA_CRDS)
    kubectl = ["kubectl", "--kubeconfig", str(real_cluster.kubeconfig)]
    done = run([*kubectl, "apply", "--server-side", "-f", str(crds)])
    assert done.returncode == 0, done.stderr
    done = run([*kubectl, "wait", "--for=condition=Established", "--timeout=60s", "-f", str(crds)])
    assert done.returncode == 0, done.stderr
    return real_cluster


def _server_dry_run(cluster: ClusterHandle, path: Path) -> list[str]:
    done = run(
        ["kubectl", "--kubeconfig", str(cluster.kubeconfig), "apply", "--server-side", "--dry-run=server",
         "--field-manager=k8s-dispatch-test", "-o", "name", "-f", str(path)],
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.parametrize("which", ["default", "custom"])
def test_the_rendered_chart_is_accepted_by_the_real_api_server(
    control_plane: ClusterHandle, chart_default: list[Doc], chart_custom: list[Doc], tmp_path: Path, which: str
) -> None:
    docs = chart_default if which == "default" else chart_custom
    accepted = _server_dry_run(control_plane, write_docs(tmp_path / f"{which}.yaml", docs))
    # Every object was taken (validated and defaulted by the API server, nothing stored).
    assert len(accepted) == len(docs) == len(by_kind_name(docs))
    assert {name.split("/", 1)[1] for name in accepted} == {d["metadata"]["name"] for d in docs}


def test_the_kustomization_is_accepted_by_the_real_api_server(
    control_plane: ClusterHandle, kustomized: list[Doc], tmp_path: Path
) -> None:
    accepted = _server_dry_run(control_plane, write_docs(tmp_path / "kustomized.yaml", kustomized))
    assert len(accepted) == len(kustomized)


def test_a_misspelt_field_is_refused_by_the_server_dry_run(
    control_plane: ClusterHandle, chart_default: list[Doc], tmp_path: Path
) -> None:
    # The dry run is a real check: the server's strict field validation refuses an unknown field.
    doc = copy.deepcopy(_named(chart_default, "Deployment", "k8s-dispatch-beat"))
    _pod(doc)["containers"][0]["livenessProbes"] = _pod(doc)["containers"][0].pop("livenessProbe")
    done = run(
        ["kubectl", "--kubeconfig", str(control_plane.kubeconfig), "apply", "--server-side", "--dry-run=server",
         "-f", str(write_docs(tmp_path / "bad.yaml", [doc]))],
    )  # fmt: skip
    assert done.returncode != 0
    assert "livenessProbes" in done.stderr
