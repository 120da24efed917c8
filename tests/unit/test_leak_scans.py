"""Survivor scans are spaced by the budget, within their floor and ceiling; tracking stretches the ceiling."""

from __future__ import annotations

from gpumemd.components.leak_scans import SCAN_EVERY, SCAN_EVERY_MAX, TRACKING_STRETCH, ScanSchedule


def _interval(*, step_s: float, scan_s: float, tracking: bool) -> int:
    schedule = ScanSchedule(window_steps=500, overhead_budget=0.01)
    schedule.tracking = tracking
    schedule.scanned(100, scan_s, seconds_per_step=step_s, evaluations_share=0.0)
    return schedule.interval


def test_a_costly_scan_on_a_fast_loop_is_spaced_to_the_ceiling_and_tracking_stretches_it() -> None:
    assert _interval(step_s=1e-4, scan_s=1e-3, tracking=False) == SCAN_EVERY_MAX
    assert _interval(step_s=1e-4, scan_s=1e-3, tracking=True) == SCAN_EVERY_MAX * TRACKING_STRETCH


def test_tracking_spaces_scans_only_as_far_as_the_budget_asks() -> None:
    # 60 µs a scan on 1 ms steps: the budget asks for ~32 steps, under the ceiling either way.
    assert _interval(step_s=1e-3, scan_s=6e-5, tracking=True) == _interval(step_s=1e-3, scan_s=6e-5, tracking=False)
    assert SCAN_EVERY < _interval(step_s=1e-3, scan_s=6e-5, tracking=True) < SCAN_EVERY_MAX
    # Slow steps: the floor.
    assert _interval(step_s=1.0, scan_s=1e-3, tracking=True) == SCAN_EVERY
