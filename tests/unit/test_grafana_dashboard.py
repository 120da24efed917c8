"""The Grafana dashboard and provisioning, checked without a Grafana server.

The rules are those of Grafana's dashboard-linter (templated datasource, job/instance variables,
panel datasource, titles and descriptions, units, $__rate_interval, job/instance matchers), plus:
every query parses as PromQL (promtool), every metric it names is really emitted, ids are unique,
panels sit inside the 24-column grid without overlapping.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from prom_binaries import require_binary
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_exporter_collector import full_state

from gpumemd.exporter.collector import StateCollector
from gpumemd.exporter.metrics import BY_NAME

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "grafana"
DASHBOARD = json.loads((GRAFANA / "dashboards" / "gpumemd.json").read_text())
PANELS = [p for p in DASHBOARD["panels"] if p["type"] != "row"]
ROWS = [p for p in DASHBOARD["panels"] if p["type"] == "row"]
VARS = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
DS_REFS = {"$datasource", "${datasource}"}
# Grafana's unit ids used here (packages/grafana-data/src/valueFormats/categories.ts).
VALID_UNITS = {"bytes", "decbytes", "s", "ms", "percentunit", "percent", "short", "none", "ops"}
METRIC = re.compile(r"\b(gpumemd_[a-z0-9_]+|up)\b(\{[^}]*\})?")


def queries() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in PANELS for t in p["targets"]]


def metrics_in(expr: str) -> list[tuple[str, str]]:
    """(metric, its selector braces or '') for every metric an expression names."""
    without_strings = re.sub(r'"[^"]*"', '""', expr)
    names = {m.group(1) for m in METRIC.finditer(without_strings)}
    return [(m.group(1), m.group(2) or "") for m in METRIC.finditer(expr) if m.group(1) in names]


def exposed() -> set[str]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StateCollector(full_state))
    text = generate_latest(registry).decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_committed_json_is_what_the_generator_writes() -> None:
    spec = importlib.util.spec_from_file_location("generate_dashboard", GRAFANA / "generate_dashboard.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (GRAFANA / "dashboards" / "gpumemd.json").read_text() == module.render(), (
        "run: python grafana/generate_dashboard.py"
    )


def test_file_provisioning_can_load_it_as_is() -> None:
    assert "__inputs" not in DASHBOARD and "__requires" not in DASHBOARD
    assert DASHBOARD["uid"] == "gpumemd" and DASHBOARD["title"]
    assert DASHBOARD.get("id") is None
    assert "${DS_" not in json.dumps(DASHBOARD)  # export-style placeholders file provisioning cannot resolve


def test_templated_datasource() -> None:  # dashboard-linter: template-datasource-rule
    datasources = [v for v in DASHBOARD["templating"]["list"] if v["type"] == "datasource"]
    assert len(datasources) == 1
    [ds] = datasources
    assert ds["name"] == "datasource" and ds["label"] == "Data Source" and ds["query"] == "prometheus"


@pytest.mark.parametrize("name", ["job", "instance", "rank", "device"])
def test_query_variables(name: str) -> None:  # template-job-rule, template-instance-rule, on-time-change
    var = VARS[name]
    assert var["type"] == "query" and var["label"] == name
    assert var["datasource"]["uid"] in DS_REFS
    assert var["multi"] is True and var["includeAll"] is True and var["allValue"] == ".+"
    assert var["refresh"] == 2
    assert var["query"]["query"].startswith("label_values(")


def test_dashboard_is_not_editable_in_the_ui() -> None:  # template-uneditable-rule
    assert DASHBOARD["editable"] is False


def test_rows_cover_the_story() -> None:
    assert [r["title"] for r in ROWS] == ["Overview", "Allocator", "Fragmentation", "Census by category",
                                         "Step phases", "Host", "Agent"]


def test_every_panel_titled_described_and_on_the_datasource_variable() -> None:
    for panel in PANELS:  # panel-title-description-rule, panel-datasource-rule
        assert panel["title"].strip(), panel
        assert len(panel.get("description", "")) > 20, panel["title"]
        assert panel["datasource"]["uid"] in DS_REFS, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] in DS_REFS, panel["title"]


def test_units() -> None:  # panel-units-rule, plus: bytes means IEC ("bytes"), never SI ("decbytes")
    for panel in PANELS:
        defaults = panel["fieldConfig"]["defaults"]
        unit = defaults.get("unit")
        assert unit in VALID_UNITS or defaults.get("mappings"), (panel["title"], unit)
        exprs = " ".join(t["expr"] for t in panel["targets"])
        names = {name for name, _ in metrics_in(exprs)}
        if names and all(n.endswith("_bytes") for n in names):
            expected = "percentunit" if " / " in exprs else "bytes"
            assert unit == expected, (panel["title"], unit)
        if names and all(n.endswith("_seconds") for n in names):
            assert unit == "s", (panel["title"], unit)
        assert unit != "decbytes", panel["title"]


def test_every_selector_filters_job_and_instance() -> None:  # target-job-rule, target-instance-rule
    for title, expr in queries():
        found = metrics_in(expr)
        assert found, (title, expr)
        for name, braces in found:
            assert 'job=~"$job"' in braces and 'instance=~"$instance"' in braces, (title, name, expr)
            if name != "up":
                assert 'rank=~"$rank"' in braces, (title, name)


def test_rates_use_rate_interval() -> None:  # target-rate-interval-rule
    for title, expr in queries():
        for match in re.finditer(r"\b(rate|irate|increase)\(", expr):
            rest = expr[match.end():]
            assert re.match(r"[^\[]*\[\$__rate_interval\]", rest), (title, expr)


def test_every_metric_a_query_names_is_really_emitted() -> None:
    emitted = exposed()
    used = {name for _, expr in queries() for name, _ in metrics_in(expr)} - {"up"}
    for var in VARS.values():
        if var["type"] == "query":
            used |= {name for name, _ in metrics_in(var["query"]["query"])}
    assert used, "no metric found in the dashboard"
    assert used <= set(BY_NAME), used - set(BY_NAME)
    assert used <= emitted, used - emitted


def test_unique_ids_and_panels_inside_the_grid() -> None:
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in DASHBOARD["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["h"] > 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        covered = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not covered & cells, f"{panel['title']} overlaps another panel"
        cells |= covered


def substitute(expr: str) -> str:
    """Grafana's variables as a Prometheus would see them with everything selected."""
    return expr.replace("$__rate_interval", "1m").replace("$job", ".+").replace("$instance", ".+") \
        .replace("$rank", ".+").replace("$device", ".+")


def test_every_query_parses_as_promql(tmp_path: Path) -> None:  # target-promql-rule, template-label-promql
    exprs = [substitute(expr) for _, expr in queries()]
    for var in VARS.values():
        if var["type"] == "query":
            inner = re.fullmatch(r"label_values\((.*),\s*\w+\)", var["query"]["query"])
            assert inner, var["query"]
            exprs.append(substitute(inner.group(1)))
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard_query_{i}", "expr": expr} for i, expr in enumerate(exprs)]}]}
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run([require_binary("promtool"), "check", "rules", str(path)],
                            capture_output=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


def test_a_broken_query_would_be_caught(tmp_path: Path) -> None:
    tool = require_binary("promtool")
    path = tmp_path / "bad.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [
        {"record": "x", "expr": 'rate(gpumemd_steps_total{job=~".+"}[1m]'}]}]}))
    result = subprocess.run([tool, "check", "rules", str(path)], capture_output=True, timeout=60, check=False)
    assert result.returncode != 0


def test_provisioning_files() -> None:
    datasources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "gpumemd.yaml").read_text())
    assert datasources["apiVersion"] == 1
    assert [d["type"] for d in datasources["datasources"]] == ["prometheus"]
    providers = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "gpumemd.yaml").read_text())
    assert providers["apiVersion"] == 1
    [provider] = providers["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]
