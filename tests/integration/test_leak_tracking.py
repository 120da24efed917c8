"""While a confirmed leak is tracked, scans and evaluations space out within the budget, and a second
leak that starts meanwhile is still found and named. At default settings, on a fast loop (the budget
asks for the stretch there); so do its sampled step ends."""

from __future__ import annotations

import itertools

import pytest
import torch
from leak_scenarios import SUSPECT_WITHIN, SUSPECT_WITHIN_LARGE, fast_loop

import gpumemd
from gpumemd.components.leak import LeakComponent
from gpumemd.components.leak_scans import IDLE_STRETCH, KEYED_WHILE_TRACKING, SCAN_EVERY_MAX, TRACKING_STRETCH
from gpumemd.records.findings import Finding
from gpumemd.stride import MAX_STRIDE, SPARSE_STRETCH

FIRST = "float32[4096]"  # 16 KiB a step: enough for host RSS to rise with it
SECOND = "float32[256]"


def _finding(agent: gpumemd.Agent, group: str) -> Finding | None:
    return next((f for f in agent.state().findings if group in f.series and f.state != "cleared"), None)


@pytest.mark.slow
def test_a_second_leak_while_one_is_tracked_is_found_and_named(tmp_path: object) -> None:
    step_once = fast_loop()
    first_kept: list[torch.Tensor] = []
    second_kept: list[torch.Tensor] = []
    confirmed_at: int | None = None
    second_onset: int | None = None
    intervals: set[int] = set()
    stretched: list[bool] = []  # per step of the second tracked window: was the interval stretched
    keyed: list[int | None] = []  # per scan while the first alone is tracked: candidates read at most
    strides: list[int] = []  # per step of the second tracked window: the agent's stride
    with gpumemd.attached(output_dir=str(tmp_path), quiet=True) as agent:
        detector = agent.component(LeakComponent)._parts.series.detector  # type: ignore[union-attr]
        tracker = agent.component(LeakComponent)._parts.tracker  # type: ignore[union-attr]
        assert tracker is not None
        scan = tracker.scan

        def spy(*, keyed_at_most: int | None = None) -> None:
            if confirmed_at is not None and second_onset is None:
                keyed.append(keyed_at_most)
            scan(keyed_at_most=keyed_at_most)

        tracker.scan = spy  # type: ignore[method-assign]
        for step in range(8_000):
            step_once()
            if step >= 50:
                first_kept.append(torch.zeros(4096))
            first = _finding(agent, FIRST)
            if second_onset is None:
                if first is not None and first.state == "confirmed":
                    confirmed_at = step if confirmed_at is None else confirmed_at
                    intervals.add(detector.check_every)
                    if step >= confirmed_at + 500:
                        stretched.append(detector.check_every > SCAN_EVERY_MAX)
                        strides.append(agent.stride)
                    if step >= confirmed_at + 1_000:  # tracked for two windows: the stretch is on
                        second_onset = step
                continue
            second_kept.append(torch.zeros(256))
            second = _finding(agent, SECOND)
            if second is not None and second.state == "confirmed":
                break
    assert second_onset is not None, "the first leak was never confirmed"
    # Tracking the first alone, the budget spaced the evaluations beyond the usual 50 steps (as far as
    # SCAN_EVERY_MAX * TRACKING_STRETCH on a quiet machine; how far is the budget's, which a loaded
    # machine's slower steps and scans change: 552 was seen).
    assert SCAN_EVERY_MAX < max(intervals) <= SCAN_EVERY_MAX * TRACKING_STRETCH, intervals
    # ... and kept them so: host RSS rising with the leaked tensors, which the finding explains, does not
    # end tracking (it did once a window, at each re-test of the host series: 50-step intervals then).
    assert sum(stretched) >= 0.95 * len(stretched), (sum(stretched), len(stretched))
    # Its sampled step ends spread out with the scans (the budget asks for more than MAX_STRIDE on this
    # fast loop), and came back to MAX_STRIDE when the second leak ended tracking.
    assert MAX_STRIDE < max(strides) <= MAX_STRIDE * SPARSE_STRETCH, sorted(set(strides))
    assert agent.stride <= MAX_STRIDE, agent.stride
    second = _finding(agent, SECOND)
    assert second is not None and second.state == "confirmed", [f.headline for f in agent.state().findings]
    # Suspected ~450 steps after its onset at the usual interval (measured: 452); while the first was
    # tracked alone, up to two stretched intervals later (measured: 1,752): its tensors are counted at the
    # first scan they outlive whole, and the evaluation at that scan ends tracking, so it is judged at the
    # usual interval from there. The stretch's whole cost.
    assert second.first_step - second_onset <= SUSPECT_WITHIN_LARGE + 2 * SCAN_EVERY_MAX * TRACKING_STRETCH, (
        second_onset, second.first_step)
    assert "second_kept" in second.summary, second.summary
    first = _finding(agent, FIRST)
    assert first is not None and first.state == "confirmed" and "first_kept" in first.summary, first
    # Tracked, its scans read a sample of their ~800 candidates (KEYED_WHILE_TRACKING), and its count is
    # still exact: one tensor a step.
    assert keyed.count(KEYED_WHILE_TRACKING) >= 0.8 * len(keyed) > 0, keyed
    assert "+1 tensor/step" in first.summary, first.summary


def test_scans_that_find_nothing_space_out_and_a_leak_brings_them_back(tmp_path: object) -> None:
    """A healthy fast loop at the defaults scans and evaluates half as often (``IDLE_STRETCH``), the
    evaluations riding with the scans; a leak that starts is counted at the next scan, which ends the
    idle spacing, and is found as before."""
    step_once = fast_loop()
    kept: list[torch.Tensor] = []
    onset = 3_000
    scans: list[int] = []  # the step of each scan
    evaluations: list[int] = []
    with gpumemd.attached(output_dir=str(tmp_path), quiet=True) as agent:
        leak = agent.component(LeakComponent)
        assert leak is not None and leak._parts is not None
        tracker, detector = leak._parts.tracker, leak._parts.series.detector
        assert tracker is not None
        scan, evaluate = tracker.scan, detector.evaluate

        def scan_spy(*, keyed_at_most: int | None = None) -> None:
            scans.append(agent.current_step or 0)
            scan(keyed_at_most=keyed_at_most)

        def evaluate_spy(step: int, min_slopes: object = None) -> object:
            evaluations.append(step)
            return evaluate(step, min_slopes)  # type: ignore[arg-type]

        tracker.scan = scan_spy  # type: ignore[method-assign]
        detector.evaluate = evaluate_spy  # type: ignore[method-assign]
        found = None
        for step in range(onset + SUSPECT_WITHIN):
            step_once()
            if step >= onset:
                kept.append(torch.zeros(16))
            found = _finding(agent, "float32[16]")
            if found is not None and found.state == "confirmed":
                break
    # (A census's step end puts the evaluation due then off by a step end: a gap or two a few steps off.)
    gaps = sorted(b - a for a, b in itertools.pairwise(s for s in scans if 1_000 <= s < onset))
    assert gaps[len(gaps) // 2] == IDLE_STRETCH * SCAN_EVERY_MAX and gaps[0] > SCAN_EVERY_MAX, gaps
    every = sorted(b - a for a, b in itertools.pairwise(e for e in evaluations if 1_000 <= e < onset))
    idle_every = IDLE_STRETCH * SCAN_EVERY_MAX
    assert every[len(every) // 2] == idle_every and every[-1] < 2 * idle_every, every
    # ... at the same step ends (or the next, after a census): half as many full step ends.
    assert all(any(0 <= e - s <= 1 for e in evaluations) for s in scans if 1_000 <= s < onset), (scans, evaluations)
    # The first scan after the onset lists the leaked tensors, the next counts them: from there, every evaluation.
    after = [s for s in scans if s > onset]
    assert after[2] - after[1] == SCAN_EVERY_MAX, after[:6]
    assert found is not None and found.state == "confirmed", "the leak was not confirmed"
    assert "kept" in found.summary, found.summary
