"""The holder path at DEFAULT settings: a leak kept by each kind of container, in its own training
loop, is found with the right kind, and its sentence starts the path at the name the script wrote.
Scenarios: holder_scenarios.py."""

from __future__ import annotations

import pytest
from holder_scenarios import SCENARIOS, HolderScenario, run_holder_scenario


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_the_path_starts_at_the_name_in_the_script(scenario: HolderScenario, out_dir: str) -> None:
    outcome = run_holder_scenario(scenario, out_dir)

    assert outcome.findings, f"{scenario.name}: no finding"
    leak = [f for f in outcome.findings if "float32[128, 128]" in f.summary]
    assert leak, [f.summary for f in outcome.findings]
    assert leak[0].kind == scenario.kind, leak[0].summary
    assert f"held by {scenario.first_name}" in leak[0].summary, leak[0].summary
    assert "path cut" not in leak[0].summary and "dict key" not in leak[0].summary
