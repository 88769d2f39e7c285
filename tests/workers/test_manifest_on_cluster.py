"""The manifest property, checked by the API server itself: for arbitrary refs, inputs and
capability specs, `build_job` either raises a typed error or builds a Job that the local
cluster accepts (names, labels, annotations, resources, env validated as Kubernetes does),
and reading that Job back from the cluster yields every original value.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from k8s_dispatch.container.contract import INPUT_ENV
from k8s_dispatch.core.errors import InputNotSerialisable, InvalidId, InvalidIdempotencyKey, InvalidManifest
from k8s_dispatch.demo.localcluster import LocalCluster
from k8s_dispatch.workers import labels
from k8s_dispatch.workers.kube import KubeClient
from k8s_dispatch.workers.manifest import FINALIZER, build_job
from k8s_dispatch.workers.types import DispatchRef
from tests.workers import strategies as S

TYPED = (InvalidId, InvalidIdempotencyKey, InputNotSerialisable, InvalidManifest)


@pytest.fixture(scope="module")
def kube() -> Iterator[KubeClient]:
    with LocalCluster(mode="simulate") as cluster, KubeClient(cluster.kubeconfig) as client:
        yield client


def _input_of(job: dict[str, Any]) -> Any:
    (container,) = job["spec"]["template"]["spec"]["containers"]
    (text,) = [e["value"] for e in container["env"] if e["name"] == INPUT_ENV]
    return json.loads(text)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ref=S.refs_any, value=S.inputs_any, data=st.data())
def test_a_built_job_is_accepted_by_the_cluster_and_reads_back_whole(
    kube: KubeClient, ref: DispatchRef, value: object, data: st.DataObject
) -> None:
    spec = data.draw(S.capability_specs(name=ref.capability, worker_name=ref.worker_name))
    namespace = data.draw(S.namespaces)
    try:
        job = build_job(ref, input=value, spec=spec, namespace=namespace, deployment="test")
    except TYPED as e:
        event(f"refused: {type(e).__name__}")
        return
    event("built and created")
    namespace = job["metadata"]["namespace"]  # the spec's own namespace wins over the default
    created = kube.create_job(namespace, job)  # an ApiRejected here fails the test
    name = created["metadata"]["name"]
    try:
        stored = kube.get_job(namespace, name)
        assert labels.decode(stored["metadata"]["labels"], stored["metadata"]["annotations"]) == ref
        template = stored["spec"]["template"]["metadata"]
        assert labels.decode(template["labels"], template["annotations"]) == ref
        assert _input_of(stored) == json.loads(json.dumps(value))
        assert FINALIZER in stored["metadata"]["finalizers"]
    finally:
        kube.remove_finalizer(namespace, name, FINALIZER)
        kube.delete_job(namespace, name)
