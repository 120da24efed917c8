"""Leak findings: what the detector concluded about one series."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from gpumemd.records.device import Device
from gpumemd.records.plain import AS_ORDINAL, IN_MEMORY_ONLY

FINDING_KINDS: tuple[str, ...] = ("tensor_leak", "graph_leak", "fragmentation", "non_pytorch", "host_leak")
FINDING_STATES: tuple[str, ...] = ("suspected", "confirmed", "cleared")


@dataclass(frozen=True, slots=True)
class Culprit:
    """One group that grew over the finding's window, with who holds a sample of it."""

    description: str  # e.g. "float32[] with grad_fn"
    count_delta: int
    bytes_delta: int
    holder: str | None = None
    graph_bytes_delta: int = 0
    noun: str = "tensor"  # what count_delta counts: "tensor", or e.g. "bytes object" for host leaks
    category: str | None = None  # the census category of the group ("graph": it has a live grad_fn)


@dataclass(frozen=True, slots=True)
class Finding:
    """What the leak detector concluded about one series (in one phase): ``headline`` is the line a
    person reads at a state change, ``summary`` the whole sentence the files and reports keep."""

    kind: str
    series: str  # e.g. "allocated_bytes{device=0}", "host_rss_bytes"
    state: str
    slope_bytes_per_step: float
    slope_low: float
    slope_high: float
    onset_step: int | None
    growth_bytes: int
    steps_to_oom: float | None
    first_step: int  # the step at which the finding was first raised
    updated_step: int
    summary: str  # the whole sentence: rate, bounds, onset, growth, groups, holder with sizes, sites
    # The device whose memory the series measures (the host's series: cpu); None: not said. Written
    # as the CUDA ordinal (null off CUDA), as findings always were.
    device: Device | None = field(default=None, metadata=AS_ORDINAL)
    culprits: tuple[Culprit, ...] = ()
    phase: str = "train"  # the phase whose steps the series was compared across
    p_value: float | None = None  # Mann-Kendall one-sided p of the window that decided
    sites: tuple[str, ...] = ()  # CUDA allocation sites (first user frame) that grew, largest first
    tensors_per_step: float | None = None  # count evidence: long-lived tensors gained per step
    hours_to_oom: float | None = None  # steps_to_oom at the job's measured step rate
    # Host RSS's growth a CPU tensor finding states beside its tensors' own bytes (the heap they pin
    # can grow far faster): its out-of-memory projection is made from it. None: not stated.
    host_bytes_per_step: float | None = None
    severity: str | None = None  # "critical" (out of memory within a day), "warning", or None when cleared
    # The line logged at a state change (kind, rate, holder, onset, time to out-of-memory in at
    # most 200 characters); "" in findings written before it was.
    headline: str = ""
    # Where the job adds to the top culprit's holder, as its path says it ("appended at
    # train.py:57"): "train.py:57"; None when not found (or no holder).
    added_at: str | None = None
    # The group a count series follows ("float32[4, 8]"), for the OOM report to find it in a census;
    # not written (it is in the series name, which the files keep).
    group: str | None = field(default=None, metadata=IN_MEMORY_ONLY)


def live_worst_first(findings: Iterable[Finding]) -> list[Finding]:
    """The findings not cleared, the worst first: confirmed before suspected, then the fastest."""
    return sorted((f for f in findings if f.state != "cleared"),
                  key=lambda f: (f.state == "confirmed", f.slope_bytes_per_step), reverse=True)
