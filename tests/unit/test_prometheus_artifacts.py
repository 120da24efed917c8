"""The Prometheus side: rules, rule unit tests, scrape configs and the exposition, checked by promtool.

promtool comes with Debian's ``prometheus`` package. Without it these tests skip, except where
``GPUMEMD_REQUIRE_PROMETHEUS=1`` (CI), where a missing promtool is a failure.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prom_binaries import require_binary
from prometheus_client import CollectorRegistry, generate_latest
from test_exporter_collector import full_live, full_state

from gpumemd.exporter.collector import StateCollector

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "exporters" / "prometheus"
RULES = PROM / "rules" / "gpumemd.rules.yml"


def run(*args: str, stdin: bytes | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(args, input=stdin, cwd=cwd, capture_output=True, timeout=60, check=False)


def test_rules_pass_promtool_check() -> None:
    result = run(require_binary("promtool"), "check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


@pytest.mark.parametrize("tests", ["gpumemd.rules.test.yml", "gpumemd.rules.runs.test.yml"])
def test_rule_unit_tests_pass(tests: str) -> None:
    result = run(require_binary("promtool"), "test", "rules", tests, cwd=RULES.parent)
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


def test_a_wrong_expectation_fails_the_rule_unit_tests(tmp_path: Path) -> None:
    # The rule tests can fail: change one expected value and promtool must say so.
    shutil.copy(RULES, tmp_path / RULES.name)
    text = (RULES.parent / "gpumemd.rules.test.yml").read_text()
    assert "2h 0m 0s" in text
    (tmp_path / "t.yml").write_text(text.replace("2h 0m 0s", "2h 0m 1s"))
    result = run(require_binary("promtool"), "test", "rules", "t.yml", cwd=tmp_path)
    assert result.returncode != 0


@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus-file-sd.yml"])
def test_scrape_configs_pass_promtool_check(config: str) -> None:
    result = run(require_binary("promtool"), "check", "config", config, cwd=PROM)
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


def test_every_alert_says_what_to_do() -> None:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    alerts = [rule for group in groups for rule in group["rules"] if "alert" in rule]
    names = {rule["alert"] for rule in alerts}
    assert names >= {"GpumemdLeakConfirmed", "GpumemdOOMProjected", "GpumemdAllocatorRetriesRising",
                     "GpumemdFragmentationHigh", "GpumemdNonPyTorchMemoryGrowing", "GpumemdAgentDown"}
    for rule in alerts:
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        assert rule["annotations"]["summary"].strip(), rule["alert"]
        assert len(rule["annotations"]["description"]) > 80, rule["alert"]
    tested = (RULES.parent / "gpumemd.rules.test.yml").read_text()
    for name in names:
        assert f"alertname: {name}" in tested, f"{name} has no promtool unit test"


def _alerts() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def _slug(heading: str) -> str:
    """The anchor GitHub and mkdocs give a Markdown heading."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


def test_every_alert_links_its_runbook_section() -> None:
    docs = ROOT / "docs" / "prometheus-grafana.md"
    runbook = docs.read_text().split("## Alert runbook", 1)[1].split("\n## ", 1)[0]
    anchors = {_slug(line[4:]) for line in runbook.splitlines() if line.startswith("### ")}
    for rule in _alerts():
        url = rule["annotations"]["runbook_url"]
        path, _, anchor = url.partition("#")
        assert (ROOT / path) == docs, (rule["alert"], url)
        assert anchor == rule["alert"].lower() and anchor in anchors, (rule["alert"], url, sorted(anchors))


def test_no_rule_drops_the_targets_labels() -> None:
    # Aggregations and joins name what they drop (`without`, `ignoring`): a fixed `by`/`on` list would lose
    # cluster, training_job, namespace or pod, whatever the scrape config adds.
    groups = yaml.safe_load(RULES.read_text())["groups"]
    for rule in (rule for group in groups for rule in group["rules"]):
        assert not re.search(r"\b(by|on)\s*\(", rule["expr"]), rule.get("alert", rule.get("record"))


def test_file_sd_example_and_podmonitor_are_well_formed() -> None:
    import json

    for group in json.loads((PROM / "file_sd" / "gpumemd-example-job.json").read_text()):
        assert group["targets"] and all(":" in t for t in group["targets"])
    monitor = yaml.safe_load((PROM / "kubernetes" / "podmonitor.yaml").read_text())
    assert monitor["kind"] == "PodMonitor" and monitor["apiVersion"] == "monitoring.coreos.com/v1"
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    assert [e["port"] for e in endpoints] == [f"gpumemd-{r}" for r in range(8)]
    assert all(e["path"] == "/metrics" for e in endpoints)
    # the pod's gpumemd.io/training-job label becomes the training_job the alerts and the dashboard use
    assert all({"sourceLabels": ["__meta_kubernetes_pod_label_gpumemd_io_training_job"],
                "targetLabel": "training_job"} in e["relabelings"] for e in endpoints)


def test_file_sd_writer_lists_one_target_per_local_rank() -> None:
    import json

    script = PROM / "file_sd" / "write_targets.sh"
    result = run("bash", str(script), "job-7", "9400", "2", "node-a", "node-b")
    assert result.returncode == 0, result.stderr.decode()
    groups = json.loads(result.stdout)
    assert [g["targets"] for g in groups] == [["node-a:9400", "node-a:9401"], ["node-b:9400", "node-b:9401"]]
    assert groups[0]["labels"] == {"training_job": "job-7", "node": "node-a"}


def test_exposition_passes_promtool_check_metrics() -> None:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StateCollector(full_state, live=full_live))
    exposition = generate_latest(registry)

    result = run(require_binary("promtool"), "check", "metrics", stdin=exposition)

    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
    assert result.stdout.strip() == b"" and result.stderr.strip() == b"", "promtool had lint remarks"


def test_promtool_check_metrics_does_complain_about_bad_names() -> None:
    # The check above can fail: a counter without _total is a lint remark.
    bad = b"# HELP gpumemd_bad A counter.\n# TYPE gpumemd_bad counter\ngpumemd_bad 1\n"
    result = run(require_binary("promtool"), "check", "metrics", stdin=bad)
    assert result.returncode != 0 or (result.stdout + result.stderr).strip()
