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
from test_exporter_collector import full_live, full_state

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
    registry.register(StateCollector(full_state, live=full_live))
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
    assert [r["title"] for r in ROWS] == ["Overview", "Allocator (CUDA)", "Fragmentation (CUDA)",
                                         "Census by category", "Step profile", "Host", "Agent"]


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
            assert 'training_job=~"$training_job"' in braces, (title, name, expr)
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
        .replace("$rank", ".+").replace("$device", ".+").replace("$training_job", ".*")


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


# --- what the panels say: allocator-aware headroom, units, healthy states, alerts ----


def panel(title: str) -> dict:
    [found] = [p for p in PANELS if p["title"] == title]
    return found


def evaluate(tmp_path: Path, expr: str, series: dict[str, str], expected: list[tuple[str, float]]) -> None:
    """Promtool evaluates a dashboard query on ``series`` (selector -> values) and checks its samples."""
    (tmp_path / "none.yml").write_text(yaml.safe_dump({"groups": []}))
    test = {"rule_files": ["none.yml"], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [{"series": name, "values": values} for name, values in series.items()],
        "promql_expr_test": [{"expr": substitute(expr), "eval_time": "1m",
                              "exp_samples": [{"labels": labels, "value": v} for labels, v in expected]}],
    }]}
    (tmp_path / "t.yml").write_text(yaml.safe_dump(test))
    result = subprocess.run([require_binary("promtool"), "test", "rules", "t.yml"], cwd=tmp_path,
                            capture_output=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


JOB = 'job="gpumemd",instance="n:9400",rank="0",local_rank="0"'
GIB = 1024**3


def test_device_headroom_counts_the_allocator_cache_as_free(tmp_path: Path) -> None:
    # NVML: 1 GiB free; the allocator holds 30 GiB of which tensors use 6: 25 GiB are really available.
    stat_panel = panel("Device headroom")
    target, host_target = stat_panel["targets"]
    series = {
        f'gpumemd_device_free_bytes{{{JOB},device="0"}}': f"{GIB}x2",
        f'gpumemd_allocator_reserved_bytes{{{JOB},device="0"}}': f"{30 * GIB}x2",
        f'gpumemd_allocator_allocated_bytes{{{JOB},device="0"}}': f"{6 * GIB}x2",
        # a device whose allocator is not read yet: NVML's figure
        f'gpumemd_device_free_bytes{{{JOB},device="1"}}': f"{3 * GIB}x2",
    }
    evaluate(tmp_path, target["expr"], series, [(f'{{{JOB},device="0"}}', 25 * GIB),
                                                (f'gpumemd_device_free_bytes{{{JOB},device="1"}}', 3 * GIB)])
    steps = stat_panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [s["color"] for s in steps if s["value"] is not None and s["value"] <= 25 * GIB][-1] == "green"
    # a rank with a GPU shows no host line; the CPU rank beside it does
    cpu_job = JOB.replace('rank="0"', 'rank="1"')
    evaluate(tmp_path, host_target["expr"], {**series, f"gpumemd_host_available_bytes{{{JOB}}}": f"{GIB}x2",
                                             f"gpumemd_host_available_bytes{{{cpu_job}}}": f"{2 * GIB}x2"},
             [(f"gpumemd_host_available_bytes{{{cpu_job}}}", 2 * GIB)])


def test_headline_panels_show_host_memory_on_a_cpu_job() -> None:
    titles = {t["legendFormat"] for t in panel("Memory at step end vs the device")["targets"]}
    assert {"{{instance}} r{{rank}} host RSS (no GPU)", "{{instance}} r{{rank}} host limit (no GPU)"} <= titles


def test_leak_state_reads_healthy_without_a_finding(tmp_path: Path) -> None:
    stat_panel = panel("Leak state")
    [target] = stat_panel["targets"]
    series = {
        f'gpumemd_info{{{JOB},version="1",world_size="2",hostname="n",launcher="torchrun"}}': "1x2",
        'gpumemd_info{job="gpumemd",instance="n:9401",rank="1",local_rank="1",version="1",world_size="2",'
        'hostname="n",launcher="torchrun"}': "1x2",
        'gpumemd_leak_state{job="gpumemd",instance="n:9401",rank="1",local_rank="1",kind="tensor_leak",'
        'device="0"}': "2x2",
    }
    # rank 0 has no finding: one 0 ("healthy"); rank 1's confirmed finding, and no healthy line beside it
    evaluate(tmp_path, target["expr"], series,
             [('{instance="n:9400",rank="0"}', 0), ('{instance="n:9401",rank="1",kind="tensor_leak"}', 2)])
    [mapping] = stat_panel["fieldConfig"]["defaults"]["mappings"]
    assert mapping["options"]["0"] == {"text": "healthy", "color": "green"}
    assert mapping["options"]["2"]["text"] == "confirmed"


def test_leak_slope_is_bytes_per_step() -> None:
    slope = panel("Leak slope")
    defaults = slope["fieldConfig"]["defaults"]
    assert defaults["unit"] == "bytes"  # IEC scaling; Grafana has no bytes-per-step unit
    assert "step" in defaults["custom"]["axisLabel"]
    assert all(t["legendFormat"].endswith("per step") for t in slope["targets"])
    assert "bytes per training step" in slope["description"]


def test_time_since_the_last_step_is_on_the_dashboard() -> None:
    since = panel("Since the last step")
    [target] = since["targets"]
    assert target["expr"].startswith("time() - gpumemd_last_step_timestamp_seconds{")
    assert since["fieldConfig"]["defaults"]["unit"] == "s"


def test_firing_gpumemd_alerts_are_annotations(tmp_path: Path) -> None:
    annotations = DASHBOARD["annotations"]["list"]
    [alerts] = [a for a in annotations if "expr" in a]
    assert alerts["enable"] is True and alerts["datasource"]["uid"] in DS_REFS
    expr = alerts["expr"]
    assert expr.startswith("ALERTS{") and 'alertname=~"Gpumemd.*"' in expr and 'alertstate="firing"' in expr
    assert 'job=~"$job"' in expr and 'instance=~"$instance"' in expr
    assert "rank" not in expr  # GpumemdAgentDown has no rank label: a rank matcher would hide it
    assert "{{alertname}}" in alerts["titleFormat"]
    # the rules' alert names all match it
    rules = yaml.safe_load((ROOT / "exporters" / "prometheus" / "rules" / "gpumemd.rules.yml").read_text())
    names = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    assert names and all(re.fullmatch("Gpumemd.*", n) for n in names)
    series = {'ALERTS{alertname="GpumemdAgentDown",alertstate="firing",job="gpumemd",instance="n:9400",'
              'severity="warning"}': "1x2",
              'ALERTS{alertname="Other",alertstate="firing",job="gpumemd",instance="n:9400"}': "1x2"}
    evaluate(tmp_path, expr, series, [('ALERTS{alertname="GpumemdAgentDown",alertstate="firing",job="gpumemd",'
                                       'instance="n:9400",severity="warning"}', 1)])


def test_a_training_job_variable_picks_one_job_among_many(tmp_path: Path) -> None:
    var = VARS["training_job"]
    assert var["type"] == "query" and var["multi"] is True and var["includeAll"] is True
    assert var["query"]["query"] == 'label_values(gpumemd_info{job=~"$job"}, training_job)'
    assert var["allValue"] == ".*"  # "All" keeps the targets no file_sd or PodMonitor labelled
    names = [v["name"] for v in DASHBOARD["templating"]["list"]]
    assert names.index("training_job") < names.index("instance") < names.index("rank")
    assert 'training_job=~"$training_job"' in VARS["instance"]["query"]["query"]
    # one job selected: only its ranks; "All": the unlabelled static target too
    expr = panel("Host memory available")["targets"][0]["expr"]
    series = {f'gpumemd_host_available_bytes{{{JOB},training_job="llm-7"}}': "5x2",
              'gpumemd_host_available_bytes{job="gpumemd",instance="m:9400",rank="0",local_rank="0",'
              'training_job="llm-8"}': "6x2",
              'gpumemd_host_available_bytes{job="gpumemd",instance="s:9400",rank="0",local_rank="0"}': "7x2"}
    evaluate(tmp_path, expr.replace("$training_job", "llm-7"), series,
             [(f'gpumemd_host_available_bytes{{{JOB},training_job="llm-7"}}', 5)])
    evaluate(tmp_path, expr, series, [(name, float(v[0])) for name, v in series.items()])


def test_cuda_only_panels_say_so_on_a_job_without_cuda() -> None:
    rows = DASHBOARD["panels"]
    cuda_rows = {"Allocator (CUDA)", "Fragmentation (CUDA)"}
    current, seen = "", 0
    for item in rows:
        if item["type"] == "row":
            current = item["title"]
        elif current in cuda_rows:
            assert item["fieldConfig"]["defaults"]["noValue"].startswith("No CUDA device in this job"), item["title"]
            seen += 1
    assert seen == 7


def test_projected_time_to_oom_is_time() -> None:
    projected = panel("Projected time to OOM")
    assert projected["fieldConfig"]["defaults"]["unit"] == "s"
    [target] = projected["targets"]
    assert target["expr"].startswith("gpumemd_leak_seconds_to_oom{")
    rules = (ROOT / "exporters" / "prometheus" / "rules" / "gpumemd.rules.yml").read_text()
    assert '"Projected time to OOM" panel' in rules  # the alert's description names this panel
