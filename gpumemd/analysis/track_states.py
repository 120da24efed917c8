"""A track's state from its verdicts (pure: no torch, no I/O, no clock): its passes and failures in a
row, and the state they lead to (``LeakState``: suspected, confirmed, cleared; step 5 of
``analysis.leak_detector``'s docstring says when), an episode that fell back to where it began
(cleared at once), and a new episode held below the peaks that earlier rises fell back from.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpumemd.analysis.leak_track import Track
from gpumemd.analysis.leak_types import DetectorConfig, LeakState, TrackStatus
from gpumemd.analysis.leak_verdicts import UNCOVERED, with_reason
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
               step: int, withdrawn: bool = False) -> LeakState | None:
    """``withdrawn``: an active episode whose growth a finding on another series accounts for (host RSS
    under a tensor leak) ends now. Its failures need not add up to ``clear_after``: it is not evidence
    that the growth slowed, and while that finding is tracked the checks come up to 800 steps apart,
    so two findings of one leak stood side by side for thousands of steps."""
    state = track.state
    if verdict.passed:
        if not active:
            state = LeakState.SUSPECTED
            track.first_step = step
        if state is LeakState.SUSPECTED and (confirmed_long or track.consecutive_pass >= c.confirm_after):
            state = LeakState.CONFIRMED
    elif active and (withdrawn or track.consecutive_fail >= c.clear_after):
        state = LeakState.CLEARED
    return state


def still_growing(track: Track, hx: Sequence[float], hy: Sequence[float]) -> bool:
    """Does the newer half window still rise at a quarter of the episode's slope or more?"""
    if len(hx) < 3 or track.episode_slope <= 0:
        return False
    recent = theil_sen(hx, hy, max_pairs=2000).slope
    return recent >= 0.25 * track.episode_slope


def released_status(track: Track, phase: str, step: int, min_slope: float) -> TrackStatus:
    """An episode whose series fell back to its floor at the onset: cleared now. A leak never
    returns there; an accumulation emptied now and then (a list of an epoch's outputs) does, and
    rises again at the same slope, which alone read as a leak that goes on."""
    track.state, track.released = LeakState.CLEARED, False
    track.consecutive_pass = track.streak = track.consecutive_fail = 0
    onset_step, _ = track.onset_and_growth()
    last = track.last_status
    where = f"at step {onset_step:,}" if onset_step is not None else "at its onset"
    verdict = with_reason(last.verdict if last is not None else UNCOVERED, f"fell back to its level {where}")
    status = TrackStatus(spec=track.spec, phase=phase, state=LeakState.CLEARED, changed=True, step=step,
                         first_step=track.first_step, verdict=verdict, window_start=float(step),
                         onset_step=onset_step, growth_bytes=0.0, min_slope=min_slope)
    track.last_status = status
    return status


def past_reset_peaks(verdict: Verdict, track: Track, *, active: bool, min_length: float) -> Verdict:
    """``verdict``, failed when it would raise a new episode whose newest floor has not passed a peak
    that an earlier rise of ``min_length`` steps or more fell back from. A sawtooth's period is not
    always known well enough to widen the window past a rise (scans 500 steps apart while tracking
    dated the first reset of a 1,200-step epoch at 702 steps)."""
    if verdict.passed and not active and track.below_reset_peaks(min_length):
        return with_reason(verdict, "below the peak of an earlier rise that fell back")
    return verdict
