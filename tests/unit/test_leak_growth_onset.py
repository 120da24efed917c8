"""A leak's growth is measured from the value at its onset, however long ago: the track's history of
floors is bounded, and growth against its oldest kept floor would stop counting what scrolled out."""

from __future__ import annotations

import pytest

from gpumemd.analysis.leak_track import Track
from gpumemd.analysis.leak_types import SeriesSpec

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
