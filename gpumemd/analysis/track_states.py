"""A track's state from its verdicts (pure: no torch, no I/O, no clock): its passes and failures in a
row, and the state they lead to (``LeakState``: suspected, confirmed, cleared; step 5 of
``analysis.leak_detector``'s docstring says when).
"""

from __future__ import annotations

from collections.abc import Sequence

from gpumemd.analysis.leak_track import Track
from gpumemd.analysis.leak_types import DetectorConfig, LeakState
from gpumemd.analysis.trend import Verdict, theil_sen


def count_pass_or_fail(track: Track, verdict: Verdict, active: bool,
                       hx: Sequence[float], hy: Sequence[float], *, lent_streak: int) -> None:
    # passes in a row, explained or held ones included (lent with a verdict: see ``LeakDetector._lend``)
    track.streak = track.streak + 1 if verdict.passed or verdict.reason.startswith(("explained", "held")) else 0
    if verdict.passed:
        # a lent pass carries the lender's passes in a row: the same growth, seen that long
        track.consecutive_pass = max(track.consecutive_pass + 1, lent_streak)
        track.consecutive_fail = 0
        track.episode_slope = verdict.slope.slope
    elif active and not verdict.reason.startswith("explained") and still_growing(track, hx, hy):
        # A finding that fails one window (a noisy stretch, a burst, a threshold that rose with
        # the step rate) is not evidence that the leak stopped: it stays, neither passing nor
        # failing. Only growth that has really slowed counts towards clearing.
        pass
    else:
        track.consecutive_fail += 1
        track.consecutive_pass = 0


def next_state(c: DetectorConfig, track: Track, verdict: Verdict, *, active: bool, confirmed_long: bool,
               step: int) -> LeakState | None:
    state = track.state
    if verdict.passed:
        if not active:
            state = LeakState.SUSPECTED
            track.first_step = step
        if state is LeakState.SUSPECTED and (confirmed_long or track.consecutive_pass >= c.confirm_after):
            state = LeakState.CONFIRMED
    elif active and track.consecutive_fail >= c.clear_after:
        state = LeakState.CLEARED
    return state


def still_growing(track: Track, hx: Sequence[float], hy: Sequence[float]) -> bool:
    """Does the newer half window still rise at a quarter of the episode's slope or more?"""
    if len(hx) < 3 or track.episode_slope <= 0:
        return False
    recent = theil_sen(hx, hy, max_pairs=2000).slope
    return recent >= 0.25 * track.episode_slope
