"""Leak detection on real CPU training loops: every leak found with the right kind and holder within
a stated number of steps after onset; nothing fires on healthy jobs. Scenarios: leak_scenarios.py."""

from __future__ import annotations

import json
import logging
import os

import pytest
from leak_scenarios import CONFIRM_WITHIN, HEALTHY, LEAKS, ONSET, SUSPECT_WITHIN, Scenario, run_scenario

from gpumemd.records.findings import FINDING_KINDS, FINDING_STATES


@pytest.mark.parametrize("scenario", LEAKS, ids=[s.name for s in LEAKS])
def test_leak_is_found_with_kind_and_holder(scenario: Scenario, out_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gpumemd")
    outcome = run_scenario(scenario, out_dir)

    suspected, confirmed = outcome.first("suspected"), outcome.first("confirmed")
    assert suspected is not None, f"{scenario.name}: never suspected; events {outcome.events}"
    assert confirmed is not None, f"{scenario.name}: never confirmed; events {outcome.events}"
    assert suspected["updated_step"] - ONSET <= SUSPECT_WITHIN
    assert confirmed["updated_step"] - ONSET <= CONFIRM_WITHIN
    # the right kind, and only that kind: no second finding from another series for the same leak
    assert {e["kind"] for e in outcome.events} == {scenario.kind}, outcome.events
    # the holder is named in the one-line summary, at the latest when the leak is confirmed
    for text in scenario.holder:
        assert text in confirmed["summary"], confirmed["summary"]
    assert confirmed["slope_bytes_per_step"] >= 4096
    assert confirmed["onset_step"] is not None and abs(confirmed["onset_step"] - ONSET) <= 40
    assert confirmed["steps_to_oom"] is None or confirmed["steps_to_oom"] > 0

    # Agent.findings(): the contract fields, the finding still confirmed at the end
    final = [f for f in outcome.findings if f.kind == scenario.kind]
    assert len(final) == 1
    assert final[0].state == "confirmed"
    assert final[0].slope_low <= final[0].slope_bytes_per_step <= final[0].slope_high
    assert final[0].culprits and final[0].summary

    # the append-only JSON-lines file in the output directory holds exactly the state changes
    with open(os.path.join(out_dir, "leak-findings-rank0.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    assert records == outcome.events
    for record in records:
        assert record["kind"] in FINDING_KINDS and record["state"] in FINDING_STATES
        assert {"slope_bytes_per_step", "onset_step", "steps_to_oom", "summary", "culprits", "time"} <= set(record)

    # one WARNING line per state change, carrying the culprit
    lines = [r.getMessage() for r in caplog.records if "leak" in r.getMessage() or "graph" in r.getMessage()]
    assert len(lines) == len(outcome.events)
    assert scenario.holder[0] in lines[-1]


@pytest.mark.parametrize("scenario", HEALTHY, ids=[s.name for s in HEALTHY])
def test_healthy_job_raises_nothing(scenario: Scenario, out_dir: str) -> None:
    outcome = run_scenario(scenario, out_dir)
    assert outcome.steps >= 260
    assert outcome.events == []
    assert outcome.findings == []
    assert not os.path.exists(os.path.join(out_dir, "leak-findings-rank0.jsonl"))  # created on first write
