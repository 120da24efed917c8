"""The detector's verdicts beside a window's test (pure: no torch, no I/O, no clock).

``analysis.trend.assess`` judges a window; ``analysis.leak_detector`` also takes the verdict a count
series is lent by the bytes it accounts for (``lent_verdict``), a ramp judged from its knee before
the history covers a window (``knee_verdict``), a failed verdict that keeps its reason
(``with_reason``), and lets a track rest while a finding that explains it is confirmed
(``explained_at_rest``).
"""

from __future__ import annotations

from collections.abc import Mapping

from gpumemd.analysis.leak_track import Track, hinge_onset
from gpumemd.analysis.leak_types import DetectorConfig, LeakState
from gpumemd.analysis.trend import NO_SLOPE, Slope, Verdict, assess_knee, theil_sen

CONFIRMED_EVERY = 10
"""Checks between two re-tests of a confirmed track (and of a track its finding explains): a window at
the defaults (10 x 50 steps). A re-test is the detector's costliest work (the window's O(n²) tests and
the finding's sentences rebuilt): at every 4th check, re-tests were about a third of the leak checks'
time while a 1-tensor/step leak was tracked on 2 ms steps (16.0 µs a step, 12.8 at every 10th)."""

NEAR_OOM_EVERY = 4
"""Checks between re-tests of a confirmed track whose finding projects the out-of-memory within
``NEAR_OOM_RESTS`` rests of ``CONFIRMED_EVERY`` checks (10,000 steps at the defaults): its figures, the
projection among them, are refreshed at re-tests, and this close they must not lag by more than a few
percent of the time left."""

NEAR_OOM_RESTS = 20


def explained_at_rest(tracks: Mapping[tuple[str, str], Track], track: Track, phase: str, step: int,
                       check_every: int) -> bool:
    """Does a track with no finding of its own rest, as a confirmed one does, while a series that
    explains it has a confirmed finding? Its rise is that finding's (host bytes rising with a confirmed
    tensor leak were re-tested in full at every check, the detector's main cost while a leak was
    tracked); a growth of its own is still seen at the next full test. Not while that finding is only
    suspected: until it is confirmed, this track's passes are lent to it (``LeakDetector._lend``)."""
    if (track.state is not None and track.state.active) or track.tested_at is None:
        return False
    if step - track.tested_at >= CONFIRMED_EVERY * check_every:
        return False
    return any(other.state is LeakState.CONFIRMED for other in explainers(tracks, track, phase))


def explainer_raised_since(tracks: Mapping[tuple[str, str], Track], track: Track, phase: str, step: float) -> bool:
    """Was a finding on a series that explains ``track`` raised at or after ``step`` (its last full test),
    and is it still active? A confirmed track (host RSS, confirmed first: it is dense, the tensors are
    counted at scans) rests between re-tests; the finding that explains it must end that rest, or
    two findings of one leak stood side by side for ten checks, thousands of steps while tracking. At
    ``step`` itself too: dense series are tested first, so a finding raised in the same evaluation came
    after ``track``'s test (host RSS confirmed and the tensor finding raised at one check: two findings
    to the end of a 6,000-step run in 1 of 4 runs of ``bench_leak_tracking.py`` at ~2 ms)."""
    return any(other.state is not None and other.state.active and other.first_step is not None
               and other.first_step >= step for other in explainers(tracks, track, phase))


def explainer_active(tracks: Mapping[tuple[str, str], Track], track: Track, phase: str, verdict: Verdict) -> bool:
    """Was ``track``'s growth explained (``verdict``) by a series whose finding is active? Then an active
    episode of ``track`` says that growth a second time and is withdrawn at once (``next_state``)."""
    return verdict.reason.startswith("explained") and any(
        other.state is not None and other.state.active for other in explainers(tracks, track, phase))


OUTGROWN_FACTOR = 2.0
"""An explained track (host RSS under a tensor finding) whose growth passes this many times its slope when
the explaining finding was first seen active, plus the least growth that matters, is judged on its own.
Host bytes per tensor byte vary by orders of magnitude (a 64 B tensor a step has kept ~24 KiB of RSS a
step, the heap fragmented around it), so the explainer's own bytes cannot bound it; its onset rate can."""


def outgrown_slope(track: Track, min_slope: float) -> float:
    """The growth per step above which an explained track's rise is its own (``OUTGROWN_FACTOR``)."""
    return OUTGROWN_FACTOR * (track.explained_base or 0.0) + min_slope


def outgrew(tracks: Mapping[tuple[str, str], Track], track: Track, phase: str, step: int, *, min_slope: float,
            half_window: float, min_points: int) -> bool:
    """Keeps ``track.explained_base`` (set at the first evaluation that sees a finding that explains the
    track active, from its newer half window; cleared when none is), and says whether that half window
    may rise faster than ``outgrown_slope`` (``Track.may_rise``, the cheap necessary test): then a finding
    that explains it no longer does so alone, and it is judged on its own. (A host leak of numpy arrays
    that started while a leak of small CPU tensors was tracked was never reported: host RSS rising with a
    tensor finding active was that finding's growth, however fast.) Kept as ``track.outgrown`` too."""
    track.outgrown = False
    if not track.spec.explained_by:  # most series: no walk over the other tracks
        return False
    if not any(other.state is not None and other.state.active for other in explainers(tracks, track, phase)):
        track.explained_base = None
    elif track.explained_base is None:
        xs, ys = track.window(step, half_window, min_points)
        track.explained_base = max(0.0, theil_sen(xs, ys, max_pairs=2000).slope) if len(xs) >= 3 else 0.0
    else:
        track.outgrown = track.may_rise(step, half_window, min_points, outgrown_slope(track, min_slope))
    return track.outgrown


def explainers(tracks: Mapping[tuple[str, str], Track], track: Track, phase: str) -> list[Track]:
    """The tracks of ``phase`` whose series explain ``track``'s (``SeriesSpec.explained_by``, "name*" a prefix).
    Kept on ``track`` until ``tracks`` (the detector's, which only ever gains tracks) has more: host RSS
    asks at every evaluation, and matching every track's name was a tenth of a flat series' evaluation."""
    seen_in = (id(tracks), len(tracks), phase)
    if track.explainers_in == seen_in:
        return track.explainer_tracks
    exact = {name for name in track.spec.explained_by if not name.endswith("*")}
    prefixes = tuple(name[:-1] for name in track.spec.explained_by if name.endswith("*"))
    found = [other for key, other in tracks.items()
             if key[1] == phase and (key[0] in exact or (prefixes and key[0].startswith(prefixes)))]
    track.explainers_in, track.explainer_tracks = seen_in, found
    return found


UNCOVERED = Verdict(False, "history shorter than a window", NO_SLOPE, 1.0)


def with_reason(v: Verdict, reason: str) -> Verdict:
    return Verdict(False, reason, v.slope, v.p_increasing)


def lent_verdict(track: Track, since: float, p_value: float, max_pairs: int) -> Verdict:
    """A lent pass: the count series' own slope since ``since`` (from its last floor before it to its
    newest observation), with the lender's p-value."""
    pts = [p for p in track.floors if p[0] < since][-1:] + [p for p in track.floors if p[0] >= since]
    if track.pending is not None:
        pts.append((float(track.pending[0]), track.pending[1]))
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    slope = theil_sen(xs, ys, max_pairs=max_pairs) if len(pts) >= 2 else Slope(0.0, 0.0, 0.0, 0)
    reason = "leak" if slope.slope > 0 else "not significant"
    return Verdict(reason == "leak", reason, slope, p_value)


def knee_verdict(c: DetectorConfig, xs: list[float], ys: list[float], min_slope: float) -> tuple[Verdict, int]:
    """A ramp that began after a flat start at least as long as itself and at least half a window
    (0.45 of it, as the history guard's 0.9), judged from its knee once it grew as much as a leak just
    worth reporting grows in a whole window, above every floor before it. A sawtooth seen in the window
    (which spans 2.5 of its periods) never rises above its own peaks by that much; one that starts
    after a flat half window is the known limit."""
    knee = hinge_onset(xs, ys)
    if knee < len(xs) // 2 or knee == 0 or xs[knee] - xs[0] < 0.45 * c.window_steps - c.block:
        return UNCOVERED, knee
    return assess_knee(xs, ys, knee, min_slope=min_slope, min_growth=min_slope * c.window_steps,
                       p_max=c.p_max, min_points=c.min_points, max_pairs=c.max_pairs), knee
