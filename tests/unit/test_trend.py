"""The trend statistics on hand-made and generated series (numpy only builds the data)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gpumemd.analysis.trend import (
    assess,
    assess_knee,
    autocorrelation_inflation,
    floor_growth,
    mann_kendall,
    ramp_consistent,
    theil_sen,
)


def test_mann_kendall_matches_the_textbook_values() -> None:
    # strictly increasing: S = n(n-1)/2, Var = n(n-1)(2n+5)/18
    mk = mann_kendall(list(range(10)), autocorrelation=False)
    assert mk.s == 45
    assert mk.variance == pytest.approx(10 * 9 * 25 / 18)
    assert mk.z == pytest.approx(44 / math.sqrt(125))
    assert mk.p_increasing < 1e-4
    # decreasing: p close to 1
    assert mann_kendall(list(range(10, 0, -1)), autocorrelation=False).p_increasing > 0.999


def test_mann_kendall_tie_correction_shrinks_the_variance() -> None:
    ys = [1, 1, 1, 2, 2, 3, 3, 3, 3, 4]
    mk = mann_kendall(ys, autocorrelation=False)
    n = 10
    ties = 3 * 2 * 11 + 2 * 1 * 9 + 4 * 3 * 13
    assert mk.variance == pytest.approx((n * (n - 1) * (2 * n + 5) - ties) / 18)
    # a constant series is all ties: no variance, never significant
    flat = mann_kendall([7.0] * 20)
    assert flat.s == 0 and flat.p_increasing == 1.0


def test_autocorrelation_inflates_the_variance_of_a_random_walk_only() -> None:
    rng = np.random.default_rng(3)
    walk = np.cumsum(rng.normal(size=200)).tolist()
    white = rng.normal(size=200).tolist()
    assert autocorrelation_inflation(walk) > 3.0
    assert autocorrelation_inflation(white) < 1.5
    # a random walk often "trends": the corrected test must call it significant far less often
    hits_raw = hits_corrected = 0
    for seed in range(40):
        w = np.cumsum(np.random.default_rng(seed).normal(size=100)).tolist()
        hits_raw += mann_kendall(w, autocorrelation=False).p_increasing < 1e-3
        hits_corrected += mann_kendall(w).p_increasing < 1e-3
    assert hits_corrected < hits_raw


def test_theil_sen_ignores_outliers_and_brackets_the_true_slope() -> None:
    rng = np.random.default_rng(0)
    xs = np.arange(100.0)
    ys = 3.0 * xs + rng.normal(0, 5, 100)
    ys[::10] += 1e6  # 10% huge spikes
    s = theil_sen(xs.tolist(), ys.tolist())
    assert s.slope == pytest.approx(3.0, abs=0.3)
    assert s.low < 3.0 < s.high
    # subsampled pairs (bounded cost) give the same answer, deterministically
    sub = theil_sen(xs.tolist(), ys.tolist(), max_pairs=500)
    assert sub.pairs == 500
    assert sub.slope == pytest.approx(3.0, abs=0.5)
    assert theil_sen(xs.tolist(), ys.tolist(), max_pairs=500) == sub


def test_ramp_consistency_rejects_a_one_time_jump_and_accepts_a_ramp() -> None:
    xs = [float(i) for i in range(40)]
    jump = [0.0] * 20 + [100.0] * 20
    ramp = [2.0 * i for i in range(40)]
    assert not ramp_consistent(xs, jump, theil_sen(xs, jump).slope or 1.0)
    assert ramp_consistent(xs, ramp, 2.0)


def test_floor_growth_is_zero_for_a_sawtooth_that_resets() -> None:
    saw = [float(i % 10) for i in range(40)]
    assert floor_growth(saw) == 0.0
    assert floor_growth([float(i) for i in range(40)]) == 30.0


def test_assess_names_the_first_failed_check() -> None:
    xs = [float(i) for i in range(50)]
    assert assess(xs[:5], xs[:5], min_slope=0.1).reason == "too few points"
    assert assess(xs, [1.0] * 50, min_slope=0.1).reason == "not significant"
    assert assess(xs, [0.01 * x for x in xs], min_slope=1.0).reason == "slope below threshold"
    jump = [0.0] * 25 + [1000.0] * 25
    assert not assess(xs, jump, min_slope=1.0).passed
    ok = assess(xs, [10.0 * x for x in xs], min_slope=1.0)
    assert ok.passed and ok.reason == "leak"
    assert ok.slope.slope == pytest.approx(10.0)


def test_a_ramp_after_a_drifting_flat_start_is_judged_from_its_knee() -> None:
    # Host RSS as recorded: 25 floors drifting down by a few KiB, then 1 MiB/step from step 300. The
    # window's rank test weighs the drift's 300 falling pairs as much as the ramp's: not significant.
    # From the knee: the 4 ramp floors are the 4 highest of 29, by chance 1 in C(29, 4).
    mib = 2**20
    xs = [55.0 + 10 * i for i in range(29)]
    ys = [300 * mib - 400 * i if x < 300 else 300 * mib + (x - 300) * mib for i, x in enumerate(xs)]
    knee = next(i for i, x in enumerate(xs) if x > 300) - 1
    assert assess(xs, ys, min_slope=16 * 1024).reason == "not significant"
    verdict = assess_knee(xs, ys, knee, min_slope=16 * 1024, min_growth=8 * mib)
    assert verdict.passed and verdict.p_increasing == pytest.approx(1 / math.comb(29, 4))
    # a one-time jump is no ramp; a rise that does not clear the flat start's highest floor is none
    jump = [y if x < 300 else 300 * mib + 64 * mib for x, y in zip(xs, ys, strict=True)]
    assert not assess_knee(xs, jump, knee, min_slope=16 * 1024, min_growth=8 * mib).passed
    low = [y if x < 300 else 300 * mib - 1 for x, y in zip(xs, ys, strict=True)]
    assert not assess_knee(xs, low, knee, min_slope=16 * 1024, min_growth=8 * mib).passed
