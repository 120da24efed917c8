"""The leak detector: named per-step series in, state changes out (pure: no torch, no I/O, no clock).

How it decides (see ``analysis.trend`` for the statistics and LEAK_DETECTION.md for the evidence):

1. Warm-up: samples before ``warmup_steps`` are ignored (optimizer state appears at step 1,
   compile/cuDNN workspaces on the first shapes, the first eval and checkpoint).
2. Phases: each (series, phase) pair is its own track, so eval steps are compared with eval steps
   and never make the training baseline look like it grows.
3. Block floors: the minimum of every ``block`` samples (dense series); sparse series such as the
   census give one point per census (the minimum of it and the previous census).
4. Every ``check_every_steps`` the short window (``window_steps``, widened to 2.5 reset periods
   once the track has shown sawtooth resets) and, when the history covers it, the long window
   (``long_window_factor`` x) are assessed: Mann-Kendall p, Theil-Sen lower bound >= the effect
   size, floor growth, ramp consistency.
5. States: a short pass -> ``suspected``; a long pass or ``confirm_after`` short passes in a row ->
   ``confirmed``; ``clear_after`` failures in a row -> ``cleared``. Only state changes are reported.
6. A series may be "explained by" others (host RSS by the census of CPU tensors): when they grow at
   least half as fast over the same window, the growth is theirs and the series does not fire.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpumemd.analysis.trend import Verdict, assess, cusum_onset, floor_growth, theil_sen
from gpumemd.analysis.units import format_bytes
from gpumemd.records.census import GroupDelta
from gpumemd.records.findings import FINDING_KINDS, Culprit, Finding

_MAX_TRACKS = 256  # bounded: a week-long job must not grow the detector (series x phases)
_MAX_RESETS = 8
_MAX_WINDOW_POINTS = 64  # points per assessed window (O(n²) rank test): ~5 ms worst case in pure Python


@dataclass(frozen=True, slots=True)
class SeriesSpec:
    """A series the detector watches, and what its growth would mean."""

    name: str  # e.g. "allocated_bytes{device=0}", "host_rss_bytes", "census_bytes{device=cpu}"
    kind: str  # the finding kind when this series fires (census/allocated may be refined to graph_leak)
    device: int | None = None
    sparse: bool = False  # one point per observation (census) instead of block floors of every step
    alarm: bool = True  # False: tracked for attribution only, never raises a finding itself
    explained_by: tuple[str, ...] = ()  # series whose growth, when as fast, accounts for this one's
    min_bytes_per_step: float | None = None  # this series' own effect size (default: the detector's)

    def __post_init__(self) -> None:
        if self.kind not in FINDING_KINDS:
            raise ValueError(f"SeriesSpec {self.name!r}: kind {self.kind!r} is not one of {FINDING_KINDS}")


@dataclass(frozen=True, slots=True)
class DetectorConfig:
    min_bytes_per_step: float = 256 * 1024
    warmup_steps: int = 50
    window_steps: int = 500
    long_window_factor: int = 5
    check_every_steps: int = 50
    p_max: float = 1e-3
    confirm_after: int = 3
    clear_after: int = 3
    min_points: int = 8
    max_phases: int = 4  # per series; steps of further phases are ignored
    max_pairs: int = 4_000  # Theil-Sen pairs per window (subsampled above)

    def __post_init__(self) -> None:
        checks = [
            ("min_bytes_per_step", self.min_bytes_per_step > 0, "> 0"),
            ("warmup_steps", self.warmup_steps >= 0, ">= 0"),
            ("window_steps", self.window_steps >= 8, ">= 8"),
            ("long_window_factor", self.long_window_factor >= 1, ">= 1"),
            ("check_every_steps", self.check_every_steps >= 1, ">= 1"),
            ("p_max", 0 < self.p_max < 1, "in (0, 1)"),
            ("min_points", self.min_points >= 4, ">= 4"),
        ]
        for name, ok, accepted in checks:
            if not ok:
                raise ValueError(f"DetectorConfig.{name}={getattr(self, name)!r} is not valid: expected {accepted}")

    @property
    def block(self) -> int:
        """Samples per floor for dense series: about 50 floors per short window (never below 1)."""
        return max(1, round(self.window_steps / 50))

    @property
    def long_window_steps(self) -> int:
        return self.window_steps * self.long_window_factor


@dataclass(frozen=True, slots=True)
class TrackStatus:
    """One (series, phase) after an evaluation: its state and the evidence behind it."""

    spec: SeriesSpec
    phase: str
    state: str | None  # None (never fired), "suspected", "confirmed" or "cleared"
    changed: bool  # the state changed at this evaluation
    step: int
    first_step: int | None  # when the current episode was first raised
    verdict: Verdict  # the short window's (or the long one's when it confirmed)
    window_start: float  # first step in the assessed window
    onset_step: int | None
    growth_bytes: float  # floor now minus floor at onset


class _Track:
    __slots__ = (
        "block_min", "block_n", "block_xsum", "consecutive_fail", "consecutive_pass", "first_step",
        "floors", "peak", "previous", "resets", "spec", "state", "trough", "trough_x",
    )

    def __init__(self, spec: SeriesSpec, max_floors: int) -> None:
        self.spec = spec
        self.floors: deque[tuple[float, float]] = deque(maxlen=max_floors)
        self.block_min = math.inf
        self.block_n = 0
        self.block_xsum = 0.0
        self.previous = math.inf  # sparse series: the previous observation
        self.state: str | None = None
        self.first_step: int | None = None
        self.consecutive_pass = 0
        self.consecutive_fail = 0
        # sawtooth bookkeeping: trough/peak since the last reset, and the lengths of past rises
        self.trough = math.inf
        self.trough_x = 0.0
        self.peak = -math.inf
        self.resets: deque[float] = deque(maxlen=_MAX_RESETS)

    def add_floor(self, x: float, y: float, min_rise: float) -> None:
        self.floors.append((x, y))
        rise = self.peak - self.trough
        if rise >= min_rise and y <= self.trough + 0.5 * rise:
            # The floor fell back most of the way: an accumulation that resets (metric list,
            # epoch cache, gc of reference cycles). Remember how long it rose.
            self.resets.append(max(x - self.trough_x, 1.0))
            self.trough, self.trough_x, self.peak = y, x, y
            return
        if y < self.trough:
            self.trough, self.trough_x = y, x
        self.peak = max(self.peak, y)

    def window(self, now: int, steps: float, min_points: int) -> tuple[list[float], list[float]]:
        lo = now - steps
        pts = [p for p in self.floors if p[0] >= lo]
        if len(pts) < min_points:
            pts = list(self.floors)[-min_points:]
        return _thin([p[0] for p in pts], [p[1] for p in pts])


def _thin(xs: list[float], ys: list[float], max_points: int = _MAX_WINDOW_POINTS) -> tuple[list[float], list[float]]:
    """Floors of floors: merge neighbours (min y, mean x) so a window never has more than
    ``max_points`` points and the O(n²) tests stay cheap on long windows."""
    n = len(xs)
    if n <= max_points:
        return xs, ys
    k = math.ceil(n / max_points)
    start = n % k  # keep the newest points aligned; drop the oldest remainder
    out_x, out_y = [], []
    for i in range(start, n, k):
        out_x.append(sum(xs[i : i + k]) / k)
        out_y.append(min(ys[i : i + k]))
    return out_x, out_y


class LeakDetector:
    """Feed ``observe`` every step (cheap: O(1) per value); ``evaluate`` every check interval."""

    def __init__(self, config: DetectorConfig) -> None:
        self.config = config
        self._specs: dict[str, SeriesSpec] = {}
        self._tracks: dict[tuple[str, str], _Track] = {}
        self._last_check: int | None = None
        self._phases_per_series: dict[str, int] = {}
        # (series, phase) of quiet tracks whose floor rose enough at the last evaluation to be
        # assessed in full: a component may start collecting culprit evidence before they fire.
        self.rising: set[tuple[str, str]] = set()
        long_points = math.ceil(config.long_window_steps / config.block) + 2 * config.min_points
        self._max_floors = max(64, min(4096, long_points))

    # --- feeding -------------------------------------------------------------------------------

    def add_series(self, spec: SeriesSpec) -> None:
        """Declare a series (idempotent; a changed spec replaces the old one for new tracks)."""
        self._specs[spec.name] = spec

    def series(self) -> list[SeriesSpec]:
        return list(self._specs.values())

    def buffer_ids(self) -> set[int]:
        """ids of the detector's own bounded buffers, so a heap search for growing containers
        never blames them (they fill up over the first long window)."""
        out: set[int] = set()
        for track in self._tracks.values():
            out.update((id(track.floors), id(track.resets)))
        return out

    def observe(self, name: str, step: int, value: float, phase: str = "train") -> None:
        spec = self._specs.get(name)
        if spec is None or step < self.config.warmup_steps or not math.isfinite(value):
            return
        track = self._track(spec, phase)
        if track is None:
            return
        block = 1 if spec.sparse else self.config.block
        if spec.sparse:
            # One point per census, and a census sees whatever the step left alive (this batch's
            # output, its graph): the minimum with the previous census removes such one-off highs
            # while a leak, present in both, only lags by one census.
            value, track.previous = min(value, track.previous), value
        track.block_min = min(track.block_min, value)
        track.block_n += 1
        track.block_xsum += step
        if track.block_n >= block:
            min_rise = self.config.min_bytes_per_step * max(block, 1) * 5
            track.add_floor(track.block_xsum / track.block_n, track.block_min, min_rise)
            track.block_min, track.block_n, track.block_xsum = math.inf, 0, 0.0

    def _track(self, spec: SeriesSpec, phase: str) -> _Track | None:
        key = (spec.name, phase)
        track = self._tracks.get(key)
        if track is not None:
            return track
        phases = self._phases_per_series.get(spec.name, 0)
        if phases >= self.config.max_phases or len(self._tracks) >= _MAX_TRACKS:
            return None
        self._phases_per_series[spec.name] = phases + 1
        track = self._tracks[key] = _Track(spec, self._max_floors)
        return track

    # --- deciding ------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Is an evaluation due at this step? (The component calls ``evaluate`` only then.)"""
        if step < self.config.warmup_steps:
            return False
        return self._last_check is None or step - self._last_check >= self.config.check_every_steps

    def evaluate(self, step: int) -> list[TrackStatus]:
        """Assess every track; returns the status of each track that has ever fired (changed or not)."""
        self._last_check = step
        self.rising.clear()
        out: list[TrackStatus] = []
        for (_name, phase), track in self._tracks.items():
            status = self._evaluate_track(track, phase, step)
            if status is not None:
                out.append(status)
        return out

    def _window_steps(self, track: _Track) -> float:
        steps = float(self.config.window_steps)
        if track.resets:
            steps = max(steps, 2.5 * max(track.resets))
        return min(steps, float(self.config.long_window_steps))

    def _assess(self, xs: Sequence[float], ys: Sequence[float], min_slope: float, p_max: float | None = None,
                ) -> Verdict:
        c = self.config
        return assess(xs, ys, min_slope=min_slope, p_max=p_max or c.p_max, min_points=c.min_points,
                      max_pairs=c.max_pairs)

    def _evaluate_track(self, track: _Track, phase: str, step: int) -> TrackStatus | None:
        c = self.config
        spec = track.spec
        min_slope = spec.min_bytes_per_step or c.min_bytes_per_step
        if not spec.alarm or len(track.floors) < c.min_points:
            return None
        if track.state is None and track.floors[-1][0] - track.floors[0][0] < 0.9 * c.window_steps - c.block:
            # Until the history covers one short window, a rise cannot be told from the first half
            # of a sawtooth (a metric list, an epoch cache) that is about to reset.
            return None
        # The window, and its newer half: a leak that began inside the window fails the ramp test on
        # the whole window (its first half is flat) but passes on the half, so strong leaks are
        # found in about half the window. Sawtooths are safe: once one reset was seen the window
        # spans 2.5 periods, so the half still holds a reset.
        steps = self._window_steps(track)
        xs, ys = track.window(step, steps, c.min_points)
        hx, hy = track.window(step, steps / 2, c.min_points)
        has_half = len(hx) < len(xs)
        if track.state in (None, "cleared"):
            # Cheap necessary condition of ``assess`` (slope >= min and floor growth >= 0.4 slope
            # span): flat series, the common case, skip the O(n²) tests.
            if not any(floor_growth(y) >= 0.4 * min_slope * (x[-1] - x[0]) for x, y in ((xs, ys), (hx, hy))):
                return None
            self.rising.add((spec.name, phase))
        verdict = self._assess(xs, ys, min_slope)
        if not verdict.passed and has_half:
            # The half window must clear a 1000x stricter p: fewer, more autocorrelated floors make
            # slow wander look like a trend more often than in the whole window.
            half_verdict = self._assess(hx, hy, min_slope, p_max=c.p_max / 1000)
            if half_verdict.passed:
                verdict, xs, ys = half_verdict, hx, hy
        if verdict.passed and spec.explained_by and self._explained(spec, phase, xs[0], verdict):
            verdict = _with_reason(verdict, "explained by " + ", ".join(spec.explained_by))
        confirmed_long = False
        if verdict.passed and track.floors[0][0] <= step - 0.9 * c.long_window_steps:
            lx, ly = track.window(step, c.long_window_steps, c.min_points)
            long_verdict = self._assess(lx, ly, min_slope)
            if long_verdict.passed:
                confirmed_long = True
        previous = track.state
        if verdict.passed:
            track.consecutive_pass += 1
            track.consecutive_fail = 0
        elif previous in ("suspected", "confirmed") and verdict.reason == "not a ramp":
            # Significant growth above the effect size that rises in bursts (host RSS grows by heap
            # or arena chunks): not evidence for a new finding, but no evidence that it stopped.
            pass
        else:
            track.consecutive_fail += 1
            track.consecutive_pass = 0
        state = previous
        if verdict.passed:
            if previous in (None, "cleared"):
                state = "suspected"
                track.first_step = step
            if state == "suspected" and (confirmed_long or track.consecutive_pass >= c.confirm_after):
                state = "confirmed"
        elif previous in ("suspected", "confirmed") and track.consecutive_fail >= c.clear_after:
            state = "cleared"
        track.state = state
        if state is None:
            return None
        onset_step, growth = self._onset(track)
        return TrackStatus(
            spec=spec, phase=phase, state=state, changed=state != previous, step=step,
            first_step=track.first_step, verdict=verdict, window_start=xs[0],
            onset_step=onset_step, growth_bytes=growth,
        )

    def slope_since(self, name: str, phase: str, since: float) -> float | None:
        """Theil-Sen slope of a series' floors from step ``since`` on (None: fewer than 3 points)."""
        track = self._tracks.get((name, phase))
        if track is None:
            return None
        pts = [p for p in track.floors if p[0] >= since]
        if len(pts) < 3:
            return None
        return theil_sen([p[0] for p in pts], [p[1] for p in pts], max_pairs=2000).slope

    def _explained(self, spec: SeriesSpec, phase: str, since: float, verdict: Verdict) -> bool:
        for other in spec.explained_by:
            track = self._tracks.get((other, phase))
            if track is not None and track.state in ("suspected", "confirmed"):
                return True  # already reported as that series' finding
            # Host bytes per tensor byte run well above 1 (allocator overhead, autograd nodes), so a
            # quarter of the slope is enough to say the tensors are the story.
            other_slope = self.slope_since(other, phase, since)
            if other_slope is not None and other_slope >= 0.25 * verdict.slope.slope:
                return True
        return False

    def _onset(self, track: _Track) -> tuple[int | None, float]:
        floors = list(track.floors)
        if len(floors) < 3:
            return None, 0.0
        ys = [p[1] for p in floors]
        i = cusum_onset(ys)
        before = min(ys[: i + 1])
        now = min(ys[-max(1, len(ys) // 20):])
        return int(floors[i][0]), max(0.0, now - before)


def _with_reason(v: Verdict, reason: str) -> Verdict:
    return Verdict(False, reason, v.n, v.slope, v.p_increasing, v.growth, v.onset_index)


# --- findings: turning a track status and its culprits into the record users read --------------


def describe_group(delta: GroupDelta) -> str:
    """``float32[64, 256] with grad_fn`` / ``Adam[fc.weight].exp_avg float32[64, 256]``."""
    dtype = delta.dtype.removeprefix("torch.")
    shape = "[" + ", ".join(str(d) for d in delta.shape) + "]"
    text = f"{dtype}{shape}"
    if delta.category == "graph":
        text += " with grad_fn"
    elif delta.category not in ("other",):
        text += f" ({delta.category})"
    if delta.name:
        text = f"{delta.name} {text}"
    return text


def fold_graph_groups(deltas: Iterable[GroupDelta]) -> list[GroupDelta]:
    """Charge tensors that only an autograd graph keeps (category graph, no Python holder: saved
    activations whose wrapper torch preserved) to the held graph tensor that grew in count — the
    loss kept in a list — as its graph bytes: "+1 tensor/step: float32[] with grad_fn, held by list
    `losses`, keeping ~3 MiB/step of autograd graph alive"."""
    deltas = list(deltas)
    kept = [d for d in deltas if _graph_kept(d.category, d.holder) and d.bytes_delta > 0]
    roots = [d for d in deltas if d.category == "graph" and not _graph_kept(d.category, d.holder)
             and d.count_delta > 0]
    if not kept or not roots:
        return deltas
    root = max(roots, key=lambda d: (d.count_delta, d.bytes_delta))
    extra = sum(d.bytes_delta + d.graph_bytes_delta for d in kept)
    folded = dataclasses.replace(root, graph_bytes_delta=root.graph_bytes_delta + extra)
    return [folded, *(d for d in deltas if d is not root and d not in kept)]


def culprits_from_diff(deltas: Iterable[GroupDelta], *, limit: int = 3) -> tuple[Culprit, ...]:
    """The groups that grew most (own bytes plus graph bytes), as culprits."""
    ranked = sorted(
        (d for d in fold_graph_groups(deltas) if d.bytes_delta + d.graph_bytes_delta > 0),
        key=lambda d: (d.bytes_delta + d.graph_bytes_delta, d.count_delta), reverse=True,
    )
    return tuple(
        Culprit(description=describe_group(d), count_delta=d.count_delta, bytes_delta=d.bytes_delta,
                holder=d.holder, graph_bytes_delta=d.graph_bytes_delta, category=d.category)
        for d in ranked[:limit]
    )


_GRAPH_HOLDERS = ("autograd graph of ", "an autograd graph")  # how the census names graph-kept tensors


def _graph_kept(category: str | None, holder: str | None) -> bool:
    return category == "graph" and (holder is None or holder.startswith(_GRAPH_HOLDERS))


def kept_by_graph(c: Culprit) -> bool:
    """Tensors with a grad_fn that no Python object holds: autograd keeps them (saved activations
    whose Python wrapper torch preserved), so their bytes are graph bytes."""
    return _graph_kept(c.category, c.holder)


def refine_kind(kind: str, culprits: Sequence[Culprit]) -> str:
    """A tensor leak whose growth is mostly autograd graph kept alive is a graph leak."""
    if kind != "tensor_leak" or not culprits:
        return kind
    graph = sum(max(0, c.graph_bytes_delta) + (max(0, c.bytes_delta) if kept_by_graph(c) else 0)
                for c in culprits)
    own = sum(max(0, c.bytes_delta) for c in culprits if not kept_by_graph(c))
    return "graph_leak" if graph > own else kind


def culprit_sentence(c: Culprit, steps: float) -> str:
    """'+1 tensor/step: float32[] with grad_fn, held by list `losses` (...), keeping ~3.1 MiB/step of
    autograd graph alive' — rates over the ``steps`` the census diff spans."""
    steps = max(steps, 1.0)
    rate = c.count_delta / steps
    if c.count_delta <= 0:
        head = f"+0 {c.noun}s"
    elif rate >= 0.5:
        n = max(1, round(rate))
        head = f"+{n} {c.noun}{'s' if n != 1 else ''}/step"
    else:
        head = f"+1 {c.noun} every {steps / c.count_delta:.0f} steps"
    if kept_by_graph(c):
        # saved activations: what matters is the graph that keeps them and who holds its root
        holder = c.holder or "an autograd graph (its root's holder was not found)"
        return (f"{head.replace(c.noun, 'saved ' + c.noun, 1)}: {c.description} "
                f"(~{format_bytes(c.bytes_delta / steps)}/step), kept alive by {_the(holder)}")
    text = f"{head}: {c.description}"
    if c.bytes_delta < c.graph_bytes_delta:
        pass  # the graph is the story; the tensors' own bytes would only distract
    elif c.bytes_delta > 0 and c.count_delta > 0:
        text += f" (~{format_bytes(c.bytes_delta / steps)}/step)"
    elif c.bytes_delta > 0:
        text += f" growing ~{format_bytes(c.bytes_delta / steps)}/step"
    text += f", held by {c.holder}" if c.holder else ", holder not found"
    if c.graph_bytes_delta / steps >= 1:
        text += f", keeping ~{format_bytes(c.graph_bytes_delta / steps)}/step of autograd graph alive"
    return text


def _the(holder: str) -> str:
    return "the " + holder if holder.startswith("autograd graph") else holder


_KIND_WORDS = {
    "tensor_leak": "tensor leak",
    "graph_leak": "retained autograd graph",
    "fragmentation": "allocator fragmentation",
    "non_pytorch": "memory outside PyTorch's allocator",
    "host_leak": "host memory leak",
}


def build_finding(
    status: TrackStatus, *, kind: str | None = None, culprits: Sequence[Culprit] = (),
    culprit_steps: float = 0.0, headroom_bytes: float | None = None, sites: Sequence[str] = (),
) -> Finding:
    """The user-facing record for one track status; ``summary`` is the one-line sentence."""
    v = status.verdict
    kind = kind or refine_kind(status.spec.kind, culprits)
    slope = v.slope.slope
    steps_to_oom = None
    if headroom_bytes is not None and slope > 0 and status.state != "cleared":
        steps_to_oom = max(0.0, headroom_bytes) / slope
    parts = [f"{_KIND_WORDS.get(kind, kind)} {status.state} on {status.spec.name}"]
    if status.phase != "train":
        parts[0] += f" (phase {status.phase})"
    if status.state == "cleared":
        parts.append(f"growth stopped ({v.reason})")
    else:
        low = v.slope.low if math.isfinite(v.slope.low) else 0.0
        parts.append(f"+{format_bytes(slope)}/step (>= {format_bytes(low)}/step at 95%)")
        if status.onset_step is not None:
            parts.append(f"since step {status.onset_step}")
        parts.append(f"+{format_bytes(status.growth_bytes)} so far")
        if steps_to_oom is not None:
            parts.append(f"out of memory in ~{steps_to_oom:,.0f} steps")
    summary = ", ".join(parts)
    if culprits and status.state != "cleared":
        summary += "; " + culprit_sentence(culprits[0], culprit_steps)
        if len(culprits) > 1:
            summary += f" (+{len(culprits) - 1} more group{'s' if len(culprits) > 2 else ''})"
    if sites and status.state != "cleared":
        summary += "; allocated at " + sites[0]
    return Finding(
        kind=kind,
        series=status.spec.name,
        state=status.state or "suspected",
        slope_bytes_per_step=slope,
        slope_low=v.slope.low,
        slope_high=v.slope.high,
        onset_step=status.onset_step,
        growth_bytes=int(status.growth_bytes),
        steps_to_oom=steps_to_oom,
        first_step=status.first_step if status.first_step is not None else status.step,
        updated_step=status.step,
        summary=summary,
        device=status.spec.device,
        culprits=tuple(culprits),
        phase=status.phase,
        p_value=v.p_increasing,
        sites=tuple(sites),
    )


def merge_findings(previous: Iterable[Finding], updates: Mapping[tuple[str, str], Finding]) -> tuple[Finding, ...]:
    """Replace findings of the same (series, phase) by their update; keep the rest in order."""
    out: list[Finding] = []
    seen: set[tuple[str, str]] = set()
    for f in previous:
        key = (f.series, f.phase)
        out.append(updates.get(key, f))
        seen.add(key)
    out.extend(f for key, f in updates.items() if key not in seen)
    return tuple(out)
