"""The leak detector: named per-step series in, state changes out (pure: no torch, no I/O, no clock).

The wording of findings lives in ``analysis.leak_wording``; this module only decides, with the
verdicts beside a window's test in ``analysis.leak_verdicts`` and a track's states in ``analysis.track_states``.

How it decides (see ``analysis.trend`` for the statistics and LEAK_DETECTION.md for the evidence):

1. Warm-up: samples before ``warmup_steps`` are ignored (optimizer state appears at step 1,
   compile/cuDNN workspaces on the first shapes, the first eval and checkpoint).
2. Phases: each (series, phase) pair is its own track, so eval steps are compared with eval steps
   and never make the training baseline look like it grows.
3. Block floors: the minimum of every ``block`` samples (dense series); sparse series such as the
   census give one point per census, at its step, once the next census is in: the minimum of the
   two (a one-off high is removed; a steady rise keeps its true slope).
4. Every ``check_every_steps`` the short window (``window_steps``, widened to 2.5 reset periods
   once the track has shown sawtooth resets) and, when the history covers it, the long window
   (``long_window_factor`` x) are assessed: Mann-Kendall p, Theil-Sen lower bound >= the series'
   threshold, floor growth, ramp consistency. The threshold is given per evaluation (``min_slopes``):
   the component derives it from the job (headroom / steps in the horizon, never below the series'
   noise floor), so the detector stays pure.
5. States (``LeakState``): a short pass -> suspected; a long pass or ``confirm_after`` short passes in
   a row -> confirmed; cleared only once the growth has stopped: ``clear_after`` failures in a row
   whose recent slope is below a quarter of the episode's (a leak that goes on is never cleared,
   whatever its p-value does), or at once when the series falls back to its floor at the onset,
   where a leak never returns (an epoch's list of outputs, emptied at its end, does). After such a
   fall, a new episode is raised only past the peak the fallen rise reached. Only state changes are
   reported.
6. A series may be *held* (``hold``): its values stopped measuring it (a counter that hit its cap
   counts no more), so its tracks keep the state they had, never cleared, and say why.
7. A series may be "explained by" others (host RSS by the census of CPU tensors): when they grow at
   least half as fast over the same window, the growth is theirs and the series does not fire.
   A family of count series that explains it *lends* its verdict: a count series rising since the
   window's start passes with it (the same growth, named by what grows), so a count series seen only
   every 10 to 50 steps is decided as soon as the bytes it accounts for, seen every step, are. A
   finding the series had already raised is withdrawn at the first test that finds the growth
   another active finding's.
8. A ramp that began inside the window after a flat start is also judged from its knee
   (``assess_knee``), before the history covers a window too, once it has risen above every earlier
   floor by as much as a material leak grows in a whole window: a strong leak is suspected within a
   few floors, not half a window. A sawtooth seen in the window never rises that far above its peaks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from gpumemd.analysis.leak_track import Track
from gpumemd.analysis.leak_types import DetectorConfig, LeakState, SeriesSpec, TrackStatus
from gpumemd.analysis.leak_verdicts import (
    CONFIRMED_EVERY,
    NEAR_OOM_EVERY,
    NEAR_OOM_RESTS,
    UNCOVERED,
    explained_at_rest,
    explainer_active,
    explainer_raised_since,
    knee_verdict,
    lent_verdict,
    outgrew,
    outgrown_slope,
    with_reason,
)
from gpumemd.analysis.track_states import count_pass_or_fail, next_state, past_reset_peaks, released_status
from gpumemd.analysis.trend import Verdict, assess, theil_sen

__all__ = ["DetectorConfig", "LeakDetector", "LeakState", "SeriesSpec", "TrackStatus"]

_MAX_TRACKS = 256  # bounded: a week-long job must not grow the detector (series x phases)


class LeakDetector:
    """Feed ``observe`` every step (cheap: O(1) per value); ``evaluate`` every check interval."""

    def __init__(self, config: DetectorConfig) -> None:
        self.config = config
        self._specs: dict[str, SeriesSpec] = {}
        self._tracks: dict[tuple[str, str], Track] = {}
        self._last_check: int | None = None
        self._phases_per_series: dict[str, int] = {}
        # (series, phase) of quiet tracks whose floor rose enough at the last evaluation to be
        # assessed in full: a component may start collecting culprit evidence before they fire.
        self.rising: set[tuple[str, str]] = set()
        self._held: dict[str, str] = {}  # series name -> why it is no longer judged
        # At the evaluation under way: the thresholds, and the count series lent a bytes series' pass
        # ((series, phase) -> the lender's window start, p-value and passes in a row; see ``_lend``).
        self._min_slopes: Mapping[str, float] = {}
        self._lent: dict[tuple[str, str], tuple[float, float, int]] = {}
        long_points = math.ceil(config.long_window_steps / config.block) + 2 * config.min_points
        self._max_floors = max(64, min(4096, long_points))
        self._block = config.block  # read at every observation (a property of the frozen config)
        self.check_every = config.check_every_steps
        """Steps between evaluations now: ``check_every_steps``, or longer while the component only tracks
        confirmed findings over its budget (``components.leak_scans``)."""
        self.near_oom: set[str] = set()
        """Series whose confirmed finding projects the out-of-memory within ``near_oom_within`` steps
        (the component says which): re-tested every ``NEAR_OOM_EVERY`` checks, not ``CONFIRMED_EVERY``."""
        self.near_oom_within = NEAR_OOM_RESTS * CONFIRMED_EVERY * config.check_every_steps

    # --- feeding -------------------------------------------------------------------------------

    def add_series(self, spec: SeriesSpec) -> None:
        """Declare a series (idempotent; a changed spec replaces the old one for new tracks)."""
        self._specs[spec.name] = spec

    def hold(self, name: str, reason: str) -> None:
        """Stop judging a series whose values no longer measure it (a counter at its cap stays flat
        while the thing it counts goes on growing): later values are ignored, and its tracks keep the
        state they had, an active finding staying active with ``reason`` on its status, never cleared."""
        self._held[name] = reason

    def series(self) -> list[SeriesSpec]:
        return list(self._specs.values())

    def buffer_ids(self) -> set[int]:
        """ids of the detector's own bounded buffers, so a heap search for growing containers
        never blames them (they fill up over the first long window)."""
        return {id(buffer) for track in self._tracks.values() for buffer in (track.floors, track.resets)}

    def observe(self, name: str, step: int, value: float, phase: str = "train") -> None:
        spec = self._specs.get(name)
        if spec is None or step < self.config.warmup_steps or not math.isfinite(value):
            return
        if self._held and name in self._held:
            return
        track = self._tracks.get((name, phase)) or self._track(spec, phase)
        if track is None:
            return
        block = 1 if spec.sparse else self._block
        if spec.sparse:
            # One point per census, and a census sees whatever the step left alive (this batch's
            # output, its graph): the point at a census's step is the minimum of it and the *next*
            # census, which removes such one-off highs. (The minimum with the previous one, labelled
            # with the newer step, shifted a rising series by one observation: at unevenly spaced
            # scans, 30, 10 and 20 steps apart, one tensor per step read "+0.91 tensors/step".)
            pending, track.pending = track.pending, (step, value)
            if pending is None:
                return
            step, value = pending[0], min(pending[1], value)
        # Dense series: one floor per block of ``block`` steps, aligned to step numbers, so a series
        # sampled every Nth step (the agent's stride) gives one floor per block it has a sample in.
        block_id = step // block
        if track.block_n and block_id != track.block_id:
            self._close_block(track, block)
        track.block_id = block_id
        track.block_min = min(track.block_min, value)
        track.block_n += 1
        track.block_xsum += step
        if step % block == block - 1:  # the block's last step: nothing more can join it
            self._close_block(track, block)

    def _close_block(self, track: Track, block: int) -> None:
        # A reset is a fall from a rise of 50 blocks of the least growth that matters, in bytes; a
        # count series' (tensors) rise is a window's of its own least growth (5 tensors were its
        # scans' noise). In bytes, a count series never had one, so an epoch's list of outputs,
        # emptied at its end, never widened its window or bounded its next rise as a sawtooth.
        if track.spec.unit == "bytes":
            min_rise = self.config.min_bytes_per_step * max(block, 1) * 5
        else:
            min_rise = self._min_slope(track.spec) * self.config.window_steps
        track.add_floor(track.block_xsum / track.block_n, track.block_min, min_rise)
        track.block_min, track.block_n, track.block_xsum = math.inf, 0, 0.0

    def _track(self, spec: SeriesSpec, phase: str) -> Track | None:
        key = (spec.name, phase)
        track = self._tracks.get(key)
        if track is not None:
            return track
        phases = self._phases_per_series.get(spec.name, 0)
        if phases >= self.config.max_phases or len(self._tracks) >= _MAX_TRACKS:
            return None
        self._phases_per_series[spec.name] = phases + 1
        track = self._tracks[key] = Track(spec, self._max_floors)
        return track

    # --- deciding ------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Is an evaluation due at this step? (The component calls ``evaluate`` only then.)"""
        return step >= self.next_due_step()

    def next_due_step(self) -> int:
        """The first step at which an evaluation is due."""
        if self._last_check is None:
            return self.config.warmup_steps
        return max(self.config.warmup_steps, self._last_check + self.check_every)

    def evaluate(self, step: int, min_slopes: Mapping[str, float] | None = None) -> list[TrackStatus]:
        """Assess every track; returns the status of each track that has ever fired (changed or not).
        ``min_slopes``: per series name, the growth per step that matters now (default: the series'
        own ``min_bytes_per_step``, else the detector's)."""
        self._last_check = step
        self.rising.clear()
        self._min_slopes, self._lent = min_slopes or {}, {}
        out: list[TrackStatus] = []
        # Dense series first: a count series may be lent the verdict of the bytes it explains.
        for (_, phase), track in sorted(self._tracks.items(), key=lambda item: item[1].spec.sparse):
            status = self._evaluate_track(track, phase, step, self._min_slope(track.spec))
            if status is not None:
                out.append(status)
        return out

    def _min_slope(self, spec: SeriesSpec) -> float:
        return self._min_slopes.get(spec.name) or spec.min_bytes_per_step or self.config.min_bytes_per_step

    def _window_steps(self, track: Track) -> float:
        steps = float(self.config.window_steps)
        if track.resets:
            steps = max(steps, 2.5 * track.longest_rise())
        return min(steps, float(self.config.long_window_steps))

    def _assess(self, xs: Sequence[float], ys: Sequence[float], min_slope: float, p_max: float | None = None,
                ) -> Verdict:
        c = self.config
        return assess(xs, ys, min_slope=min_slope, p_max=p_max or c.p_max, min_points=c.min_points,
                      max_pairs=c.max_pairs)

    def _evaluate_track(self, track: Track, phase: str, step: int, min_slope: float) -> TrackStatus | None:
        c = self.config
        spec = track.spec
        lent = (spec.name, phase) in self._lent  # a count series lent a bytes series' pass (``_lend``)
        if not spec.alarm or (len(track.floors) < c.min_points and not lent):
            return None
        if spec.name in self._held:
            return self._held_status(track, step, self._held[spec.name])
        if track.released and track.state is not None and track.state.active:
            return released_status(track, phase, step, min_slope)
        if (resting := self._resting(track, step)) is not None:
            return resting
        steps = self._window_steps(track)
        outgrown = outgrew(self._tracks, track, phase, step, min_slope=min_slope,
                           half_window=steps / 2, min_points=c.min_points)
        if not lent and not outgrown and explained_at_rest(self._tracks, track, phase, step, self.check_every):
            return dataclasses.replace(track.last_status, changed=False) if track.last_status else None
        # Until the history covers one short window, a rise cannot be told from the first half of a
        # sawtooth (a metric list, an epoch cache) that is about to reset: only a ramp above every floor
        # of a flat start (``knee_verdict``) or a lent verdict is judged before.
        covered = track.floors[-1][0] - track.floors[0][0] >= 0.9 * c.window_steps - c.block
        # The window, and its newer half: a leak that began inside the window fails the ramp test on
        # the whole window (its first half is flat) but passes on the half, so strong leaks are
        # found in about half the window. Sawtooths are safe: once one reset was seen the window
        # spans 2.5 periods, so the half still holds a reset.
        active = track.state is not None and track.state.active
        if not active and not lent:
            # Cheap necessary condition of ``assess`` (slope >= min and floor growth >= 0.4 slope
            # span), on the window and on its half, or of ``assess_knee``: flat series, the common
            # case, skip the O(n²) tests (and the thinning: ``may_move`` tests the thinned window).
            if not track.may_move(step, steps, c.min_points, min_slope, min_slope * c.window_steps):
                return None
            self.rising.add((spec.name, phase))
        track.tested_at = step
        verdict, window_start, hx, hy = self._verdict(track, phase, step, steps, min_slope,
                                                      covered=covered or track.state is not None)
        verdict = past_reset_peaks(verdict, track, active=active, min_length=c.window_steps / 2)
        # The long window can only confirm: a confirmed track skips its O(n²) test (a finding that
        # lasts for days would pay it at every re-test).
        confirmed_long = (verdict.passed and track.state is not LeakState.CONFIRMED
                          and self._passes_long_window(track, step, min_slope))
        previous = track.state
        lender = self._lent.get((spec.name, phase))
        count_pass_or_fail(track, verdict, active, hx, hy, lent_streak=lender[2] if lender is not None else 0)
        state = track.state = next_state(c, track, verdict, active=active, confirmed_long=confirmed_long, step=step,
                                         withdrawn=explainer_active(self._tracks, track, phase, verdict))
        if state is None:
            return None
        if state is not previous and state is LeakState.SUSPECTED:
            track.onset, track.released = None, False  # a new episode
        onset_step, growth = track.onset_and_growth()
        status = track.last_status = TrackStatus(
            spec=spec, phase=phase, state=state, changed=state is not previous, step=step,
            first_step=track.first_step, verdict=verdict, window_start=window_start,
            onset_step=onset_step, growth_bytes=growth, min_slope=min_slope)
        return status

    @staticmethod
    def _held_status(track: Track, step: int, reason: str) -> TrackStatus | None:
        """A held track's last status, kept as it was (never cleared: nothing measures it any more)."""
        last = track.last_status
        if last is None or track.state is None or not track.state.active:
            return None
        return dataclasses.replace(last, changed=False, step=step, held=reason)

    def _resting(self, track: Track, step: int) -> TrackStatus | None:
        """A confirmed leak is re-tested less often: the O(n²) tests on every check of a finding
        that lasts for days would be the detector's main cost. Its last status, unchanged, meanwhile.
        Not after a failed re-test: it is tested at every check until it passes again or is cleared,
        so a leak that stops is cleared as soon as when it was re-tested every check."""
        last = track.last_status
        checks = NEAR_OOM_EVERY if track.spec.name in self.near_oom else CONFIRMED_EVERY
        if (track.state is LeakState.CONFIRMED and last is not None and not track.consecutive_fail
                and step - last.step < checks * self.check_every
                and not explainer_raised_since(self._tracks, track, last.phase, last.step)):
            return dataclasses.replace(last, changed=False)
        return None

    def _verdict(self, track: Track, phase: str, step: int, steps: float, min_slope: float, *, covered: bool,
                 ) -> tuple[Verdict, float, list[float], list[float]]:
        """The verdict on the window (or its newer half, or its ramp since the knee; the window only
        when ``covered``: its history covers a window), the first step it assessed, and the half
        window (whose recent slope tells a finding that still grows from one that stopped)."""
        c = self.config
        xs, ys = track.window(step, steps, c.min_points)
        hx, hy = track.window(step, steps / 2, c.min_points)
        has_half = len(hx) < len(xs)
        verdict = self._assess(xs, ys, min_slope) if covered else UNCOVERED
        if covered and not verdict.passed and has_half:
            # The half window must clear a 1000x stricter p: fewer, more autocorrelated floors make
            # slow wander look like a trend more often than in the whole window.
            half_verdict = self._assess(hx, hy, min_slope, p_max=c.p_max / 1000)
            if half_verdict.passed:
                verdict, xs, ys = half_verdict, hx, hy
        knee_passed = False
        if not verdict.passed:
            at_knee, knee = knee_verdict(c, xs, ys, min_slope)
            if at_knee.passed:
                verdict, xs, ys, knee_passed = at_knee, xs[knee:], ys[knee:], True
        spec = track.spec
        lent = self._lent.get((spec.name, phase))
        if not verdict.passed and lent is not None:
            verdict, xs = lent_verdict(track, lent[0], lent[1], c.max_pairs), [lent[0]]
        if verdict.passed and spec.explained_by:
            past = track.outgrown and verdict.slope.slope >= outgrown_slope(track, min_slope)
            if self._explained(spec, phase, xs[0], verdict, track.streak + 1, outgrown=past):
                verdict = with_reason(verdict, "explained by " + ", ".join(spec.explained_by))
                if track.explained_base is not None:  # measured early in a ramp, the base was too low
                    track.explained_base = max(track.explained_base, verdict.slope.slope)
            elif knee_passed and track.streak == 0:
                # The series that may explain it are seen a scan later (a tensor is counted at the
                # first scan it outlives): a ramp this young is held once, neither a pass nor a fail.
                verdict = with_reason(verdict, "held until what may explain it is seen")
        return verdict, xs[0], hx, hy

    def _passes_long_window(self, track: Track, step: int, min_slope: float) -> bool:
        """Does the long window, once the history covers it, pass too (which confirms at once)?"""
        c = self.config
        if track.floors[0][0] > step - 0.9 * c.long_window_steps:
            return False
        lx, ly = track.window(step, c.long_window_steps, c.min_points)
        return self._assess(lx, ly, min_slope).passed

    def slope_since(self, name: str, phase: str, since: float) -> float | None:
        """Theil-Sen slope of a series' floors from step ``since`` on (None: fewer than 3 points)."""
        track = self._tracks.get((name, phase))
        if track is None:
            return None
        pts = [p for p in track.floors if p[0] >= since]
        if len(pts) < 3:
            return None
        return theil_sen([p[0] for p in pts], [p[1] for p in pts], max_pairs=2000).slope

    def _explained(self, spec: SeriesSpec, phase: str, since: float, verdict: Verdict, streak: int, *,
                   outgrown: bool = False) -> bool:
        """``outgrown``: the growth is well above what it was when a finding that explains it was raised
        (``leak_verdicts.outgrew``): that finding's being active no longer explains it; a series rising
        with it still may."""
        # Families of series (the count series of one device) first, each of them: any of them
        # reporting, or rising with this growth (then lent this verdict).
        families = [self._lend(other[:-1], phase, since, verdict, streak, active_explains=not outgrown)
                    for other in spec.explained_by if other.endswith("*")]
        if any(families):
            return True
        for other in spec.explained_by:
            if other.endswith("*"):
                continue
            track = self._tracks.get((other, phase))
            if track is not None and track.state is not None and track.state.active and not outgrown:
                return True  # already reported as that series' finding
            # Host bytes per tensor byte run well above 1 (allocator overhead, autograd nodes), so a
            # quarter of the slope is enough to say the tensors are the story.
            other_slope = self.slope_since(other, phase, since)
            if other_slope is not None and other_slope >= 0.25 * verdict.slope.slope:
                return True
        return False

    def _lend(self, prefix: str, phase: str, since: float, verdict: Verdict, streak: int, *,
              active_explains: bool = True) -> bool:
        """Is a series of the family ``prefix`` reporting, or rising since ``since`` at its material
        slope and (when its bytes per unit are known) at a quarter of the bytes' slope or more? Those
        rising are lent this passing verdict for this evaluation, with the lender's passes in a row
        (``streak``): sparse (a point per scan, placed one scan late), they would be decided a few
        hundred steps after the bytes they account for."""
        explained = False
        for key, track in self._tracks.items():
            if not key[0].startswith(prefix) or key[1] != phase:
                continue
            explained = explained or (active_explains and track.state is not None and track.state.active)
            newest = track.pending or (track.floors[-1] if track.floors else None)
            before = [y for x, y in track.floors if x <= since][-3:]
            if newest is None or not before or newest[0] <= since:
                continue
            rate = (newest[1] - min(before)) / (newest[0] - since)
            spec = track.spec
            per_unit = 1.0 if spec.unit == "bytes" else spec.unit_bytes
            if rate >= self._min_slope(spec) and (not per_unit or rate * per_unit >= 0.25 * verdict.slope.slope):
                self._lent[key] = (since, verdict.p_increasing, streak)
                explained = True
        return explained
