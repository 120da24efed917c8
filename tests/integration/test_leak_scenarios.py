"""Leak detection on real CPU training loops at DEFAULT settings (only ``output_dir`` is set): every
leak found with the right kind and holder within the stated number of steps after onset, its onset
right, never cleared while it grows; nothing fires on healthy jobs over three seeds.
Scenarios: leak_scenarios.py."""

from __future__ import annotations

import json
import logging
import os

import pytest
from leak_scenarios import (
    HEALTHY,
    LEAKS,
    SUSPECT_WITHIN,
    SUSPECT_WITHIN_LARGE,
    Scenario,
    run_scenario,
    run_scenario_isolated,
)

from gpumemd.records.findings import FINDING_KINDS, FINDING_STATES


@pytest.mark.parametrize("scenario", LEAKS, ids=[s.name for s in LEAKS])
def test_leak_is_found_with_kind_and_holder(scenario: Scenario, out_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gpumemd")
    # Host-RSS leaks run in a fresh interpreter: this session's earlier tests left freed heap that
    # absorbs a leak's first megabytes, which would delay the finding by a check or two.
    isolated = scenario.kind == "host_leak"
    outcome = run_scenario_isolated(scenario, out_dir) if isolated else run_scenario(scenario, out_dir)

    suspected, confirmed = outcome.first("suspected"), outcome.first("confirmed")
    assert suspected is not None, f"{scenario.name}: never suspected; events {outcome.events}"
    within = SUSPECT_WITHIN_LARGE if scenario.bytes_per_step >= 64 * 1024 else SUSPECT_WITHIN
    assert suspected["updated_step"] - scenario.onset <= within, suspected["summary"]
    assert confirmed is not None, f"{scenario.name}: never confirmed; events {outcome.events}"
    # the right kind, and only that kind: no second finding from another series for the same leak
    assert {e["kind"] for e in outcome.events} == {scenario.kind}, [e["summary"] for e in outcome.events]
    assert len({e["series"] for e in outcome.events}) == 1, [e["summary"] for e in outcome.events]
    # the holder is named in the one-line summary, when suspected and when confirmed
    for event in (suspected, confirmed):
        for text in scenario.holder:
            assert text in event["summary"], event["summary"]
        assert scenario.rate in event["summary"], event["summary"]
    # the onset is where the leak began: within 10% of the steps elapsed, or 100 steps
    elapsed = confirmed["updated_step"] - scenario.onset
    assert confirmed["onset_step"] is not None
    assert abs(confirmed["onset_step"] - scenario.onset) <= max(100, 0.1 * elapsed), confirmed["summary"]
    assert confirmed["slope_bytes_per_step"] >= 0.5 * scenario.bytes_per_step, confirmed["summary"]
    assert confirmed["steps_to_oom"] is None or confirmed["steps_to_oom"] > 0
    # a leak that goes on is never cleared
    assert not any(e["state"] == "cleared" for e in outcome.events)

    # Agent.findings(): the contract fields, the finding still confirmed at the end
    final = [f for f in outcome.findings if f.kind == scenario.kind]
    assert len(final) == 1
    assert final[0].state == "confirmed"
    assert final[0].slope_low <= final[0].slope_bytes_per_step <= final[0].slope_high
    assert final[0].culprits and final[0].summary
    assert final[0].severity in ("warning", "critical")

    # the append-only JSON-lines file in the output directory holds exactly the state changes
    with open(os.path.join(out_dir, "leak-findings-rank0.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    assert records == outcome.events
    for record in records:
        assert record["kind"] in FINDING_KINDS and record["state"] in FINDING_STATES
        assert {"slope_bytes_per_step", "onset_step", "steps_to_oom", "summary", "culprits", "time"} <= set(record)

    # one WARNING line per state change, carrying the culprit
    messages = outcome.warnings if isolated else [r.getMessage() for r in caplog.records
                                                   if r.levelno == logging.WARNING]
    lines = [m for m in messages if "leak" in m or "graph" in m]
    assert len(lines) == len(outcome.events)
    assert scenario.holder[0] in lines[-1]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("scenario", HEALTHY, ids=[s.name for s in HEALTHY])
def test_healthy_job_raises_nothing(scenario: Scenario, seed: int, out_dir: str) -> None:
    outcome = run_scenario(scenario, out_dir, seed=seed)
    assert outcome.steps >= 2000
    assert outcome.events == [], [e["summary"] for e in outcome.events]
    assert outcome.findings == []
    assert not os.path.exists(os.path.join(out_dir, "leak-findings-rank0.jsonl"))  # created on first write
