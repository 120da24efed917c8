"""One (series, phase) track of the leak detector: its block floors, sawtooth resets and windows.

Pure (no torch, no I/O, no clock). ``analysis.leak_detector`` decides on the windows a track gives;
this module keeps the points: floors in step order, a bounded history, windows thinned so the O(n²)
trend tests stay cheap, and where a flat series turned into a ramp (``hinge_onset``).
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from collections import deque
from collections.abc import Sequence
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING

from gpumemd.analysis.leak_types import LeakState

if TYPE_CHECKING:
    from gpumemd.analysis.leak_types import SeriesSpec, TrackStatus

_MAX_RESETS = 8
MAX_WINDOW_POINTS = 64  # points per assessed window (O(n²) rank test): ~5 ms worst case in pure Python


@dataclass(slots=True, eq=False)
class Track:
    """The points and the decision state of one (series, phase)."""

    spec: SeriesSpec
    max_floors: InitVar[int]
    floors: deque[tuple[float, float]] = field(init=False)
    ordered: bool = True  # floors in step order (steps numbered forwards), so a window is a suffix
    block_id: int = -1  # step // block of the open block
    block_min: float = math.inf
    block_n: int = 0
    block_xsum: float = 0.0
    pending: tuple[int, float] | None = None  # sparse series: the newest observation, not a point yet
    state: LeakState | None = None
    first_step: int | None = None
    episode_slope: float = 0.0  # the slope when the current episode was last passed
    last_status: TrackStatus | None = None
    tested_at: int | None = None  # the step of the last full test of its window
    # Its slope when a finding on a series that explains it was first seen active (host RSS under a
    # tensor finding); None while none is. Growth well above it is this series' own (``leak_verdicts.outgrew``).
    explained_base: float | None = None
    outgrown: bool = False  # at the last evaluation, its growth passed what that finding explains
    onset: int | None = None  # the current episode's onset, kept once its flat start scrolls out
    onset_value: float = 0.0  # the floor at the onset, kept with it: growth is measured from it
    consecutive_pass: int = 0
    streak: int = 0  # evaluations in a row whose window passed, explained or held ones included
    consecutive_fail: int = 0
    released: bool = False  # an active episode's floor fell back to ``onset_value``: cleared at the next check
    # sawtooth bookkeeping: trough/peak since the last reset, and (length, peak) of past rises
    trough: float = math.inf
    trough_x: float = 0.0
    peak: float = -math.inf
    peak_x: float = 0.0
    fall: tuple[float, float, float, float] | None = None  # a sparse series' last rise to bound again
    # (trough_x, trough, peak_x, peak)
    resets: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=_MAX_RESETS))
    longest: float = 0.0  # the longest rise of ``resets`` (kept with them: read at every evaluation)
    # The tracks whose series explain this one's, and what they were found in (``leak_verdicts.explainers``).
    explainers_in: tuple[int, int, str] | None = None
    explainer_tracks: list[Track] = field(default_factory=list)

    def __post_init__(self, max_floors: int) -> None:
        self.floors = deque(maxlen=max_floors)

    def add_floor(self, x: float, y: float, min_rise: float) -> None:
        if self.floors and x < self.floors[-1][0]:
            self.ordered = False
        self.floors.append((x, y))
        if self.onset is not None and y <= self.onset_value and self.state is not None and self.state.active:
            self.released = True
        if self.fall is not None and self.pending is not None:
            self.resets[-1] = _rise_bounds(*self.fall, seen_by=self.pending[0])
            self.fall = None
            self.longest = max(length for length, _ in self.resets)
        rise = self.peak - self.trough
        if rise >= min_rise and y <= self.trough + 0.5 * rise:
            # The floor fell back most of the way: an accumulation that resets (metric list,
            # epoch cache, gc of reference cycles). Remember how long it rose, and how high.
            # A sparse series' count is dated at the scan before the one that made it (what
            # survived from there), so its fall was seen at a scan the detector learns of only with
            # the next count, and the rise may have gone on until then: its length and peak are
            # bounded again from there (``fall``). Dated by the floors alone, scans 250-500 steps
            # apart while a finding was tracked put the fall of a 1,200-step epoch's list at 702
            # steps and its peak 40% low, and the next epoch read as a new leak.
            bounds = (self.trough_x, self.trough, self.peak_x, self.peak)
            self.resets.append(_rise_bounds(*bounds, seen_by=x))
            self.longest = max(length for length, _ in self.resets)
            self.fall = bounds if self.pending is not None else None
            self.trough, self.trough_x, self.peak, self.peak_x = y, x, y, x
            return
        if y < self.trough:
            self.trough, self.trough_x = y, x
        if y > self.peak:
            self.peak, self.peak_x = y, x

    def longest_rise(self) -> float:
        """Steps the longest rise that fell back took (0 without one)."""
        return self.longest

    def below_reset_peaks(self, min_length: float) -> bool:
        """Is the newest floor no higher than a rise of ``min_length`` steps or more that fell back
        once reached? An accumulation emptied now and then rises to about the same peak each time; a
        leak goes past it. (Shorter rises are noise, or sawtooths the window already spans.)"""
        peaks = [peak for length, peak in self.resets if length >= min_length]
        return bool(peaks and self.floors) and self.floors[-1][1] <= max(peaks)

    def window(self, now: int, steps: float, min_points: int) -> tuple[list[float], list[float]]:
        return thin(*self._points(now, steps, min_points))

    def may_rise(self, now: int, steps: float, min_points: int, min_slope: float) -> bool:
        """``floor_growth(y) >= 0.4 * min_slope * (x[-1] - x[0])`` on ``window(now, steps, min_points)``,
        worked out on the floors as ``thin`` would merge them (the same floats, in the same order)
        without building the thinned window."""
        return _may_rise(*self._points(now, steps, min_points), min_slope)

    def may_move(self, now: int, steps: float, min_points: int, min_slope: float, growth: float) -> bool:
        """The test every evaluation makes of a quiet track, the common case, before the O(n²) tests:
        ``may_rise`` on the window or on its newer half, or the newest floor ``growth`` above every floor
        of the window's older half (the cheap test for a ramp judged from its knee, ``assess_knee``,
        whose flat start holds at least that half). One copy of the window's points serves all three:
        three copies were most of an evaluation of a flat series (~25 of ~65 µs, warm)."""
        xs, ys = self._points(now, steps, min_points)
        if _may_rise(xs, ys, min_slope) or (len(ys) >= 2 and ys[-1] - max(ys[: len(ys) // 2]) >= growth):
            return True
        if not self.ordered:
            return _may_rise(*self._points(now, steps / 2, min_points), min_slope)
        # The half window is a suffix of the window's points, at least its last ``min_points`` floors
        # (which the window holds: the caller tests only tracks with that many).
        start = min(bisect.bisect_left(xs, now - steps / 2), max(0, len(xs) - min_points))
        return _may_rise(xs[start:], ys[start:], min_slope)

    def onset_and_growth(self) -> tuple[int | None, float]:
        """The current episode's onset (the hinge of the floors) and the growth since it."""
        floors = list(self.floors)
        if len(floors) < 3:
            return None, 0.0
        xs = [p[0] for p in floors]
        ys = [p[1] for p in floors]
        i = hinge_onset(xs, ys)
        now = min(ys[-max(1, len(ys) // 20):])
        if i > 0 or self.onset is None:
            # i == 0: the flat start has left the bounded history; the onset found while it was
            # there stays (never later than the data says), and so does the value there: growth
            # against the oldest kept floor would stop counting what scrolled out.
            # A count series has one point per scan (up to 50 steps apart): the knee falls on a
            # scan's step, so it is dated between the scans instead (see ``knee_between``).
            onset = knee_between(xs, ys, i) if self.spec.unit != "bytes" else int(xs[i])
            # A confirmed episode's onset only moves earlier: once the flat start has scrolled out,
            # the hinge of a ramp whose rate varies (1, then 3 tensors a step, in turns) falls inside
            # the ramp, and a leak that ran since step 52 read "since step 92,603, +789.5 KiB so far".
            if self.onset is None or self.state is not LeakState.CONFIRMED or onset < self.onset:
                self.onset, self.onset_value = onset, min(ys[: i + 1])
        growth = max(0.0, now - self.onset_value)
        return self.onset, growth

    def _points(self, now: int, steps: float, min_points: int) -> tuple[list[float], list[float]]:
        """The floors of the last ``steps`` steps (at least the last ``min_points``), unthinned."""
        # Evaluations run at step ends, where time is the job's: the points are found by bisection
        # and copied in C (``(lo,)`` sorts before every floor at ``lo`` and after every one below it).
        lo = now - steps
        floors = self.floors
        pts: Sequence[tuple[float, float]]
        if self.ordered:
            pts = tuple(itertools.islice(floors, bisect.bisect_left(floors, (lo,)), None))
        else:
            pts = [p for p in floors if p[0] >= lo]
        if len(pts) < min_points:
            pts = list(floors)[-min_points:]
        if not pts:
            return [], []
        xs, ys = zip(*pts, strict=True)
        return list(xs), list(ys)


def _may_rise(xs: Sequence[float], ys: Sequence[float], min_slope: float) -> bool:
    """``Track.may_rise`` on these points (a window's, unthinned)."""
    n = len(xs)
    if n <= MAX_WINDOW_POINTS:  # thin keeps them as they are
        k, start = 1, 0
        last, first = xs[-1], xs[0]
    else:  # groups of k neighbours, aligned to the newest: x their mean, y their minimum
        k = math.ceil(n / MAX_WINDOW_POINTS)
        start = n % k
        last, first = sum(xs[n - k :]) / k, sum(xs[start : start + k]) / k
    m = (n - start) // k  # points in the thinned window
    q = max(1, int(m * 0.25))  # floor_growth's quarter
    growth = 0.0 if m < 2 * q else min(ys[n - q * k :]) - min(ys[start : start + q * k])
    return growth >= 0.4 * min_slope * (last - first)


def _rise_bounds(trough_x: float, trough: float, peak_x: float, peak: float, *, seen_by: float,
                 ) -> tuple[float, float]:
    """(length, peak) of a rise that fell back, had it gone on at its slope until ``seen_by``."""
    slope = (peak - trough) / max(peak_x - trough_x, 1.0)
    return max(seen_by - trough_x, 1.0), peak + slope * max(0.0, seen_by - peak_x)


def thin(xs: list[float], ys: list[float]) -> tuple[list[float], list[float]]:
    """Floors of floors: merge neighbours (min y, mean x) so a window never has more than
    ``MAX_WINDOW_POINTS`` points and the O(n²) tests stay cheap on long windows."""
    n = len(xs)
    if n <= MAX_WINDOW_POINTS:
        return xs, ys
    k = math.ceil(n / MAX_WINDOW_POINTS)
    start = n % k  # keep the newest points aligned; drop the oldest remainder
    # Groups of k neighbours, as k strided slices zipped (every group is whole: n - start is a
    # multiple of k), in C; sum() adds each group's x in order, so the means are a loop's to the bit.
    out_x = list(map(operator.truediv, map(sum, zip(*(xs[start + j :: k] for j in range(k)), strict=True)),
                     itertools.repeat(k)))
    out_y = list(map(min, zip(*(ys[start + j :: k] for j in range(k)), strict=True)))
    return out_x, out_y

def hinge_onset(xs: Sequence[float], ys: Sequence[float]) -> int:
    """Index where a flat series turns into a ramp: the breakpoint of the least-squares fit of
    ``y = a + s * max(0, x - x[i])`` (flat, then linear), found in O(n) with suffix sums.

    A CUSUM of differences marks where the *average* slope is first exceeded, which drifts towards
    the window's start on a long ramp; the hinge fit puts the knee where the data bends."""
    n = len(xs)
    if n < 3:
        return 0
    sum_y = sum(ys)
    sum_yy = sum(y * y for y in ys)
    # suffix sums of 1, x, x², y, x·y over j >= i
    best, arg = math.inf, 0
    s1 = sx = sxx = sy = sxy = 0.0
    suffix: list[tuple[float, float, float, float, float]] = [(0.0, 0.0, 0.0, 0.0, 0.0)] * (n + 1)
    for j in range(n - 1, -1, -1):
        x, y = xs[j], ys[j]
        s1 += 1
        sx += x
        sxx += x * x
        sy += y
        sxy += x * y
        suffix[j] = (s1, sx, sxx, sy, sxy)
    mean_y = sum_y / n
    syy_centered = sum_yy - n * mean_y * mean_y
    for i in range(n - 1):
        b = xs[i]
        c1, cx, cxx, cy, cxy = suffix[i]
        # z = x - b on the suffix, 0 before it
        sz = cx - b * c1
        szz = cxx - 2 * b * cx + b * b * c1
        szy = cxy - b * cy
        var_z = szz - sz * sz / n
        if var_z <= 0:
            continue
        cov = szy - sz * sum_y / n
        sse = syy_centered - cov * cov / var_z
        if cov > 0 and sse < best - 1e-9 * abs(best if math.isfinite(best) else 1.0):
            best, arg = sse, i
    return arg



_KNEE_RAMP_POINTS = 5
"""Points of the ramp after the knee that date it: near the knee, so a rate that changes later
(a cache that fills more slowly) does not move it."""


def knee_between(xs: Sequence[float], ys: Sequence[float], i: int) -> int:
    """The step where a sparse series left its flat level, between the scans around the hinge
    ``xs[i]``: where the line through the first points of the ramp meets the level before it.

    The hinge fit can only put the knee on a point, and the point at a scan a step or two into the
    leak is still almost flat (2 tensors of a ramp that will gain 50 by the next scan), so the hinge
    lands on it: +1 to +8 steps late at 10 to 50 steps between scans. A count grows by whole tensors
    from the first leaked step, so the line through the ramp meets the flat level at that step."""
    n = len(xs)
    if n < 3 or i >= n - 1:
        return int(xs[i])
    flat = sorted(ys[max(0, i - 5) : i] or ys[:1])
    level = flat[len(flat) // 2]  # the median: a stray survivor on the flat part does not lift it
    lo = i + 1 if ys[i] <= level else i  # the hinge point belongs to the ramp once it left the level
    rx, ry = xs[lo : lo + _KNEE_RAMP_POINTS], ys[lo : lo + _KNEE_RAMP_POINTS]
    if len(rx) < 2:
        rx, ry = xs[i : i + 2], ys[i : i + 2]
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxx = sum((x - mx) ** 2 for x in rx)
    slope = sum((x - mx) * (y - my) for x, y in zip(rx, ry, strict=True)) / sxx if sxx > 0 else 0.0
    if slope <= 0:
        return int(xs[i])
    knee = mx + (level - my) / slope
    # never outside the scans around the hinge: the data says no more than that
    return round(min(max(knee, xs[max(0, i - 1)]), xs[i + 1]))
