"""The documentation site agrees with the code and the deploy files.

The configuration reference pages are generated from the code (docs/gen_reference.py): they must
be what the code renders now. Every alert of the rules files has its runbook page, listed in the
site's navigation, and its `runbook_url` annotation points at that page on the published site.
The proofs the guarantees page cites exist, and the pages carry no run diaries. The Benchmarks
pages are generated from the published bench runs (docs/gen_bench.py), one page per benchmark a run
holds. The README stays a front page: under 200 lines, its engine example intact, its links into
the site resolving.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MKDOCS = ROOT / "mkdocs.yml"
RUNBOOKS = DOCS / "runbooks"
# The alerts as Prometheus reads them, as the Operator does, and as the chart ships them.
RULE_FILES = {
    "deploy/monitoring/rules.yaml": lambda doc: doc["groups"],
    "deploy/monitoring/prometheusrule.yaml": lambda doc: doc["spec"]["groups"],
    "deploy/helm/k8s-dispatch/files/rules.yaml": lambda doc: doc["groups"],
}


README = ROOT / "README.md"
README_MAX_LINES = 200


def _generator(name: str = "gen_reference") -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, DOCS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and typing resolve names through it
    spec.loader.exec_module(module)
    return module


class _MkdocsLoader(yaml.SafeLoader):
    """mkdocs.yml names Python objects (`!!python/name:`): read them as their names."""


_MkdocsLoader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: suffix)


def _mkdocs() -> dict[str, Any]:
    config: dict[str, Any] = yaml.load(MKDOCS.read_text(encoding="utf-8"), Loader=_MkdocsLoader)
    return config


def _nav_pages(node: object) -> set[str]:
    if isinstance(node, str):
        return {node}
    if isinstance(node, list):
        return set().union(*(_nav_pages(item) for item in node)) if node else set()
    if isinstance(node, dict):
        return set().union(*(_nav_pages(value) for value in node.values())) if node else set()
    return set()


def _alerts(path: str) -> dict[str, dict[str, Any]]:
    doc = yaml.safe_load((ROOT / path).read_text(encoding="utf-8"))
    return {rule["alert"]: rule for group in RULE_FILES[path](doc) for rule in group["rules"] if "alert" in rule}


def test_reference_pages_are_what_the_code_renders() -> None:
    stale = _generator().stale_pages()
    assert not stale, (
        f"{[str(p.relative_to(ROOT)) for p in stale]} differ from the code: python docs/gen_reference.py --write"
    )


def test_settings_page_names_every_setting() -> None:
    settings = importlib.import_module("k8s_dispatch.core.settings")
    text = (DOCS / "reference" / "settings.md").read_text(encoding="utf-8")
    missing = [
        name for name in settings.Settings.model_fields if f"### `{settings.ENV_PREFIX}{name.upper()}`" not in text
    ]
    assert not missing


def test_capabilities_page_names_every_field() -> None:
    from k8s_dispatch.workers import resolver

    text = (DOCS / "reference" / "capabilities.md").read_text(encoding="utf-8")
    assert [name for name in resolver._FIELDS if f"### `{name}`" not in text] == []


@pytest.mark.parametrize("path", sorted(RULE_FILES))
def test_every_alert_has_a_runbook_page_in_the_navigation(path: str) -> None:
    nav = _nav_pages(_mkdocs()["nav"])
    for alert in _alerts(path):
        assert (RUNBOOKS / f"{alert}.md").is_file(), f"{alert} has no docs/runbooks/{alert}.md"
        assert f"runbooks/{alert}.md" in nav, f"mkdocs.yml's nav does not list runbooks/{alert}.md"


def test_every_runbook_page_is_an_alerts() -> None:
    alerts = set(_alerts("deploy/monitoring/rules.yaml"))
    pages = {page.stem for page in RUNBOOKS.glob("*.md")} - {"index"}
    assert pages == alerts


@pytest.mark.parametrize("path", sorted(RULE_FILES))
def test_every_alert_links_its_runbook(path: str) -> None:
    site = _mkdocs()["site_url"].rstrip("/") + "/"
    wrong = {
        alert: rule.get("annotations", {}).get("runbook_url")
        for alert, rule in _alerts(path).items()
        if rule.get("annotations", {}).get("runbook_url") != f"{site}runbooks/{alert}/"
    }
    assert not wrong, f"{path}: runbook_url must be {site}runbooks/<alert>/: {wrong}"


def test_guarantees_cite_proofs_that_exist() -> None:
    text = (DOCS / "design" / "guarantees.md").read_text(encoding="utf-8")
    cited = set(re.findall(r"`(tests/[\w/]+\.py)`", text))
    assert cited, "the guarantees page cites no test"
    assert sorted(p for p in cited if not (ROOT / p).is_file()) == []


def test_pages_carry_no_run_diaries() -> None:
    diary = re.compile(r"\bissues? #?\d+|still to be measured|load average", re.IGNORECASE)
    found = [
        f"{page.relative_to(ROOT)}: {match.group(0)}"
        for page in sorted(DOCS.rglob("*.md"))
        for match in diary.finditer(page.read_text(encoding="utf-8"))
    ]
    assert found == []


def test_other_languages_page_names_every_column_and_the_schema_head() -> None:
    """An engine writing rows itself follows this page: a new column or revision must reach it."""
    from k8s_dispatch.store import migrate
    from k8s_dispatch.store.models import CaseEvent, Dispatch

    text = (DOCS / "engine" / "other-languages.md").read_text(encoding="utf-8")
    columns = [column.name for model in (Dispatch, CaseEvent) for column in model.__table__.columns]
    assert [name for name in columns if f"`{name}`" not in text] == []
    assert f"revision `{migrate.head()}`" in text


def test_readme_stays_under_200_lines() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines: move the detail into docs/"


def test_readme_keeps_its_engine_example() -> None:
    """tests/test_install.py runs these two blocks verbatim from the README."""
    text = README.read_text(encoding="utf-8")
    for name in ("tasks.py", "schedule.py"):
        assert f"<!-- engine-example: {name} -->\n```python\n" in text


def test_readme_links_resolve() -> None:
    """The README's links into the repository and the site lead to files that exist."""
    text = README.read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [t.split("#")[0] for t in targets if "://" not in t and not t.startswith("#")]
    assert local, "the README links nowhere into the site"
    assert sorted(t for t in local if not (ROOT / t).exists()) == []


def test_readme_says_what_it_solves_once() -> None:
    """The problem and the durable stores are stated once, at the top, not again further down."""
    text = " ".join(README.read_text(encoding="utf-8").split())
    assert text.count("durable stores") == 1
    assert "The cluster and the database are the only durable stores" in text
    assert text.index("durable stores") < text.index("## The two commands")


def test_benchmark_pages_are_what_the_runs_render() -> None:
    bench = _generator("gen_bench")
    stale = bench.stale_pages()
    assert not stale, (
        f"{[str(p.relative_to(ROOT)) for p in stale]} differ from the runs: python docs/gen_bench.py --write"
    )


def test_every_benchmark_page_is_in_the_navigation() -> None:
    bench = _generator("gen_bench")
    nav = _nav_pages(_mkdocs()["nav"])
    pages = {str(page.relative_to(DOCS)) for page in bench.pages()}
    assert pages, "no benchmark run is published"
    assert sorted(pages - nav) == []
    assert sorted(p for p in nav if p.startswith("benchmarks/") and p not in pages) == []


def test_every_published_run_names_its_machine_and_load() -> None:
    bench = _generator("gen_bench")
    for run in bench.runs():
        machine = run.data["machine"]
        assert machine["cpus"] and machine["load_average_at_start"] and machine["load_average_at_end"], run.path
        page_texts = [page.read_text(encoding="utf-8") for page in (DOCS / "benchmarks").glob("*.md")]
        assert any(run.heading in text and run.path.name in text for text in page_texts), run.path
