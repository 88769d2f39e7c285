"""The documentation site agrees with the code and the deploy files.

The configuration reference pages are generated from the code (docs/gen_reference.py): they must
be what the code renders now. Every alert of the rules files has its runbook page, listed in the
site's navigation, and its `runbook_url` annotation points at that page on the published site.
The proofs the guarantees page cites exist, and the pages carry no run diaries.
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


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
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
