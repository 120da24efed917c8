"""Survivor scans are spaced by the budget, within their floor and ceiling; tracking stretches the ceiling, and so
do scans that find nothing on a fast loop."""

from __future__ import annotations

from gpumemd.components.leak_scans import IDLE_STRETCH, SCAN_EVERY, SCAN_EVERY_MAX, TRACKING_STRETCH, ScanSchedule


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


def _next_scan(*, step_s: float, idle: bool) -> int:
    """Steps from a scan at an evaluation to the next scan, with evaluations every 50 steps."""
    schedule = ScanSchedule(window_steps=500, overhead_budget=0.01)
    schedule.idle = idle
    schedule.scanned(100, 1e-3, seconds_per_step=step_s, evaluations_share=0.0)
    schedule.plan(100, 50)
    return schedule.next_total - 100


def test_idle_scans_space_out_past_the_evaluations_only_where_the_budget_asks() -> None:
    # A ~1 ms scan on 0.1 ms steps: the budget asks for far more than the ceiling. Scans that find
    # nothing skip the evaluation between; one that finds something comes back to every evaluation.
    assert _next_scan(step_s=1e-4, idle=False) == SCAN_EVERY_MAX
    assert _next_scan(step_s=1e-4, idle=True) == IDLE_STRETCH * SCAN_EVERY_MAX
    # Within the budget (1 ms scans on 1 s steps: every SCAN_EVERY steps), idle changes nothing.
    assert _next_scan(step_s=1.0, idle=True) == _next_scan(step_s=1.0, idle=False) == SCAN_EVERY
