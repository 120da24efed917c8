"""Robust trend statistics for per-step memory series (pure: no torch, no I/O, no clock).

The leak detector asks one question of a window of block floors (the minimum of each block of
samples, which removes transient spikes, eval buffers or a large batch, while keeping the baseline a
leak raises; the detector takes them as the samples arrive): "is this rising, steadily, by at least N
bytes per step?". Each function answers one part of it:

- ``mann_kendall``: a rank test for a monotonic rise (one-sided), with the tie correction and a
  variance inflation for autocorrelated floors (Hamed & Rao 1998), so slow wander is not "significant".
- ``theil_sen``: the median pairwise slope and Sen's confidence interval; pairs are subsampled
  deterministically above ``max_pairs`` so the cost stays bounded on long windows.
- ``ramp_consistent`` and ``floor_growth``: a leak rises in every part of the window and never
  returns to its old floor; one-off jumps and sawtooths that reset fail these.
- ``assess``: all of the above, with the reason a window did not pass; ``assess_knee`` the same for
  a ramp that began inside the window, judged from its knee.
"""

from __future__ import annotations

import array
import bisect
import functools
import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

_NORMAL = NormalDist()
_CONFIDENCE = 0.90  # of Sen's two-sided interval: its low end is a one-sided 95% lower bound
_MAX_LAG = 32  # autocorrelation lags counted at most


@dataclass(frozen=True, slots=True)
class MannKendall:
    """The Mann-Kendall statistic ``s``, its (corrected) variance and the one-sided p-value for a rise."""

    n: int
    s: int
    variance: float
    z: float
    p_increasing: float


def _sign(v: float) -> int:
    return (v > 0) - (v < 0)


def _tie_variance(ys: Sequence[float]) -> float:
    n = len(ys)
    ties = sum(t * (t - 1) * (2 * t + 5) for t in Counter(ys).values() if t > 1)
    return (n * (n - 1) * (2 * n + 5) - ties) / 18.0


def _ranks(values: Sequence[float]) -> list[float]:
    """Average ranks (ties share their mean rank)."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        mean_rank = (i + j) / 2.0 + 1.0
        for k in range(i, j + 1):
            ranks[order[k]] = mean_rank
        i = j + 1
    return ranks


def autocorrelation_inflation(residuals: Sequence[float]) -> float:
    """Hamed & Rao's n/n* for the ranks of detrended data, counting only significant positive lags.

    Negative autocorrelation would shrink the variance and raise false alarms, so it is ignored
    (the factor is never below 1).
    """
    n = len(residuals)
    if n < 8:
        return 1.0
    r = _ranks(residuals)
    mean = sum(r) / n
    centred = [v - mean for v in r]
    denom = sum(v * v for v in centred)
    if denom <= 0:
        return 1.0
    bound = _NORMAL.inv_cdf(0.975) / math.sqrt(n)
    total = 0.0
    for lag in range(1, min(n - 3, _MAX_LAG) + 1):
        rho = sum(centred[i] * centred[i + lag] for i in range(n - lag)) / denom
        if rho > bound:
            total += (n - lag) * (n - lag - 1) * (n - lag - 2) * rho
    return max(1.0, 1.0 + 2.0 * total / (n * (n - 1) * (n - 2)))


def _kendall_s(ys: Sequence[float]) -> int:
    """Mann-Kendall's S, the sum of sign(y_j - y_i) over every pair i < j, in O(n log n): for each point,
    the earlier points below it less those above it, counted by bisection in the sorted earlier points.
    (The pairwise loop took a few ms for a long window's 250 floors at every evaluation.) A NaN, which
    no sorted order holds, takes the pairwise loop."""
    if any(map(math.isnan, ys)):
        return sum(_sign(ys[j] - ys[i]) for i in range(len(ys) - 1) for j in range(i + 1, len(ys)))
    seen: list[float] = []
    s = 0
    for k, y in enumerate(ys):
        below, not_above = bisect.bisect_left(seen, y), bisect.bisect_right(seen, y)
        s += below - (k - not_above)
        seen.insert(not_above, y)
    return s


def mann_kendall(
    ys: Sequence[float], *, xs: Sequence[float] | None = None, autocorrelation: bool = True,
    slope: float | None = None,
) -> MannKendall:
    """One-sided Mann-Kendall test for an increasing trend. O(n²): callers bound n (a few hundred).

    With ``autocorrelation`` the series is detrended by ``slope`` (Theil-Sen over ``xs``, computed
    when not given) and the variance inflated by the ranks' significant autocorrelation.
    """
    n = len(ys)
    if n < 3:
        return MannKendall(n, 0, 0.0, 0.0, 1.0)
    s = _kendall_s(ys)
    variance = _tie_variance(ys)
    if autocorrelation and n >= 8:
        x = list(xs) if xs is not None else [float(i) for i in range(n)]
        b = slope if slope is not None else theil_sen(x, ys).slope
        residuals = [y - b * xi for xi, y in zip(x, ys, strict=True)]
        # Autocorrelated noise can only fake a rise of about its own size. When the rise is ten
        # times the residuals' spread (a clean ramp with a periodic wiggle, e.g. census bytes that
        # grow 32, 36, 32, 36 KiB per point), the residuals' autocorrelation says nothing about the
        # trend, and inflating by it would hide the plainest leaks.
        spread = max(residuals) - min(residuals)
        if spread >= 0.1 * abs(b) * (x[-1] - x[0]):
            variance *= autocorrelation_inflation(residuals)
    if variance <= 0:
        return MannKendall(n, s, 0.0, 0.0, 1.0)
    # continuity correction: S moves in steps of 2
    z = (s - 1) / math.sqrt(variance) if s > 0 else ((s + 1) / math.sqrt(variance) if s < 0 else 0.0)
    p = 1.0 - _NORMAL.cdf(z)
    return MannKendall(n, s, variance, z, p)


@dataclass(frozen=True, slots=True)
class Slope:
    """Theil-Sen slope (units of y per unit of x) with Sen's confidence interval."""

    slope: float
    low: float
    high: float
    pairs: int  # pairs actually used (after subsampling)


NO_SLOPE = Slope(0.0, -math.inf, math.inf, 0)
"""No slope known: too few points or pairs, an interval that bounds nothing."""


@functools.lru_cache(maxsize=8)
def _pairs(n: int, max_pairs: int) -> tuple[array.array[int], array.array[int]]:
    """The (i, j) index pairs, i < j, whose slopes a window of ``n`` points takes: all of them, or a
    deterministic subsample of ``max_pairs`` (the same window size always gives the same pairs, so the
    same answer). Kept for the few window sizes in use (~80 KiB each): drawing 20,000 pairs took ~19 ms
    of an evaluation, and the long window has the same size at every one."""
    first, second = array.array("i"), array.array("i")
    if n * (n - 1) // 2 <= max_pairs:
        for i in range(n - 1):
            first.extend([i] * (n - 1 - i))
            second.extend(range(i + 1, n))
        return first, second
    # random.Random(0).randrange(n), drawn as randrange draws it (getrandbits of n's bit length until
    # below n), without its per-call overhead: the same pairs as before, a few times faster.
    bits, k = random.Random(0).getrandbits, n.bit_length()

    def below_n() -> int:
        drawn = bits(k)
        while drawn >= n:
            drawn = bits(k)
        return drawn

    for _ in range(max_pairs):
        i, j = below_n(), below_n()
        while j == i:
            j = below_n()
        first.append(min(i, j))
        second.append(max(i, j))
    return first, second


def sorted_slopes(xs: Sequence[float], ys: Sequence[float], *, max_pairs: int = 20_000) -> list[float]:
    """The pairwise slopes ``theil_sen`` takes its median and interval from, sorted (a deterministic
    subsample of ``max_pairs`` pairs past that many): the costly part, worked out once per window."""
    n = len(xs)
    if n != len(ys):
        raise ValueError(f"theil_sen: xs and ys differ in length ({n} != {len(ys)})")
    first, second = _pairs(n, max_pairs)
    return sorted((ys[j] - ys[i]) / (xs[j] - xs[i]) for i, j in zip(first, second, strict=True) if xs[j] != xs[i])


def _median(slopes: Sequence[float]) -> float:
    m = len(slopes)
    if not m:
        return 0.0
    mid = m // 2
    return slopes[mid] if m % 2 else (slopes[mid - 1] + slopes[mid]) / 2.0


def theil_sen(
    xs: Sequence[float], ys: Sequence[float], *, variance: float | None = None, max_pairs: int = 20_000,
    slopes: list[float] | None = None,
) -> Slope:
    """Median of pairwise slopes; the interval is Sen's (1968), from the Mann-Kendall variance.

    ``variance`` is Var(S) (e.g. autocorrelation-inflated); by default the tie-corrected one.
    The interval is two-sided at ``_CONFIDENCE``. ``slopes``: this window's
    ``sorted_slopes``, when the caller has them already.
    """
    n = len(xs)
    if n != len(ys):
        raise ValueError(f"theil_sen: xs and ys differ in length ({n} != {len(ys)})")
    if slopes is None:
        slopes = sorted_slopes(xs, ys, max_pairs=max_pairs) if n >= 2 else []
    if n < 2 or not slopes:
        return NO_SLOPE
    m = len(slopes)
    median = _median(slopes)
    var_s = _tie_variance(ys) if variance is None else variance
    total = n * (n - 1) / 2.0
    c = _NORMAL.inv_cdf(0.5 + _CONFIDENCE / 2.0) * math.sqrt(max(var_s, 0.0))
    scale = m / total  # rank positions scale with the subsample
    lo_rank = math.floor((total - c) / 2.0 * scale)
    hi_rank = math.ceil((total + c) / 2.0 * scale)
    low = slopes[lo_rank] if 0 <= lo_rank < m else -math.inf
    high = slopes[hi_rank] if 0 <= hi_rank < m else math.inf
    return Slope(median, min(low, median), max(high, median), m)


def ramp_consistent(xs: Sequence[float], ys: Sequence[float], slope: float) -> bool:
    """Do both halves rise at more than half of ``slope``?

    A one-off jump lives in one half and leaves the other flat; a leak raises both.
    """
    n = len(xs)
    if slope <= 0 or n < 4:
        return False
    size = n / 2
    for p in range(2):
        lo, hi = round(p * size), round((p + 1) * size)
        piece = theil_sen(xs[lo:hi], ys[lo:hi], max_pairs=5_000).slope
        if piece <= 0.5 * slope:
            return False
    return True


def floor_growth(ys: Sequence[float], fraction: float = 0.25) -> float:
    """Minimum of the last ``fraction`` of the window minus the minimum of the first.

    A leak never returns to its old floor; a sawtooth that resets within the window does.
    """
    k = max(1, int(len(ys) * fraction))
    return 0.0 if len(ys) < 2 * k else min(ys[-k:]) - min(ys[:k])


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether one window passed every test, and if not the first test it failed."""

    passed: bool
    reason: str  # "leak" when passed, otherwise what failed ("too few points", "not significant", ...)
    slope: Slope
    p_increasing: float


def assess(
    xs: Sequence[float], ys: Sequence[float], *, min_slope: float, min_growth: float = 0.0,
    p_max: float = 1e-3, min_points: int = 8, max_pairs: int = 20_000,
) -> Verdict:
    """All the checks of one window: significance, effect size, total growth, ramp consistency."""
    if len(ys) < min_points:
        return Verdict(False, "too few points", NO_SLOPE, 1.0)
    slopes = sorted_slopes(xs, ys, max_pairs=max_pairs)  # once: the point slope and its interval share them
    mk = mann_kendall(ys, xs=xs, slope=_median(slopes))
    slope = theil_sen(xs, ys, variance=mk.variance, slopes=slopes)

    def verdict(reason: str) -> Verdict:
        return Verdict(reason == "leak", reason, slope, mk.p_increasing)

    if mk.p_increasing >= p_max:
        return verdict("not significant")
    if slope.low < min_slope:
        return verdict("slope below threshold")
    # The floor must have moved by a good part of what the slope implies over the window:
    # a sawtooth that resets inside the window comes back to its old floor.
    if floor_growth(ys) < max(min_growth, 0.4 * slope.slope * (xs[-1] - xs[0])):
        return verdict("floor returns")
    if not ramp_consistent(xs, ys, slope.slope):
        return verdict("not a ramp")
    return verdict("leak")


def assess_knee(
    xs: Sequence[float], ys: Sequence[float], knee: int, *, min_slope: float, min_growth: float,
    p_max: float = 1e-3, min_points: int = 8, max_pairs: int = 20_000,
) -> Verdict:
    """A ramp that began inside the window, after index ``knee`` (the hinge of a flat-then-ramp fit),
    judged from its knee: its floors must all be above every floor before it, which the newest m of n
    exchangeable floors are by chance once in C(n, m) (the p-value; a rank test over the whole window
    would weigh a flat start's drift of a few KiB as much as the ramp); the ramp's own slope, its ramp
    consistency, and its rise above the flat part's highest floor."""
    n, flat, rx, ry = len(ys), ys[: knee + 1], xs[knee:], ys[knee:]
    if n < min_points or len(rx) < 4:
        return Verdict(False, "too few points", NO_SLOPE, 1.0)
    slope = theil_sen(rx, ry, max_pairs=max_pairs)
    above = min(ry[1:]) > max(flat)
    p = 1.0 / math.comb(n, len(ry) - 1) if above else 1.0
    growth = min(ry[-max(1, len(ry) // 4):]) - max(flat)

    def verdict(reason: str) -> Verdict:
        return Verdict(reason == "leak", reason, slope, p)

    if p >= p_max:
        return verdict("not significant")
    if slope.low < min_slope:
        return verdict("slope below threshold")
    if growth < min_growth:
        return verdict("growth below threshold")
    if not ramp_consistent(rx, ry, slope.slope):
        return verdict("not a ramp")
    return verdict("leak")
