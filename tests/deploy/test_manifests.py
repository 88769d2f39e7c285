"""deploy/, checked without a cluster: every object is validated against the official client's
models (a misspelt or unknown field is dropped by the model, so the round trip catches it),
then the wiring between objects: selectors, names, ports, probes, env vs the settings object,
the Role, and the KEDA trigger against the queue Celery really uses.
"""

from __future__ import annotations

import ast
import copy
import os
import shlex
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis
from deploy_files import DEPLOY, REPO, Doc, components, optional_files, role_permissions, settings_env_names
from kubernetes.client import ApiClient

from k8s_dispatch.core.settings import ENV_PREFIX, Settings, load_settings
from k8s_dispatch.workers import kube

NAMESPACE = "k8s-dispatch"
WORKER = "k8s-dispatch-worker"
BEAT = "k8s-dispatch-beat"
FLOWER = "k8s-dispatch-flower"
MIGRATE = "k8s-dispatch-migrate"
SECRET = "k8s-dispatch"
CAPABILITIES_CONFIGMAP = "k8s-dispatch-capabilities"
CAPABILITIES_KEY = "capabilities.yaml"
FLOWER_LOGIN = "FLOWER_BASIC_AUTH"  # Flower's --basic-auth, as an environment variable

# (apiVersion, kind) -> the client's model. Each kind at the version the manifests must use.
MODELS = {
    ("v1", "Namespace"): "V1Namespace",
    ("v1", "ServiceAccount"): "V1ServiceAccount",
    ("rbac.authorization.k8s.io/v1", "Role"): "V1Role",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "V1RoleBinding",
    ("v1", "Secret"): "V1Secret",
    ("v1", "ConfigMap"): "V1ConfigMap",
    ("v1", "Service"): "V1Service",
    ("apps/v1", "Deployment"): "V1Deployment",
    ("batch/v1", "Job"): "V1Job",
    ("policy/v1", "PodDisruptionBudget"): "V1PodDisruptionBudget",
    ("networking.k8s.io/v1", "NetworkPolicy"): "V1NetworkPolicy",
}
KEDA = {("keda.sh/v1alpha1", "ScaledObject"), ("keda.sh/v1alpha1", "TriggerAuthentication")}

# Exactly the API calls workers/kube.py (the only module that talks to the API) makes:
# create/read/patch/delete/list_namespaced_job, delete_collection_namespaced_job (the bulk
# delete of delivered Jobs), list_namespaced_pod and the patch that takes our finalizer off a
# Pod. The RBAC test that records the calls made against localcluster holds the Role to the same set.
EXPECTED_PERMISSIONS = {
    ("batch", "jobs", "create"),
    ("batch", "jobs", "get"),
    ("batch", "jobs", "list"),
    ("batch", "jobs", "watch"),
    ("batch", "jobs", "patch"),
    ("batch", "jobs", "delete"),
    ("batch", "jobs", "deletecollection"),
    ("", "pods", "list"),
    ("", "pods", "patch"),
    ("", "pods/log", "get"),
    ("", "events", "list"),
    ("", "secrets", "create"),
    ("", "secrets", "get"),
}


def _id(doc: Doc) -> str:
    return f"{doc['kind']}/{doc['metadata']['name']}"


def _generated_configmaps(kustomization: Doc) -> list[Doc]:
    """The ConfigMaps kustomize generates, before it adds the content hash to the name."""
    maps = []
    for generator in kustomization.get("configMapGenerator", []):
        data = {}
        for entry in generator["files"]:
            key, _, source = entry.rpartition("=")
            data[key or source] = (DEPLOY / source).read_text(encoding="utf-8")
        maps.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": generator["name"]}, "data": data})
    return maps


def _pod_spec(doc: Doc) -> Doc:
    return doc["spec"]["template"]["spec"]


def _container(objects: dict[tuple[str, str], Doc], kind: str, name: str) -> Doc:
    (container,) = _pod_spec(objects[(kind, name)])["containers"]
    return container


def _workloads(objects: dict[tuple[str, str], Doc]) -> list[Doc]:
    return [doc for (kind, _), doc in objects.items() if kind in ("Deployment", "Job")]


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _secret_data(objects: dict[tuple[str, str], Doc]) -> dict[str, str]:
    return objects[("Secret", SECRET)]["stringData"]


def _resolved_env(doc: Doc, container: Doc, objects: dict[tuple[str, str], Doc]) -> dict[str, str]:
    """The container's environment as the kubelet would set it, from the example objects."""
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
            continue
        source = var["valueFrom"]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[var["name"]] = objects[("Secret", ref["name"])]["stringData"][ref["key"]]
        elif "fieldRef" in source:
            assert source["fieldRef"]["fieldPath"] == "metadata.namespace", var
            env[var["name"]] = doc["metadata"]["namespace"]
        else:
            raise AssertionError(f"unexpected env source {source}")
    return env


# --- the files and the kinds ---------------------------------------------------------------


def test_kustomization_lists_every_file_in_deploy(kustomization: Doc) -> None:
    used = set(kustomization["resources"]) | {"kustomization.yaml"} | set(optional_files())
    used |= {f"{component}/kustomization.yaml" for component in components()}
    for generator in kustomization.get("configMapGenerator", []):
        used |= {entry.rpartition("=")[2] for entry in generator["files"]}
    present = {
        str(path.relative_to(DEPLOY))
        for path in [*DEPLOY.iterdir(), *DEPLOY.glob("components/*/*")]
        if path.suffix in (".yaml", ".yml")
    }
    assert present == used


def test_every_object_is_a_known_kind_at_a_served_version(manifests: list[tuple[str, Doc]]) -> None:
    for file, doc in manifests:
        assert (doc["apiVersion"], doc["kind"]) in MODELS.keys() | KEDA, f"{file}: {_id(doc)}"


def test_the_whole_deployment_is_there(objects: dict[tuple[str, str], Doc]) -> None:
    assert set(objects) == {
        ("Namespace", NAMESPACE),
        ("ServiceAccount", WORKER),
        ("Role", WORKER),
        ("RoleBinding", WORKER),
        ("Secret", SECRET),
        ("Job", MIGRATE),
        ("Deployment", WORKER),
        ("PodDisruptionBudget", WORKER),
        ("ScaledObject", WORKER),
        ("TriggerAuthentication", "k8s-dispatch-redis"),
        ("Deployment", BEAT),
        ("Deployment", FLOWER),
        ("Service", FLOWER),
        ("NetworkPolicy", "k8s-dispatch-egress"),
        ("NetworkPolicy", FLOWER),
        ("NetworkPolicy", "k8s-dispatch-jobs"),
    }


def _round_trip(api_client: ApiClient, doc: Doc) -> Doc:
    """`doc` deserialised into the official model, and serialised back."""
    model_name = MODELS[(doc["apiVersion"], doc["kind"])]
    model = api_client._ApiClient__deserialize(copy.deepcopy(doc), model_name)  # type: ignore[attr-defined]
    return api_client.sanitize_for_serialization(model)


def test_objects_round_trip_through_the_client_models(
    api_client: ApiClient, manifests: list[tuple[str, Doc]], kustomization: Doc
) -> None:
    """Deserialised into the official model and back, each object is unchanged: every field is
    known to the API at this version, with the right type, and the required ones are there."""
    docs = [doc for _, doc in manifests if (doc["apiVersion"], doc["kind"]) in MODELS]
    docs += _generated_configmaps(kustomization)
    assert len(docs) == 15
    problems = []
    for doc in docs:
        try:
            if _round_trip(api_client, doc) != doc:
                problems.append(f"{_id(doc)}: a field unknown to the API, or of the wrong type")
        except ValueError as e:  # the model refused a value (a missing required field, a bad type)
            problems.append(f"{_id(doc)}: {e}")
    assert not problems, "\n".join(problems)


def test_round_trip_catches_a_misspelt_field(api_client: ApiClient, objects: dict[tuple[str, str], Doc]) -> None:
    # The check above is only worth something if the model drops what it does not know.
    doc = copy.deepcopy(objects[("Deployment", WORKER)])
    _pod_spec(doc)["containers"][0]["livenessProbes"] = _pod_spec(doc)["containers"][0].pop("livenessProbe")
    assert _round_trip(api_client, doc) != doc


# KEDA's CRDs have no model in the client: check the fields against its v2 schema by hand.
_SCALED_OBJECT_SPEC = {
    "scaleTargetRef", "pollingInterval", "cooldownPeriod", "initialCooldownPeriod", "idleReplicaCount",
    "minReplicaCount", "maxReplicaCount", "fallback", "advanced", "triggers",
}  # fmt: skip
_TRIGGER = {"type", "name", "metadata", "authenticationRef", "metricType", "useCachedMetrics"}
_TARGET_REF = {"apiVersion", "kind", "name", "envSourceContainerName"}


def test_scaled_object_fields_are_kedas(objects: dict[tuple[str, str], Doc]) -> None:
    scaled = objects[("ScaledObject", WORKER)]
    assert set(scaled) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(scaled["spec"]) <= _SCALED_OBJECT_SPEC
    assert set(scaled["spec"]["scaleTargetRef"]) <= _TARGET_REF
    for key in ("pollingInterval", "cooldownPeriod", "minReplicaCount", "maxReplicaCount"):
        assert isinstance(scaled["spec"][key], int)
    assert 1 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]
    for trigger in scaled["spec"]["triggers"]:
        assert set(trigger) <= _TRIGGER
        # KEDA's trigger metadata is map[string]string: a bare number is rejected.
        assert all(isinstance(v, str) for v in trigger["metadata"].values())


def test_trigger_authentication_fields_are_kedas(objects: dict[tuple[str, str], Doc]) -> None:
    auth = objects[("TriggerAuthentication", "k8s-dispatch-redis")]
    assert set(auth["spec"]) == {"secretTargetRef"}
    for ref in auth["spec"]["secretTargetRef"]:
        assert set(ref) == {"parameter", "name", "key"}
        assert ref["key"] in objects[("Secret", ref["name"])]["stringData"]


# --- namespaces and labels -----------------------------------------------------------------


def test_everything_is_in_the_one_namespace(manifests: list[tuple[str, Doc]], kustomization: Doc) -> None:
    assert kustomization["namespace"] == NAMESPACE
    for file, doc in manifests:
        if doc["kind"] == "Namespace":
            assert doc["metadata"]["name"] == NAMESPACE
        else:
            assert doc["metadata"]["namespace"] == NAMESPACE, f"{file}: {_id(doc)}"


def test_nothing_here_looks_like_a_dispatch_job(manifests: list[tuple[str, Doc]]) -> None:
    # The workers list, poll and sweep whatever carries the managed-by label; the migrate Job
    # or a pod of ours with it would be taken for an orphaned dispatch.
    from k8s_dispatch.workers.labels import MANAGED_BY, MANAGED_BY_LABEL

    for _, doc in manifests:
        label_sets = [doc["metadata"].get("labels", {})]
        if "template" in doc.get("spec", {}):
            label_sets.append(doc["spec"]["template"]["metadata"].get("labels", {}))
        for labels in label_sets:
            assert labels.get(MANAGED_BY_LABEL) != MANAGED_BY, _id(doc)


def test_each_deployment_selects_its_own_pods_only(objects: dict[tuple[str, str], Doc]) -> None:
    deployments = [doc for (kind, _), doc in objects.items() if kind == "Deployment"]
    for deployment in deployments:
        selector = deployment["spec"]["selector"]["matchLabels"]
        for other in deployments:
            pod_labels = other["spec"]["template"]["metadata"]["labels"]
            assert _selects(selector, pod_labels) == (other is deployment), (_id(deployment), _id(other))


def test_flower_service_reaches_flower_pods(objects: dict[tuple[str, str], Doc]) -> None:
    service = objects[("Service", FLOWER)]
    selected = [
        name
        for (kind, name), doc in objects.items()
        if kind == "Deployment" and _selects(service["spec"]["selector"], doc["spec"]["template"]["metadata"]["labels"])
    ]
    assert selected == [FLOWER]
    ports = {p["name"]: p["containerPort"] for p in _container(objects, "Deployment", FLOWER)["ports"]}
    (port,) = service["spec"]["ports"]
    assert ports[port["targetPort"]] == port["port"] == 5555


def test_pdb_covers_the_workers_only(objects: dict[tuple[str, str], Doc]) -> None:
    pdb = objects[("PodDisruptionBudget", WORKER)]["spec"]
    assert pdb["selector"]["matchLabels"] == objects[("Deployment", WORKER)]["spec"]["selector"]["matchLabels"]
    for (kind, name), doc in objects.items():
        if kind in ("Deployment", "Job"):
            assert _selects(pdb["selector"]["matchLabels"], doc["spec"]["template"]["metadata"]["labels"]) == (
                name == WORKER
            )
    assert pdb["maxUnavailable"] == 1


# --- the processes -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "name", "command"),
    [
        ("Deployment", WORKER, ["celery", "-A", "k8s_dispatch.tasks", "worker", "--loglevel=INFO"]),
        ("Deployment", BEAT, ["celery", "-A", "k8s_dispatch.tasks", "beat", "--loglevel=INFO"]),
        ("Deployment", FLOWER, ["k8s-dispatch", "flower", "--port=5555"]),
        ("Job", MIGRATE, ["k8s-dispatch", "migrate"]),
    ],
)
def test_container_commands(objects: dict[tuple[str, str], Doc], kind: str, name: str, command: list[str]) -> None:
    container = _container(objects, kind, name)
    assert container["command"] == command
    assert "args" not in container


def test_commands_match_compose(objects: dict[tuple[str, str], Doc], compose: Doc) -> None:
    pairs = {
        "worker": ("Deployment", WORKER),
        "beat": ("Deployment", BEAT),
        "flower": ("Deployment", FLOWER),
        "migrate": ("Job", MIGRATE),
    }
    for service, (kind, name) in pairs.items():
        assert compose["services"][service]["command"] == _container(objects, kind, name)["command"], service


def test_beat_is_a_single_replica_replaced_not_rolled(objects: dict[tuple[str, str], Doc]) -> None:
    spec = objects[("Deployment", BEAT)]["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}


def test_worker_liveness_is_a_celery_ping_of_its_own_node(objects: dict[tuple[str, str], Doc]) -> None:
    probe = _container(objects, "Deployment", WORKER)["livenessProbe"]
    shell, flag, script = probe["exec"]["command"]
    assert (shell, flag) == ("sh", "-c")  # exec probes run no shell of their own: $HOSTNAME needs one
    words = shlex.split(script)
    assert words[:7] == ["celery", "-A", "k8s_dispatch.tasks", "inspect", "ping", "-d", "celery@$HOSTNAME"]
    ping_timeout = float(words[words.index("--timeout") + 1])
    # The kubelet must not kill the probe before Celery gives up waiting for the reply.
    assert probe["timeoutSeconds"] > ping_timeout + 5
    assert probe["failureThreshold"] * probe["periodSeconds"] >= 120  # not restarted on one slow reply


def test_worker_readiness_and_metrics_share_the_metrics_port(objects: dict[tuple[str, str], Doc]) -> None:
    deployment = objects[("Deployment", WORKER)]
    container = _container(objects, "Deployment", WORKER)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    env = {var["name"]: var.get("value") for var in container["env"]}
    metrics_port = int(env[ENV_PREFIX + "METRICS_PORT"])
    assert ports["metrics"] == metrics_port == 9808
    assert ports[container["readinessProbe"]["httpGet"]["port"]] == metrics_port
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(metrics_port)


def test_worker_shuts_down_gracefully_for_acks_late(objects: dict[tuple[str, str], Doc], compose: Doc) -> None:
    grace = _pod_spec(objects[("Deployment", WORKER)])["terminationGracePeriodSeconds"]
    assert grace >= 60  # Kubernetes' default of 30 s cuts long tasks off
    assert compose["services"]["worker"]["stop_grace_period"] == f"{grace // 60}m"  # one figure in both
    # Roll out without dropping below the current count while old workers drain.
    assert objects[("Deployment", WORKER)]["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_every_container_has_requests_and_a_memory_limit(objects: dict[tuple[str, str], Doc]) -> None:
    for doc in _workloads(objects):
        for container in _pod_spec(doc)["containers"]:
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]), _id(doc)
            assert "memory" in resources["limits"], _id(doc)


def test_pods_run_non_root_with_a_read_only_root(objects: dict[tuple[str, str], Doc]) -> None:
    for doc in _workloads(objects):
        pod = _pod_spec(doc)
        assert pod["securityContext"]["runAsNonRoot"] is True, _id(doc)
        assert pod["securityContext"]["runAsUser"] != 0, _id(doc)
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, _id(doc)
        empty_dirs = {v["name"] for v in pod.get("volumes", []) if "emptyDir" in v}
        for container in pod["containers"]:
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False, _id(doc)
            assert security["readOnlyRootFilesystem"] is True, _id(doc)
            assert security["capabilities"] == {"drop": ["ALL"]}, _id(doc)
            # celeryconfig.py writes under the temp dir, so /tmp must be writable.
            tmp = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
            assert tmp and tmp[0]["name"] in empty_dirs, _id(doc)


def test_images_are_the_one_kustomize_sets(objects: dict[tuple[str, str], Doc], kustomization: Doc) -> None:
    (image,) = kustomization["images"]
    for doc in _workloads(objects):
        for container in _pod_spec(doc)["containers"]:
            assert container["image"] == f"{image['name']}:{image['newTag']}", _id(doc)


# --- configuration -------------------------------------------------------------------------


def test_every_env_name_is_a_setting(objects: dict[tuple[str, str], Doc]) -> None:
    known = settings_env_names()
    for doc in _workloads(objects):
        for container in _pod_spec(doc)["containers"]:
            names = [var["name"] for var in container.get("env", [])]
            assert len(names) == len(set(names)), _id(doc)
            # Flower's login is Flower's own option (FLOWER_* variables), read by Flower alone.
            names = [n for n in names if not (n == FLOWER_LOGIN and doc["metadata"]["name"] == FLOWER)]
            assert all(name.startswith(ENV_PREFIX) for name in names), _id(doc)
            assert set(names) <= known, f"{_id(doc)}: not settings: {sorted(set(names) - known)}"


def test_secret_references_resolve(objects: dict[tuple[str, str], Doc]) -> None:
    for doc in _workloads(objects):
        for container in _pod_spec(doc)["containers"]:
            for var in container.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in objects[("Secret", ref["name"])]["stringData"], (_id(doc), var["name"])


def test_capabilities_setting_points_into_the_generated_configmap(
    objects: dict[tuple[str, str], Doc], kustomization: Doc
) -> None:
    generated = {g["name"]: g for g in kustomization["configMapGenerator"]}
    for doc in _workloads(objects):
        pod = _pod_spec(doc)
        for container in pod["containers"]:
            env = {var["name"]: var.get("value") for var in container.get("env", [])}
            path = env.get(ENV_PREFIX + "CAPABILITIES")
            if path is None:
                continue
            volumes = {v["name"]: v for v in pod["volumes"]}
            (mount,) = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
            config_map = volumes[mount["name"]]["configMap"]["name"]
            assert config_map == CAPABILITIES_CONFIGMAP, _id(doc)
            keys = {entry.rpartition("=")[0] for entry in generated[config_map]["files"]}
            assert path == f"{mount['mountPath']}/{CAPABILITIES_KEY}" and CAPABILITIES_KEY in keys, _id(doc)
            assert mount["readOnly"] is True


@pytest.mark.parametrize(
    ("kind", "name"), [("Deployment", WORKER), ("Deployment", BEAT), ("Deployment", FLOWER), ("Job", MIGRATE)]
)
def test_environment_builds_valid_settings(objects: dict[tuple[str, str], Doc], kind: str, name: str) -> None:
    doc = objects[(kind, name)]
    env = _resolved_env(doc, _container(objects, kind, name), objects)
    if ENV_PREFIX + "CAPABILITIES" in env:  # Settings checks the file exists: use its source here
        env[ENV_PREFIX + "CAPABILITIES"] = str(DEPLOY / "capabilities.example.yaml")
    settings = load_settings(env)
    assert settings.database_url.startswith("postgresql+psycopg://")
    if ENV_PREFIX + "NAMESPACE" in env:  # the migration has no use for it
        assert settings.namespace == NAMESPACE
    # In-cluster config: no kubeconfig anywhere in the cluster deployment.
    assert settings.kubeconfig is None


def test_worker_settings(objects: dict[tuple[str, str], Doc]) -> None:
    env = _resolved_env(objects[("Deployment", WORKER)], _container(objects, "Deployment", WORKER), objects)
    env[ENV_PREFIX + "CAPABILITIES"] = str(DEPLOY / "capabilities.example.yaml")
    settings = load_settings(env)
    assert settings.metrics_port == 9808
    assert settings.redis_url.startswith("redis://")
    assert settings.capabilities is not None


# --- identity and permissions ----------------------------------------------------------------


def test_role_grants_exactly_the_calls_the_code_makes() -> None:
    granted = role_permissions()
    assert granted == EXPECTED_PERMISSIONS
    assert not any("*" in part for permission in granted for part in permission)


_API_GROUPS = {"BatchV1Api": "batch", "CoreV1Api": ""}
_VERBS = {
    "create": "create",
    "read": "get",
    "list": "list",
    "patch": "patch",
    "delete": "delete",
    "delete_collection": "deletecollection",
    "replace": "update",
}
_RESOURCES = {
    "job": "jobs",
    "job_status": "jobs/status",
    "pod": "pods",
    "pod_log": "pods/log",
    "event": "events",
    "pod_status": "pods/status",
    "secret": "secrets",
}


def _api_calls_in_kube_module() -> set[tuple[str, str, str]]:
    """(group, resource, verb) of every `<api>.<verb>_namespaced_<resource>` call in workers/kube.py,
    the api attributes told apart by the client class they were built from."""
    tree = ast.parse((REPO / "workers" / "kube.py").read_text(encoding="utf-8"))
    group_of_attr: dict[str, str] = {}
    for node in ast.walk(tree):  # self._batch = k8s.BatchV1Api(...)
        if (
            (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Attribute)
            )
            and node.value.func.attr in _API_GROUPS
            and isinstance(node.targets[0], ast.Attribute)
        ):
            group_of_attr[node.targets[0].attr] = _API_GROUPS[node.value.func.attr]
    assert set(group_of_attr.values()) == {"batch", ""}
    calls = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr in group_of_attr
        ):
            verb, _, resource = node.attr.partition("_namespaced_")
            calls.add((group_of_attr[node.value.attr], _RESOURCES[resource], _VERBS[verb]))
        # self._batch.list_namespaced_job(..., watch=True): a LIST that is a WATCH to RBAC
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Attribute)
            and node.func.value.attr in group_of_attr
            and node.func.attr.startswith("list_namespaced_")
            and any(k.arg == "watch" for k in node.keywords)
        ):
            resource = _RESOURCES[node.func.attr.removeprefix("list_namespaced_")]
            calls.add((group_of_attr[node.func.value.attr], resource, "watch"))
        # self._request(what, "POST", JOBS_PATH, ...): the lean path, by HTTP method and URL template
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "_request":
            method, path = node.args[1], node.args[2]
            assert isinstance(method, ast.Constant) and isinstance(path, ast.Name), ast.dump(node)
            calls.add(_request_permission(method.value, getattr(kube, path.id)))
    return calls


def _request_permission(method: str, template: str) -> tuple[str, str, str]:
    """(group, resource, verb) of an HTTP request to a URL template such as
    /apis/batch/v1/namespaces/{namespace}/jobs/{name}."""
    parts = template.strip("/").split("/")
    group = "" if parts[0] == "api" else parts[1]
    rest = parts[parts.index("namespaces") + 2 :]  # resource, then {name}, then a subresource
    named = len(rest) > 1
    resource = rest[0] + (f"/{rest[2]}" if len(rest) > 2 else "")
    verb = {"POST": "create", "PATCH": "patch", "PUT": "update"}.get(method) or (
        {"GET": "get", "DELETE": "delete"}[method] if named else {"GET": "list", "DELETE": "deletecollection"}[method]
    )
    return group, resource, verb


def test_role_matches_the_api_methods_the_kube_module_calls() -> None:
    # A static cross-check: a new API call in workers/kube.py fails here until the Role has it.
    assert _api_calls_in_kube_module() == role_permissions()


def test_only_the_workers_hold_an_api_token(objects: dict[tuple[str, str], Doc]) -> None:
    binding = objects[("RoleBinding", WORKER)]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": WORKER}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": WORKER, "namespace": NAMESPACE}]
    assert ("ServiceAccount", WORKER) in objects
    for doc in _workloads(objects):
        pod = _pod_spec(doc)
        if doc["metadata"]["name"] == WORKER:
            assert pod["serviceAccountName"] == WORKER
            assert pod.get("automountServiceAccountToken", True) is True  # in-cluster config needs it
        else:
            assert "serviceAccountName" not in pod and pod["automountServiceAccountToken"] is False, _id(doc)


# --- scaling -----------------------------------------------------------------------------------


def test_keda_scales_the_worker_deployment(objects: dict[tuple[str, str], Doc]) -> None:
    ref = objects[("ScaledObject", WORKER)]["spec"]["scaleTargetRef"]
    assert (ref.get("apiVersion", "apps/v1"), ref.get("kind", "Deployment"), ref["name"]) == (
        "apps/v1",
        "Deployment",
        WORKER,
    )
    assert ("Deployment", ref["name"]) in objects


# Run in a fresh process configured as the worker Deployment configures its pods: sends one
# create-Job message (never consumed: no worker uses the test's key prefix) and prints the
# broker's global key prefix.
_SEND_CREATE_JOB = """
from k8s_dispatch import celeryconfig
from k8s_dispatch.tasks import app
app.send_task(celeryconfig.CREATE_JOB_TASK, args=["00000000-0000-4000-8000-000000000000"])
print(celeryconfig.broker_transport_options.get("global_keyprefix", ""))
"""


def _run_as_worker(objects: dict[tuple[str, str], Doc], tmp_path: Path, **overrides: str) -> str:
    env = _resolved_env(objects[("Deployment", WORKER)], _container(objects, "Deployment", WORKER), objects)
    env[ENV_PREFIX + "CAPABILITIES"] = str(DEPLOY / "capabilities.example.yaml")
    env |= overrides
    env |= {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX) and k not in env}
    done = subprocess.run(
        [sys.executable, "-c", _SEND_CREATE_JOB],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_keda_watches_the_redis_list_the_jobs_queue_fills(
    objects: dict[tuple[str, str], Doc], tmp_path: Path, redis_url: str, key_prefix: str
) -> None:
    (trigger,) = objects[("ScaledObject", WORKER)]["spec"]["triggers"]
    assert trigger["type"] == "redis"
    meta = trigger["metadata"]
    assert int(meta["listLength"]) > 0
    # The workers set no K8S_DISPATCH_KEY_PREFIX, so their broker keys carry the default one.
    default_prefix = Settings.model_fields["key_prefix"].default
    assert ENV_PREFIX + "KEY_PREFIX" not in {var["name"] for var in _container(objects, "Deployment", WORKER)["env"]}
    list_name = meta["listName"]
    assert list_name.startswith(f"{default_prefix}:")

    # With the test's Redis and key prefix in place of the deployment's, a create-Job message
    # lands in exactly the list KEDA is told to measure (its prefix swapped the same way).
    prefix = _run_as_worker(objects, tmp_path, K8S_DISPATCH_REDIS_URL=redis_url, K8S_DISPATCH_KEY_PREFIX=key_prefix)
    assert prefix == f"{key_prefix}:"
    key = prefix + list_name.removeprefix(f"{default_prefix}:")
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.llen(key) == 1
        client.delete(key)
    finally:
        client.close()

    # The same Redis as the workers' broker: host, port and database of the Secret's URL.
    url = urlsplit(_secret_data(objects)["redis-url"])
    assert meta["address"] == f"{url.hostname}:{url.port}"
    assert meta["databaseIndex"] == url.path.lstrip("/")


def test_keda_authenticates_with_the_brokers_password(objects: dict[tuple[str, str], Doc]) -> None:
    (trigger,) = objects[("ScaledObject", WORKER)]["spec"]["triggers"]
    auth = objects[("TriggerAuthentication", trigger["authenticationRef"]["name"])]
    (ref,) = auth["spec"]["secretTargetRef"]
    assert ref["parameter"] == "password"
    secret = objects[("Secret", ref["name"])]["stringData"]
    assert secret[ref["key"]] == urlsplit(secret["redis-url"]).password


# --- capabilities ------------------------------------------------------------------------------


def test_capabilities_example_is_valid_for_the_resolver() -> None:
    from k8s_dispatch.workers.resolver import CapabilityResolver

    resolver = CapabilityResolver.from_file(DEPLOY / "capabilities.example.yaml")
    assert set(resolver.capabilities()) == {"echo", "checksum"}
    assert resolver.worker_for("echo") == "shell"
    assert resolver.worker_for("checksum") == "python"


def test_compose_mounts_the_same_capabilities_file(compose: Doc) -> None:
    sources = {v["source"] for v in compose["services"]["worker"]["volumes"] if isinstance(v, dict)}
    assert "./deploy/capabilities.example.yaml" in sources
    assert (REPO / "deploy" / "capabilities.example.yaml").is_file()


# --- secure by default -----------------------------------------------------------------------------


def test_flower_requires_a_login_from_the_secret(objects: dict[tuple[str, str], Doc]) -> None:
    container = _container(objects, "Deployment", FLOWER)
    (login,) = [var for var in container["env"] if var["name"] == FLOWER_LOGIN]
    ref = login["valueFrom"]["secretKeyRef"]
    assert ref.get("optional") is not True  # a missing key keeps the pod from starting
    user, _, password = _secret_data(objects)[ref["key"]].partition(":")
    assert user and password  # Flower's user:password form
    assert not any("basic" in word for word in container["command"])  # not on the command line
    others = [d for d in _workloads(objects) if d["metadata"]["name"] != FLOWER]
    assert all(FLOWER_LOGIN not in {v["name"] for c in _pod_spec(d)["containers"] for v in c["env"]} for d in others)


def _policy_selects(policy: Doc, labels: dict[str, str]) -> bool:
    selector = policy["spec"]["podSelector"]
    if not _selects(selector.get("matchLabels", {}), labels):
        return False
    return all(
        labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", []) if e["operator"] == "In"
    )


def test_network_policies_cover_every_pod_and_limit_egress(objects: dict[tuple[str, str], Doc]) -> None:
    from k8s_dispatch.workers.labels import MANAGED_BY, MANAGED_BY_LABEL

    policies = {name: doc for (kind, name), doc in objects.items() if kind == "NetworkPolicy"}
    egress = policies["k8s-dispatch-egress"]
    for doc in _workloads(objects):
        labels = doc["spec"]["template"]["metadata"]["labels"]
        selected = [name for name, policy in policies.items() if _policy_selects(policy, labels)]
        assert selected == [FLOWER if doc["metadata"]["name"] == FLOWER else "k8s-dispatch-egress"], _id(doc)
    # Workers, beat and migrate: DNS, the API server, PostgreSQL and Redis; nothing else.
    ports = {(p.get("protocol", "TCP"), p["port"]) for rule in egress["spec"]["egress"] for p in rule["ports"]}
    assert ports == {("UDP", 53), ("TCP", 53), ("TCP", 443), ("TCP", 6443), ("TCP", 5432), ("TCP", 6379)}
    assert all(rule["to"] for rule in egress["spec"]["egress"])  # no rule open to everywhere
    assert egress["spec"]["policyTypes"] == ["Egress"]
    # Flower: ingress on its port from the configured peers only.
    flower = policies[FLOWER]["spec"]
    (ingress,) = flower["ingress"]
    assert ingress["from"] and ingress["ports"] == [{"protocol": "TCP", "port": 5555}]
    # The dispatch Jobs' pods: no ingress at all.
    jobs = policies["k8s-dispatch-jobs"]["spec"]
    assert jobs["podSelector"] == {"matchLabels": {MANAGED_BY_LABEL: MANAGED_BY}}
    assert jobs["policyTypes"] == ["Ingress"] and "ingress" not in jobs


def test_the_namespace_enforces_the_restricted_profile(objects: dict[tuple[str, str], Doc]) -> None:
    labels = objects[("Namespace", NAMESPACE)]["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
