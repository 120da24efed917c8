"""A leak's growth is measured from the value at its onset, however long ago: the track's history of
floors is bounded, and growth against its oldest kept floor would stop counting what scrolled out."""

from __future__ import annotations

import pytest

from gpumemd.analysis.leak_track import Track
from gpumemd.analysis.leak_types import LeakState, SeriesSpec

KiB = 1024


def test_growth_counts_from_the_onset_after_it_scrolls_out_of_the_history() -> None:
    track = Track(SeriesSpec("host_rss_bytes", "host_leak"), max_floors=100)
    base, rate = 500 * KiB * KiB, 256 * KiB  # a 256 KiB/step leak from step 200 on a 500 MiB job
    onsets = []
    for step in range(0, 6000, 10):  # one floor per 10-step block, as the detector keeps them
        track.add_floor(step, base + max(0, step - 200) * rate, min_rise=1.0)
        if step % 500 == 0 and step:
            onsets.append(track.onset_and_growth())
    onset, growth = track.onset_and_growth()

    assert onsets[0][0] == pytest.approx(200, abs=10)  # found while the flat start was still kept
    assert onset == onsets[0][0]
    # 5,790 steps of 256 KiB since the onset (1.41 GiB), not the last 100 floors' 1,000 steps
    assert growth == pytest.approx((5990 - onset) * rate, rel=0.01)
    assert [g for _, g in onsets] == sorted(g for _, g in onsets)  # never flat then falling


@pytest.mark.parametrize("state", [LeakState.CONFIRMED, LeakState.SUSPECTED])
def test_a_confirmed_episodes_onset_stays_when_its_rate_varies(state: LeakState) -> None:
    """Once the flat start scrolled out, the hinge of a ramp whose rate varies (1, then 3 tensors a
    step, in turns of 5,000 steps) fell inside the ramp: a leak that ran since step 52 read "since step
    92,603, +789.5 KiB so far" at step 100,000. A confirmed episode's onset only moves earlier."""
    track = Track(SeriesSpec("tensors{device=cpu,group=float32[16]}", "tensor_leak", unit="tensors"), max_floors=100)
    track.state = state
    count, onsets = 0.0, []
    for step in range(0, 40_000, 50):  # one point per scan
        count += 0 if step < 200 else 50 * (1 if (step // 5_000) % 2 == 0 else 3)
        track.add_floor(step, count, min_rise=1.0)
        if step % 1_000 == 0 and step:
            onsets.append(track.onset_and_growth()[0])
    onset, growth = track.onset_and_growth()
    if state is LeakState.CONFIRMED:
        assert set(onsets) == {onsets[0]} and onsets[0] == pytest.approx(200, abs=50), onsets
        assert growth == pytest.approx(count, rel=0.01)  # every tensor since the onset
    else:  # a suspected episode's onset still follows the hinge, which moves here: what the rule stops
        assert onset > 5_000, onsets
