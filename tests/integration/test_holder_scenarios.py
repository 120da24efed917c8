"""The holder path at DEFAULT settings: a leak kept by each kind of container, in its own training
loop, is found with the right kind, and its sentence starts the path at the name the script wrote;
one cause that grows several groups of tensors is one finding that lists them, with their total rate.
Scenarios: holder_scenarios.py."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
from holder_scenarios import CAUSES, SCENARIOS, HolderScenario, hook_appending_to_a_global, run_holder_scenario

from gpumemd.cli import main


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_the_path_starts_at_the_name_in_the_script(scenario: HolderScenario, out_dir: str) -> None:
    outcome = run_holder_scenario(scenario, out_dir)

    assert outcome.findings, f"{scenario.name}: no finding"
    leak = [f for f in outcome.findings if "float32[128, 128]" in f.summary]
    assert leak, [f.summary for f in outcome.findings]
    assert leak[0].kind == scenario.kind, leak[0].summary
    assert f"held by {scenario.first_name}" in leak[0].summary, leak[0].summary
    assert "path cut" not in leak[0].summary and "dict key" not in leak[0].summary
    # beside where the holder lives, the line that adds to it: in the sentence, the line logged
    # (said shorter there when the line is long: "appended at line 57") and the finding's field
    added = scenario.added_at()
    where = added.split(" at ")[1] if added else None
    assert leak[0].added_at == where, leak[0].summary
    if added is not None and where is not None:
        assert f"{scenario.first_name}" in leak[0].summary and f", {added}" in leak[0].summary, leak[0].summary
        verb, line = added.split(" at ")[0], where.rpartition(":")[2]
        assert re.search(rf", {verb} at (\S*holder_scenarios\.py:|line ){line}\b", leak[0].headline), leak[0].headline


@pytest.mark.parametrize("scenario", CAUSES, ids=[s.name for s in CAUSES])
def test_one_cause_is_one_finding(scenario: HolderScenario, out_dir: str) -> None:
    outcome = run_holder_scenario(scenario, out_dir)

    assert len(outcome.findings) == 1, [f.summary for f in outcome.findings]
    finding = outcome.findings[0]
    assert finding.state == "confirmed" and finding.kind == scenario.kind, finding.summary
    assert sorted(c.description for c in finding.culprits) == sorted(scenario.groups), finding.summary
    assert all(group in finding.summary for group in scenario.groups), finding.summary
    # the total rate: one tensor of each group per step
    assert finding.tensors_per_step is not None and round(finding.tensors_per_step) == len(scenario.groups)
    assert f"+{len(scenario.groups)} tensors/step" in finding.headline, finding.headline
    assert f"held by {scenario.first_name}" in finding.summary, finding.summary
    added = scenario.added_at()
    assert added is not None and f", {added}" in finding.summary and finding.added_at == added.split(" at ")[1]
    # one line per state change of the one finding, in the findings file as in the log
    lines = [json.loads(line) for line in
             (Path(out_dir) / "leak-findings-rank0.jsonl").read_text().splitlines()]
    assert [line["state"] for line in lines] == ["suspected", "confirmed"], [line["summary"] for line in lines]
    assert len({line["series"] for line in lines}) == 1


def test_the_adding_line_is_in_the_exit_line_and_the_report(out_dir: str, caplog: pytest.LogCaptureFixture,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    scenario = next(s for s in SCENARIOS if s.run is hook_appending_to_a_global)
    added = scenario.added_at()
    assert added is not None
    verb, where = added.split(" at ")
    short = f"{verb} at {where.rpartition('/')[2]}"  # a long line drops the file's directory first

    with caplog.at_level(logging.INFO):
        outcome = run_holder_scenario(scenario, out_dir)

    assert outcome.findings and outcome.findings[0].added_at == where
    exit_line = next(r.getMessage() for r in caplog.records if " steps watched " in r.getMessage())
    assert short in exit_line, exit_line
    capsys.readouterr()
    assert main(["report", out_dir]) == 0
    report = capsys.readouterr().out
    assert f"held by module global `holder_scenarios.CAPTURED`, {short}" in report, report
