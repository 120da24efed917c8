"""Leak detection on real CPU training loops at DEFAULT settings (only ``output_dir`` is set): every
leak found with the right kind and holder within the stated number of steps after onset, its onset
right, never cleared while it grows; nothing fires on healthy jobs over three seeds.
Scenarios: leak_scenarios.py.

Each run is one real job in one process, CPU-bound on one thread: the runs the selected tests need
go to a pool of worker processes (one per core, one agent per worker at a time) as the module starts,
and each test checks its run's outcome.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path

import pytest
from leak_scenarios import (
    HEALTHY,
    LEAKS,
    SUSPECT_WITHIN,
    SUSPECT_WITHIN_LARGE,
    Outcome,
    Scenario,
    quiet_worker,
    run_in_worker,
)

from gpumemd.records.findings import FINDING_KINDS, FINDING_STATES

Runs = dict[tuple[str, int], tuple[Future[Outcome], str]]


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    """(scenario name, seed) -> (its outcome, its output directory), for the selected tests of this file,
    submitted in test order. Workers are spawned, not forked: a fork of this process would inherit
    its threads' locks and torch's thread pool."""
    wanted: list[tuple[str, int]] = []
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if getattr(item, "path", None) == Path(__file__) and "scenario" in params:
            key = (params["scenario"].name, params.get("seed", 0))
            if key not in wanted:
                wanted.append(key)
    workers = max(1, min(2, os.cpu_count() or 1, len(wanted)))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=quiet_worker) as pool:
        submitted: Runs = {}
        for name, seed in wanted:
            out = str(tmp_path_factory.mktemp("scenario") / "gpumemd-out")
            submitted[(name, seed)] = (pool.submit(run_in_worker, name, out, seed), out)
        try:
            yield submitted
        finally:
            for future, _ in submitted.values():
                future.cancel()


@pytest.mark.parametrize("scenario", LEAKS, ids=[s.name for s in LEAKS])
def test_leak_is_found_with_kind_and_holder(scenario: Scenario, runs: Runs) -> None:
    # Host-RSS leaks run in a fresh interpreter (run_in_worker): a worker's earlier runs left freed
    # heap that absorbs a leak's first megabytes, which would delay the finding by a check or two.
    future, out_dir = runs[(scenario.name, 0)]
    outcome = future.result()

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
    lines = [m for m in outcome.warnings if "leak" in m or "graph" in m]
    assert len(lines) == len(outcome.events)
    assert scenario.holder[0] in lines[-1]


FIRST_LEAKED_STEP_WITHIN = 2  # a count finding's onset, in steps either side of the first leaked step


@pytest.mark.parametrize("scenario", LEAKS, ids=[s.name for s in LEAKS])
def test_each_state_change_is_one_short_line_said_once(scenario: Scenario, runs: Runs) -> None:
    """A person reads one line per state change: at most 200 characters, naming the kind, the rate,
    the holder and the onset, said once in the whole run's log (the exit summary names the finding
    without saying its line again); the findings file keeps the whole sentence."""
    outcome = runs[(scenario.name, 0)][0].result()
    assert any(" steps watched in " in line for line in outcome.log), outcome.log  # the exit summary is in it
    assert outcome.events
    for event in outcome.events:
        line = "gpumemd: " + event["headline"]
        assert len(line) <= 200, line
        assert sum(event["headline"] in logged for logged in outcome.log) == 1, (line, outcome.log)
        assert f"since step {event['onset_step']:,}" in line, line
        for text in (*scenario.holder, scenario.rate):
            assert text in line, line
        assert len(event["summary"]) > len(event["headline"])  # the whole sentence stays in the file
    if outcome.events[0]["series"].startswith(("tensors{", "graph_nodes{")):
        # counted tensors (or chained autograd nodes) are dated between scans, to a step or two
        assert abs(outcome.events[-1]["onset_step"] - scenario.onset) <= FIRST_LEAKED_STEP_WITHIN, outcome.events[-1]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("scenario", HEALTHY, ids=[s.name for s in HEALTHY])
def test_healthy_job_raises_nothing(scenario: Scenario, seed: int, runs: Runs) -> None:
    future, out_dir = runs[(scenario.name, seed)]
    outcome = future.result()
    assert outcome.steps >= 2000
    assert outcome.events == [], [e["summary"] for e in outcome.events]
    assert outcome.findings == []
    assert not os.path.exists(os.path.join(out_dir, "leak-findings-rank0.jsonl"))  # created on first write


ARTEFACTS = ("step -", "None", "~0 min")  # a negative or missing step, a time to OOM rounded to nothing


@pytest.mark.parametrize("scenario", LEAKS, ids=[s.name for s in LEAKS])
def test_no_sentence_says_a_negative_or_missing_step_or_zero_minutes(
        scenario: Scenario, runs: Runs, capsys: pytest.CaptureFixture[str]) -> None:
    """Every finding's sentences, the run's log (the exit summary in it) and ``gpumemd report``'s text."""
    from gpumemd.cli import main

    outcome, out_dir = runs[(scenario.name, 0)][0].result(), runs[(scenario.name, 0)][1]
    capsys.readouterr()
    assert main(["report", out_dir]) == 0
    texts = [*(e[k] for e in outcome.events for k in ("summary", "headline")), *outcome.log,
             *capsys.readouterr().out.splitlines()]
    for text in texts:
        assert not any(bad in text for bad in ARTEFACTS), text
