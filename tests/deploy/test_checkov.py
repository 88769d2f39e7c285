"""checkov, a scanner nobody here wrote, over deploy/, the kustomization and the chart as rendered
(default and other values), the Dockerfile and the Jobs `build_job` makes: no failed check outside
SKIPS, where each entry says why it does not apply here (and, where it can, to which objects).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from deploy_files import DEPLOY, DOCKERFILE, render_chart, render_kustomization, run, write_docs
from test_helm_chart import CUSTOM

from k8s_dispatch.workers.manifest import build_job
from k8s_dispatch.workers.resolver import CapabilityResolver
from k8s_dispatch.workers.types import DispatchRef

# check id -> (why it is skipped, the resources it may fail on; None: any)
SKIPS: dict[str, tuple[str, tuple[str, ...] | None]] = {
    "CKV_K8S_11": (
        "No CPU limits on purpose: the CFS quota throttles a burst (a worker's batch of completions, "
        "a Job's short run) while the node is idle; requests reserve the CPU, memory limits contain leaks.",
        None,
    ),
    "CKV_K8S_43": (
        "Image digests: the tag is the operator's to pin at deploy time (kustomize edit set image, the "
        "chart's image.tag, a capability's image); no digest exists in this repository to write.",
        None,
    ),
    "CKV_K8S_15": (
        "imagePullPolicy IfNotPresent with versioned tags: Always makes every restart depend on the "
        "registry being up, for no gain with an immutable tag (the chart's image.pullPolicy sets it).",
        None,
    ),
    "CKV_K8S_35": (
        "Secrets as environment variables: Settings reads K8S_DISPATCH_* from the environment only, as "
        "Celery and Flower do (FLOWER_BASIC_AUTH); the values come from secretKeyRef, never the manifest.",
        None,
    ),
    "CKV_K8S_38": (
        "The workers' ServiceAccount token is mounted because they call the API (create, list, patch "
        "Jobs); every other pod of ours sets automountServiceAccountToken: false.",
        ("Deployment.k8s-dispatch.k8s-dispatch-worker",),
    ),
    "CKV_K8S_22": (
        "A capability's Job keeps its image's writable root: the restricted profile does not ask for a "
        "read-only one and a capability's program may write where its image expects (ours are read-only).",
        ("Job.k8s-dispatch.kd-",),
    ),
    "CKV_DOCKER_2": (
        "No HEALTHCHECK in the image: one image runs worker, beat, Flower and migrate, each checked its "
        "own way by Compose's healthchecks and Kubernetes' probes (which ignore HEALTHCHECK).",
        None,
    ),
}


def _checkov() -> Path:
    """checkov in its own virtualenv in the tool cache (tools/checkov/requirements.txt says why)."""
    from k8s_dispatch.lab.realcluster.binaries import build

    return build("checkov") / "bin" / "checkov"


def _built_jobs() -> list[dict[str, Any]]:
    """One Job per capability of the example file, as the workers would create it."""
    resolver = CapabilityResolver.from_file(DEPLOY / "capabilities.example.yaml")
    jobs = []
    for name in sorted(resolver.capabilities()):
        spec = resolver.spec(name)
        ref = DispatchRef(str(uuid.uuid4()), str(uuid.uuid4()), "acme", name, spec.worker_name, f"key-{name}")
        jobs.append(build_job(ref, input={"text": "hello"}, spec=spec, namespace="k8s-dispatch", deployment="kd"))
    return jobs


def _reports(stdout: str) -> list[dict[str, Any]]:
    """checkov's JSON: one document per scanned root, each a report or a list of them."""
    decoder, reports, at = json.JSONDecoder(), [], 0
    while at < len(stdout.rstrip()):
        loaded, end = decoder.raw_decode(stdout, at)
        reports += loaded if isinstance(loaded, list) else [loaded]
        at = end + (len(stdout[end:]) - len(stdout[end:].lstrip()))
    return reports


@pytest.fixture(scope="module")
def scan(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """checkov's reports, each check's failures and passes, over everything the issue names."""
    rendered = tmp_path_factory.mktemp("rendered")
    # Each render with the built Jobs beside it: checkov's NetworkPolicy check looks for a policy
    # selecting a pod among the objects scanned together.
    jobs = _built_jobs()
    write_docs(rendered / "kustomized.yaml", [*render_kustomization(), *jobs])
    chart = tmp_path_factory.mktemp("chart")
    write_docs(rendered / "chart-default.yaml", [*render_chart(workdir=chart), *jobs])
    write_docs(rendered / "chart-custom.yaml", render_chart(CUSTOM, workdir=chart))
    base = [str(_checkov()), "-o", "json"]
    reports = []
    # One root per run: given several, checkov 3.3 reported on one only (and files are not mixed
    # with directories). deploy/helm/ holds templates, scanned above as rendered.
    for args in (
        ["--framework", "kubernetes", "-d", str(rendered)],
        ["--framework", "kubernetes", "-d", str(DEPLOY), "--skip-path", "helm"],
        ["--framework", "dockerfile", "-f", str(DOCKERFILE)],
    ):
        done = run(base + args, timeout=600)
        assert done.returncode in (0, 1), done.stderr  # 1: some check failed
        reports += _reports(done.stdout)
    return reports


def _failures(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [check for report in reports for check in report["results"]["failed_checks"]]


def _skipped(check: dict[str, Any]) -> bool:
    skip = SKIPS.get(check["check_id"])
    return skip is not None and (skip[1] is None or any(check["resource"].startswith(r) for r in skip[1]))


def test_checkov_finds_nothing_outside_the_skip_list(scan: list[dict[str, Any]]) -> None:
    unexplained = [
        f"{c['check_id']} {c['check_name']}: {c['resource']} ({c['file_path']})"
        for c in _failures(scan)
        if not _skipped(c)
    ]
    assert not unexplained, "\n".join(unexplained)


def test_checkov_scanned_every_source(scan: list[dict[str, Any]]) -> None:
    types = {report["check_type"] for report in scan}
    assert types == {"kubernetes", "dockerfile"}
    files = {
        c["file_path"] for r in scan for kind in ("passed_checks", "failed_checks") for c in r["results"].get(kind, [])
    }
    names = {Path(f).name for f in files}
    assert {"kustomized.yaml", "chart-default.yaml", "chart-custom.yaml", "Dockerfile", "worker.yaml"} <= names
    resources = {c["resource"] for r in scan for c in r["results"].get("passed_checks", [])}
    assert any(r.startswith("Job.k8s-dispatch.kd-") for r in resources)  # the built Jobs
    assert sum(r["summary"]["passed"] for r in scan) > 1000


def test_every_skip_is_explained_and_still_needed(scan: list[dict[str, Any]]) -> None:
    # A skip that no longer matches a failure is stale: remove it rather than let it hide a regression.
    failed = {c["check_id"] for c in _failures(scan)}
    for check_id, (why, _) in SKIPS.items():
        assert len(why) > 40, check_id
        assert check_id in failed, f"{check_id} no longer fails: drop it from SKIPS"
