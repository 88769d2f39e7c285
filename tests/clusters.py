"""The two clusters every end-to-end suite runs on, behind one small handle: localcluster (our own
API server) and the real control plane (kube-apiserver, etcd, the real Job controller, our node
agent). A test asks for `cluster_under_test` and gets each in turn. A third, the same control plane
with a real node (kube-scheduler, the kubelet, containerd: KUBELET), is the one for what only a
kubelet decides (tests/realcluster/conftest.py's `kubelet_cluster`).

The handle carries what a test needs of either: the kubeconfig, the kind (for a divergence that is
deliberate and documented), a namespace made ready (a real API server refuses objects in a
namespace that does not exist; localcluster makes them on first use) and an authenticated raw
request for what the typed client cannot send.
"""

from __future__ import annotations

import http.client
import json
import ssl
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client, config

LOCAL, REAL = "localcluster", "realcluster"
KUBELET = "realcluster-kubelet"  # the real control plane with a kubelet node: real containers


@dataclass
class ClusterHandle:
    kind: str
    kubeconfig: Path
    url: str  # https for the real one, the plain-http listener for localcluster
    token: str
    ca_file: Path | None = None
    backend: Any = field(default=None, repr=False)  # the LocalCluster or the ControlPlane
    _namespaces: set[str] = field(default_factory=set, repr=False)

    @property
    def is_real(self) -> bool:
        """A real kube-apiserver (with our node agent or a kubelet)."""
        return self.kind in (REAL, KUBELET)

    def api_client(self) -> client.ApiClient:
        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def ensure_namespace(self, name: str) -> str:
        """Create namespace `name` if this handle has not yet (409 is fine: it exists)."""
        if name in self._namespaces:
            return name
        with self.api_client() as api:
            try:
                client.CoreV1Api(api).create_namespace({"metadata": {"name": name}})
            except client.ApiException as e:
                if e.status != 409:
                    raise
            if self.is_real:
                _wait_default_service_account(client.CoreV1Api(api), name)
        self._namespaces.add(name)
        return name

    def service_account_kubeconfig(self, namespace: str, path: Path, *, rbac_file: Path) -> Path:
        """A kubeconfig for `namespace`'s worker ServiceAccount, bound to the Role in `rbac_file`
        (deploy/rbac.yaml, moved to `namespace`), with a token from the TokenRequest API: on the
        real control plane every request it makes is then decided by the real RBAC authorizer."""
        import yaml

        self.ensure_namespace(namespace)
        docs = [d for d in yaml.safe_load_all(rbac_file.read_text()) if d]
        with self.api_client() as api:
            core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
            account = ""
            for doc in docs:
                doc["metadata"]["namespace"] = namespace
                for subject in doc.get("subjects") or []:
                    subject["namespace"] = namespace
                create = {
                    "ServiceAccount": core.create_namespaced_service_account,
                    "Role": rbac.create_namespaced_role,
                    "RoleBinding": rbac.create_namespaced_role_binding,
                }[doc["kind"]]
                try:
                    create(namespace, doc)
                except client.ApiException as e:
                    if e.status != 409:
                        raise
                if doc["kind"] == "ServiceAccount":
                    account = doc["metadata"]["name"]
            token = core.create_namespaced_service_account_token(
                account, namespace, {"spec": {"expirationSeconds": 3600}}
            ).status.token
        doc = yaml.safe_load(self.kubeconfig.read_text())
        for user in doc["users"]:
            user["user"] = {"token": token}
        for context in doc["contexts"]:
            context["context"]["namespace"] = namespace
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        path.chmod(0o600)
        return path

    def raw(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        token: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        """One request as sent, answered as received: (status, headers lower-cased, body)."""
        url = urllib.parse.urlsplit(self.url)
        conn: http.client.HTTPConnection
        if url.scheme == "https":
            ctx = ssl.create_default_context(cafile=str(self.ca_file)) if self.ca_file else ssl.create_default_context()
            conn = http.client.HTTPSConnection(url.hostname or "127.0.0.1", url.port, timeout=10, context=ctx)
        else:
            conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=10)
        try:
            hdrs = {"Content-Type": content_type, **(headers or {})}
            tok = self.token if token is None else token
            if tok:
                hdrs["Authorization"] = f"Bearer {tok}"
            data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
            conn.request(method, path, body=data, headers=hdrs)
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()


def _wait_default_service_account(core: client.CoreV1Api, namespace: str) -> None:
    """Pods are refused until the ServiceAccount controller has made the namespace's `default`."""
    import time

    deadline = time.monotonic() + 30
    while True:
        try:
            core.read_namespaced_service_account("default", namespace)
            return
        except client.ApiException as e:
            if e.status != 404 or time.monotonic() > deadline:
                raise
        time.sleep(0.05)


def local_handle(cluster: Any) -> ClusterHandle:
    return ClusterHandle(LOCAL, Path(cluster.kubeconfig), cluster.url, cluster.token, backend=cluster)


def real_handle(plane: Any) -> ClusterHandle:
    kind = KUBELET if getattr(plane, "node", "agent") == "kubelet" else REAL
    return ClusterHandle(
        kind, plane.kubeconfig, plane.url, plane.token, ca_file=plane.directory / "pki" / "ca.crt", backend=plane
    )
