"""Peak CPU tensor memory of one call, from the profiler's allocator events.

There is no ``max_memory_allocated`` for CPU tensors. ``torch.profiler`` with
``profile_memory=True`` records every allocation and free of torch's CPU allocator as a
``[memory]`` event carrying the signed byte delta; a running sum over them, in order, is the
tensor memory allocated since the profiler started, and its maximum is the call's peak.
Allocations made before the call (the model's parameters) are not included.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from gpumemd.probes.planning.native_stderr import native_stderr_filtered


@dataclass(frozen=True, slots=True)
class CpuPeak:
    peak_bytes: int  # highest running total during the call, above what was live when it started
    net_bytes: int  # still allocated when the call returned (e.g. lazily created optimizer state)


def measure_cpu_peak(fn: Callable[[], Any]) -> tuple[Any, CpuPeak]:
    """Run ``fn()`` under the profiler; return its result and the measured peak.

    Exceptions from ``fn`` propagate unchanged (no measurement is returned then).
    """
    with memory_profile() as prof:
        result = fn()
    return result, peak_from_profiler(prof)


@contextmanager
def memory_profile() -> Iterator[Any]:
    """``torch.profiler.profile(profile_memory=True)`` on CPU, without Kineto's start/stop lines on
    stderr (only the profiler's own start and stop are filtered: the block runs with stderr as is)."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with native_stderr_filtered():
        prof.__enter__()
    try:
        yield prof
    finally:
        with native_stderr_filtered():
            prof.__exit__(None, None, None)


def peak_from_profiler(prof: Any) -> CpuPeak:
    """The CPU allocator events of a finished ``torch.profiler.profile(profile_memory=True)``.

    Read from the raw Kineto results: ``prof.events()`` folds allocations made inside an operator
    into that operator's totals and keeps only the others as ``[memory]`` events, which loses the
    order needed for a running peak.
    """
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if results is None:
        raise RuntimeError("this torch's profiler exposes no Kineto results; CPU peaks cannot be measured")
    return peak_from_deltas(
        (int(e.start_ns()), int(e.nbytes()))
        for e in results.events()
        if e.name() == "[memory]" and str(e.device_type()).endswith("CPU")
    )


def peak_from_deltas(deltas: Iterable[tuple[int, int]]) -> CpuPeak:
    """Running sum of signed byte deltas in time order (ties keep their order); pure."""
    ordered = sorted((t, i, d) for i, (t, d) in enumerate(deltas))
    running = peak = 0
    for _, _, delta in ordered:
        running += delta
        peak = max(peak, running)
    return CpuPeak(peak_bytes=peak, net_bytes=running)
