"""deploy/monitoring/: the alerting rules checked and unit-tested by promtool (built from its Go
module by tools/build.sh), the PrometheusRule equal to the plain rules file, and every PromQL
expression of the rules and the Grafana dashboard naming only metrics the workers export (read
from delivery/metrics.py's registry) and parsing as PromQL.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_files import DEPLOY, load_docs
from prometheus_client import CollectorRegistry

from k8s_dispatch.delivery.metrics import Metrics
from k8s_dispatch.lab.realcluster.binaries import build

MONITORING = DEPLOY / "monitoring"
RULES = MONITORING / "rules.yaml"
RULE_TESTS = MONITORING / "rules.test.yaml"
DASHBOARD = MONITORING / "dashboard.json"
# Series Prometheus makes itself, not the workers: the scrape's health.
PROMETHEUS_OWN = {"up"}
# Grafana's variables, as Grafana fills them in before sending a query.
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m", "$__interval": "30s", "$__range": "1h",
    # the dashboard's own, at "All"
    "$namespace": ".*", "$deployment": ".*", "$instance": ".*",
}  # fmt: skip
# Every series a panel reads is narrowed by these (several deployments share a Prometheus).
SCOPE = 'namespace=~"$namespace", deployment=~"$deployment", instance=~"$instance"'


@pytest.fixture(scope="module")
def promtool() -> Path:
    return build("promtool") / "promtool"


def run_promtool(promtool: Path, *args: str, cwd: Path = MONITORING) -> str:
    result = subprocess.run([str(promtool), *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, f"promtool {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def rule_groups() -> list[dict[str, Any]]:
    (doc,) = load_docs(RULES)
    groups = doc["groups"]
    assert isinstance(groups, list)
    return groups


def alerts() -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for group in rule_groups() for rule in group["rules"] if "alert" in rule}


def dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    assert exprs, "the dashboard has no queries"
    return exprs


# --- what the workers export ---------------------------------------------------------------


def exported_series_names() -> set[str]:
    """The series names a worker's /metrics can hold, from the registry delivery/metrics.py builds."""
    registry = CollectorRegistry()
    Metrics(registry)
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum")}
    return {family.name + suffix for family in registry.collect() for suffix in suffixes[family.type]}


# --- PromQL's metric names, read as the grammar has them ----------------------------------

_NOT_METRICS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects: identifiers outside strings, label matchers, ranges
    and label lists, that are neither functions, aggregations nor keywords."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\boffset\s+-?\w+", " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", text):
        if text[match.end() :].lstrip().startswith("(") or match.group() in _NOT_METRICS:
            continue
        names.add(match.group())
    return names


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('sum by (state) (rate(a_total{state=~"X|Y", le="0.5"}[5m]))', {"a_total"}),
        ("max(a and on (instance) (changes(b[2m]) > 0)) > 30", {"a", "b"}),
        ("histogram_quantile(0.99, sum by (le) (rate(c_bucket[5m])))", {"c_bucket"}),
        ("sum(rate(x[5m] offset 1h)) / sum without (pod, instance) (rate(y[5m]))", {"x", "y"}),
        ('absent(up{job="w"} == 1) or vector(0)', {"up"}),
        ("time() - max(t)", {"t"}),
        ("a > bool 1e3", {"a"}),
    ],
)
def test_metric_names_reads_the_selectors_out_of_an_expression(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


# --- the rules -----------------------------------------------------------------------------


def test_promtool_checks_the_rules_and_the_example_prometheus_config(promtool: Path) -> None:
    out = run_promtool(promtool, "check", "rules", RULES.name)
    assert f"SUCCESS: {len(alerts())} rules found" in out
    out = run_promtool(promtool, "check", "config", "prometheus.example.yml")
    assert "SUCCESS: 1 rule files found" in out


def test_promtool_runs_the_rules_unit_tests(promtool: Path) -> None:
    out = run_promtool(promtool, "test", "rules", RULE_TESTS.name)
    assert "SUCCESS" in out and "FAILED" not in out


def test_every_alert_has_a_unit_test_where_it_fires_and_one_where_it_stays_quiet() -> None:
    doc = yaml.safe_load(RULE_TESTS.read_text(encoding="utf-8"))
    assert doc["rule_files"] == [RULES.name]
    fires: set[str] = set()
    quiet: set[str] = set()
    for case in doc["tests"]:
        for check in case.get("alert_rule_test", []):
            (fires if check.get("exp_alerts") else quiet).add(check["alertname"])
    assert fires == set(alerts()), f"alerts never seen firing: {set(alerts()) - fires}"
    assert quiet == set(alerts()), f"alerts never seen quiet: {set(alerts()) - quiet}"


def test_the_prometheusrule_holds_exactly_the_rules_file() -> None:
    (rule,) = load_docs(MONITORING / "prometheusrule.yaml")
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert rule["spec"] == {"groups": rule_groups()}


def test_every_alert_says_how_bad_and_what_happened() -> None:
    for name, rule in alerts().items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name


def test_the_podmonitor_scrapes_the_workers_metrics_port_as_the_job_the_alerts_name() -> None:
    (monitor,) = load_docs(MONITORING / "podmonitor.yaml")
    (worker,) = [d for d in load_docs(DEPLOY / "worker.yaml") if d["kind"] == "Deployment"]
    template = worker["spec"]["template"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    ports = {p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
    assert endpoint["port"] in ports
    assert {"targetLabel": "job", "replacement": "k8s-dispatch-worker"} in endpoint["relabelings"]
    assert all(
        'job="k8s-dispatch-worker"' in rule["expr"] for rule in alerts().values() if "up" in metric_names(rule["expr"])
    )


# --- every expression: on exported metrics, and valid PromQL -------------------------------


def test_every_expression_names_only_metrics_the_workers_export() -> None:
    exported = exported_series_names() | PROMETHEUS_OWN
    assert "k8s_dispatch_poll_lag_seconds" in exported  # the registry was read
    for expr in [rule["expr"] for rule in alerts().values()] + dashboard_expressions():
        unknown = metric_names(expr) - exported
        assert not unknown, f"{expr!r} names {unknown}, which no worker exports"


def test_every_metric_the_workers_export_is_on_the_dashboard() -> None:
    shown = {name for expr in dashboard_expressions() for name in metric_names(expr)}
    families = {name.removesuffix("_total").removesuffix("_bucket") for name in shown}
    registry = CollectorRegistry()
    Metrics(registry)
    missing = {family.name for family in registry.collect()} - families
    assert not missing, f"exported but on no panel: {missing}"


def test_the_dashboards_expressions_parse_as_promql(promtool: Path, tmp_path: Path) -> None:
    """As recording rules, so that promtool's own parser reads every one (Grafana's variables filled in)."""
    rules = []
    for i, expr in enumerate(dashboard_expressions()):
        for variable, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, expr
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}), encoding="utf-8")
    out = run_promtool(promtool, "check", "rules", str(path), cwd=tmp_path)
    assert f"SUCCESS: {len(rules)} rules found" in out


def test_the_dashboard_is_grafana_json_over_a_prometheus_datasource_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert dashboard["uid"] == "k8s-dispatch" and dashboard["schemaVersion"] >= 36
    variable, *scopes = dashboard["templating"]["list"]
    assert (variable["name"], variable["type"], variable["query"]) == ("datasource", "datasource", "prometheus")
    # Importable: Grafana's import asks for the datasource the __inputs block names.
    (source,) = dashboard["__inputs"]
    assert (source["type"], source["pluginId"]) == ("datasource", "prometheus")
    assert variable["current"]["value"] == "${" + source["name"] + "}"
    assert [v["name"] for v in scopes] == ["namespace", "deployment", "instance"]
    for scope in scopes:
        assert scope["type"] == "query" and scope["includeAll"] and scope["allValue"] == ".*", scope["name"]
        assert 'job="k8s-dispatch-worker"' in scope["query"]["query"], scope["name"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["targets"] and panel["description"], panel["title"]


def test_every_series_on_the_dashboard_is_narrowed_to_the_chosen_deployment() -> None:
    selectors = re.compile(r"\b(k8s_dispatch_[a-z_]+|up)\b(\{[^}]*\})?")
    for expr in dashboard_expressions():
        found = selectors.findall(expr)
        assert found, expr
        for name, matchers in found:
            assert SCOPE in matchers, f"{name} in {expr}"
