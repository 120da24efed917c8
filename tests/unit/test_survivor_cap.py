"""The long-lived tensor tracker at its cap: a leak that goes on past it is never said to have stopped.

A cap of a few hundred tensors stands in for the default 200,000 (the mechanism is the same; a real
run to 200,000 leaked tensors would take minutes). Everything else runs at its defaults.
"""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch

import gpumemd
import gpumemd.components.leak as leak_module
from gpumemd.analysis.leak_detector import DetectorConfig, LeakDetector, LeakState, SeriesSpec
from gpumemd.probes.survival import long_lived
from gpumemd.probes.survival.survivors import SurvivorTracker

CAP = 600


def test_a_leak_that_goes_on_past_the_cap_stays_confirmed_and_says_it_is_capped(
        tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(long_lived, "SurvivorTracker", functools.partial(SurvivorTracker, max_tracked=CAP))
    out = os.path.join(tmp_path, "out")
    keep = []
    x = torch.zeros(8)
    # 4,000 steps: the cap is reached near step 700, and a track whose counts stay flat clears
    # within three checks of a 500-step window (it did at ~step 1,800 before counts were held).
    with gpumemd.attached(output_dir=out) as agent:
        for step in range(4_000):
            y = x * 2
            if step >= 100:
                keep.append(y)
            gpumemd.mark_step()
        findings = agent.findings()
        path = agent.component(leak_module.LeakComponent).findings_path  # type: ignore[union-attr]
    with open(path, encoding="utf-8") as f:
        events = [json.loads(line) for line in f]
    assert [e["state"] for e in events] == ["suspected", "confirmed"], [e["summary"] for e in events]
    [finding] = [f for f in findings if f.series.startswith("tensors{")]
    assert finding.state == "confirmed", finding.summary
    assert f"counting capped at {CAP:,} long-lived tensors" in finding.summary
    assert finding.updated_step > 3_000, finding  # still judged (held) at the end, not frozen at the cap
    assert "`keep`" in finding.summary


def test_a_held_series_keeps_its_state_and_ignores_new_values() -> None:
    detector = LeakDetector(DetectorConfig(warmup_steps=0, window_steps=100, check_every_steps=10))
    spec = SeriesSpec("tensors{device=cpu,group=float32[8]}", "tensor_leak", sparse=True, unit="tensors")
    detector.add_series(spec)
    step = 0
    for step in range(0, 400, 5):
        detector.observe(spec.name, step, float(step))
        if step % 10 == 0:
            statuses = detector.evaluate(step, {spec.name: 0.1})
    assert statuses and statuses[0].state is LeakState.CONFIRMED
    detector.hold(spec.name, "capped")
    for later in range(step, step + 2_000, 5):
        detector.observe(spec.name, later, 400.0)  # a counter stuck at its cap
        if later % 10 == 0:
            [status] = detector.evaluate(later, {spec.name: 0.1})
            assert status.state is LeakState.CONFIRMED and status.held == "capped" and not status.changed


def test_tracked_tensors_of_one_group_share_one_key() -> None:
    tracker = SurvivorTracker()
    tracker.install()
    try:
        kept = [torch.zeros(3) for _ in range(50)]
        tracker.scan()
        tracker.scan()
        refs = list(tracker.counts.refs.values())
        assert tracker.counts.total()[0] >= 50 and refs
        assert len({id(r.key) for r in refs if r.key[2] == (3,)}) == 1
        del kept
    finally:
        tracker.uninstall()
