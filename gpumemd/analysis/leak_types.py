"""The leak detector's vocabulary: states, series specs, its configuration and a track's status.

Apart from the detector so that ``analysis.leak_track`` (the points of one track) and the detector can
both name them without importing each other.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

from gpumemd.analysis.trend import Verdict
from gpumemd.records.device import Device
from gpumemd.records.findings import FINDING_KINDS

# The series named after an allocator or NVML figure spell their device as that figure's metric label
# (the CUDA ordinal); the census's series as torch names it. Series names are in the findings files,
# so each keeps the spelling it was published with.
_BY_LABEL = frozenset({"allocated_bytes", "inactive_split_bytes", "non_pytorch_bytes"})


def _device_labels(measure: str, device: Device) -> str:
    return f"{measure}{{device={device.label if measure in _BY_LABEL else device.name}"


def series_name(measure: str, device: Device | None = None, group: str | None = None) -> str:
    """The one way a series is named: ``allocated_bytes{device=0}``, ``census_bytes{device=cpu}``,
    ``tensors{device=cuda:0,group=float32[4, 8]}``; ``measure`` alone without a device (the host's
    series). Names are for people and files: whoever needs a series' device or group reads its
    ``SeriesSpec``, never the name."""
    if device is None:
        return measure
    labels = _device_labels(measure, device)
    return f"{labels},group={group}}}" if group is not None else f"{labels}}}"


def series_family(measure: str, device: Device) -> str:
    """The pattern of every group's series of ``measure`` on ``device`` (``tensors{device=cpu,*``), as
    ``SeriesSpec.explained_by`` takes it."""
    return f"{_device_labels(measure, device)},*"


class LeakState(enum.Enum):
    """Where one (series, phase) stands."""

    SUSPECTED = "suspected"
    CONFIRMED = "confirmed"
    CLEARED = "cleared"

    @property
    def active(self) -> bool:
        return self is not LeakState.CLEARED


@dataclass(frozen=True, slots=True)
class SeriesSpec:
    """A series the detector watches, and what its growth would mean."""

    name: str  # ``series_name(...)``: "allocated_bytes{device=0}", "host_rss_bytes", "census_bytes{device=cpu}"
    kind: str  # the finding kind when this series fires (census/allocated may be refined to graph_leak)
    device: Device | None = None  # the device whose memory it measures (the host's series: cpu)
    sparse: bool = False  # one point per observation (census) instead of block floors of every step
    alarm: bool = True  # False: tracked for attribution only, never raises a finding itself
    explained_by: tuple[str, ...] = ()  # series whose growth, when as fast, accounts for this one's
    min_bytes_per_step: float | None = None  # this series' own effect size (default: the detector's)
    unit: str = "bytes"  # what the values count: "bytes", "tensors" or "nodes" (autograd nodes chained)
    group: str | None = None  # the group a count series follows ("float32[4, 8]")
    row_bytes: int = 0  # a growing tensor's series: bytes per row of its leading dimension (0: not one)
    unit_bytes: float = 0.0  # a count series: bytes per tensor counted (0: not known: nodes, graph-keeping tensors)

    def __post_init__(self) -> None:
        if self.kind not in FINDING_KINDS:
            raise ValueError(f"SeriesSpec {self.name!r}: kind {self.kind!r} is not one of {FINDING_KINDS}")


MIN_WINDOW_STEPS = 20
"""The shortest short window: ``Config.leak_window_steps`` is checked against it too (one bound)."""


@dataclass(frozen=True, slots=True)
class DetectorConfig:
    """The leak detector's settings. The defaults here are the product's: ``Config``'s ``leak_*_steps``
    options take theirs from these fields (``detector_default``), so each is written once."""

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
            ("window_steps", self.window_steps >= MIN_WINDOW_STEPS, f">= {MIN_WINDOW_STEPS}"),
            ("long_window_factor", self.long_window_factor >= 1, ">= 1"),
            ("check_every_steps", self.check_every_steps >= 1, ">= 1"),
            ("p_max", 0 < self.p_max < 1, "in (0, 1)"),
            ("min_points", self.min_points >= 4, ">= 4"),
        ]
        for name, ok, accepted in checks:
            if not ok:
                raise ValueError(f"DetectorConfig.{name}={getattr(self, name)!r} is not valid: expected {accepted}")

    @staticmethod
    def default(name: str) -> Any:
        """A field's default (``Config`` reads its ``leak_*_steps`` defaults here)."""
        return next(f.default for f in dataclasses.fields(DetectorConfig) if f.name == name)

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
    state: LeakState | None  # None: never fired
    changed: bool  # the state changed at this evaluation
    step: int
    first_step: int | None  # when the current episode was first raised
    verdict: Verdict  # the short window's (or the long one's when it confirmed)
    window_start: float  # first step in the assessed window
    onset_step: int | None
    growth_bytes: float  # floor now minus floor at onset (in the series' unit)
    min_slope: float = 0.0  # the threshold this evaluation used
    held: str | None = None  # why the series is no longer judged (its counter hit a cap): the state is kept

    @property
    def state_name(self) -> str | None:
        return self.state.value if self.state is not None else None
