"""What a sampled step end reads: the allocator, the host's RSS and, every few steps, the job's child
processes, made into the step's record with the sampler's last NVML reading where it pairs.

Every read here runs on the training thread right after a step of compute, where one syscall costs
~20 µs: each is one kept-open ``pread`` (``probes.process.host``, ``probes.process.workers``) or the allocator's own
statistics, and the workers are read only every ``WORKERS_EVERY`` steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

from gpumemd.log_once import log_once
from gpumemd.records.samples import AllocatorSample, HostSample, WorkersSample
from gpumemd.records.step import AgentState, StepRecord, nvml_paired

if TYPE_CHECKING:
    from gpumemd.probes.device.allocator import AllocatorProbe
    from gpumemd.probes.process.host import HostProbe
    from gpumemd.probes.process.workers import WorkersProbe

log = logging.getLogger("gpumemd")

WORKERS_EVERY = 10
"""Steps between two reads of the workers' RSS on the training thread (one floor block of the detector)."""
WORKERS_QUICK_EVERY = 50
"""... and on quick step ends (``StepEnds.end``, fast loops), where a read costs more than the steps it
stands for: one point per five floor blocks, as many as a survivor scan's count series gets."""
WORKERS_IDLE_EVERY = 100
"""The same while the last read found no child process: a job without DataLoader workers pays one read
per 100 steps, and new workers are seen within 100 steps (or ``WORKERS_IDLE_S``)."""
WORKERS_IDLE_S = 1.0
"""... and at least this many seconds apart: on a fast loop 100 steps are ~50 ms, and a read that finds no
child costs ~45 µs after a step of compute (0.45 µs a step at 0.5 ms steps, measured here). Workers are
then seen within a second; each one's growth is measured from when it was first seen."""


class QuickReading(NamedTuple):
    """What a quick sampled step end read (``StepReader.quick``); ``samples`` is the agent's count of
    sampled step ends then."""

    step: int
    duration: float | None
    steps: int
    phase: str
    wall: float
    raw: tuple[tuple[int, Any], ...]
    resident: tuple[int, int | None] | None  # RSS, and the file and shared pages of it (``HostProbe.resident``)
    samples: int
    workers: WorkersSample | None = None


class StepReader:
    """Reads the probes into step records; ``published`` gives the last published state, whose
    sampler readings (NVML, the host's limits) a record carries."""

    def __init__(self, *, allocator: AllocatorProbe, host: HostProbe, workers: WorkersProbe | None,
                 published: Callable[[], AgentState | None], wall_clock: Callable[[], float],
                 reset_peaks: bool) -> None:
        self._allocator = allocator
        self._host = host
        self._workers = workers
        self._published = published
        self._wall = wall_clock
        self._reset_peaks = reset_peaks
        self._workers_read_at: int | None = None  # the step of the last per-step read of the workers
        self._workers_read_wall = float("-inf")  # ... and its wall time
        self._host_made: HostSample | None = None  # the newest record's host reading (``_made``)
        self._host_base: HostSample | None = None  # ... and the sampler's reading it was made from
        self._no_workers = False  # the last read found no child process: WORKERS_IDLE_EVERY and WORKERS_IDLE_S

    def record(self, number: int, duration: float | None, steps: int, phase: str) -> StepRecord:
        """The sampled step's record: the allocator and the host's RSS read now, NVML as last sampled
        where that reading pairs with this allocator reading (``nvml_paired``)."""
        allocator = self._allocator.read()
        if self._reset_peaks and allocator:
            _reset_peaks(sample.device.name for sample in allocator)
        wall = self._wall()
        reading = QuickReading(number, duration, steps, phase, wall, (), self._host.resident(), 0,
                               self._read_workers(number, wall, WORKERS_EVERY))
        return self._made(reading, allocator)

    def quick(self, number: int, duration: float | None, steps: int, phase: str, samples: int) -> QuickReading:
        """A quick sampled step end's reads (``StepEnds.end``): the allocator's statistics as torch
        returns them and the host's RSS, now; ``complete`` makes the record of them later."""
        raw = self._allocator.read_raw()
        if self._reset_peaks and raw:
            _reset_peaks(f"cuda:{device}" for device, _ in raw)
        wall = self._wall()
        return QuickReading(number, duration, steps, phase, wall, raw, self._host.resident(), samples,
                            self._read_workers(number, wall, WORKERS_QUICK_EVERY))

    def complete(self, reading: QuickReading) -> StepRecord:
        """The record ``record`` would have made at a quick step end, from what it read then."""
        return self._made(reading, self._allocator.parse_raw(reading.raw) if reading.raw else ())

    def _made(self, reading: QuickReading, allocator: tuple[AllocatorSample, ...]) -> StepRecord:
        resident, wall = reading.resident, reading.wall
        previous = self._published()
        assert previous is not None
        base = previous.host
        host = self._host_made
        if host is None or self._host_base is not base or (host.rss_bytes, host.file_bytes) != resident:
            # A new reading only when the RSS moved (in a steady loop it is the same page count at nearly
            # every sample, and a frozen record costs ~2.6 µs to build here): it is a value, so records share it.
            host = _with_rss(base, resident)
            self._host_made, self._host_base = host, base
        nvml = nvml_paired(previous.nvml, at=wall, read_with=previous.allocator, now=allocator) if previous.nvml else ()
        return StepRecord(step=reading.step, wall_time=wall, duration_s=reading.duration, allocator=allocator,
                          host=host, nvml=nvml, phase=reading.phase, steps=reading.steps, workers=reading.workers)

    def now(self, step: int, steps: int, phase: str) -> StepRecord | None:
        """The probes read now, as a record of the step that is running, kept nowhere (an OOM report's
        timeline ends with it): the host's limits too, as one the job set since the last sample binds."""
        base = self._published()
        if base is None:
            return None
        host = self._host.read()
        if host is None or host.available_bytes is None:
            resident = (host.rss_bytes, host.file_bytes) if host is not None else self._host.resident()
            host = _with_rss(base.host, resident)
        return StepRecord(step=step, wall_time=self._wall(), duration_s=None, allocator=self._allocator.read(),
                          host=host, nvml=base.nvml, phase=phase, steps=steps)

    def _read_workers(self, number: int, wall: float, every: int) -> WorkersSample | None:
        """The job's child processes' RSS, every ``every`` steps, or ``WORKERS_IDLE_EVERY`` steps and
        ``WORKERS_IDLE_S`` while it has none (a few preads, each ~20 µs after a step of compute)."""
        last = self._workers_read_at
        every = WORKERS_IDLE_EVERY if self._no_workers else every
        if self._workers is None or (last is not None and 0 <= number - last < every):
            return None
        if self._no_workers and wall - self._workers_read_wall < WORKERS_IDLE_S:
            return None
        self._workers_read_at, self._workers_read_wall = number, wall
        sample = self._workers.rss()
        self._no_workers = sample is not None and not sample.workers
        return sample


def _with_rss(base: HostSample | None, resident: tuple[int, int | None] | None) -> HostSample | None:
    """The host reading at ``resident`` (RSS, and its file and shared pages): the sampler's fuller reading
    ``base`` keeps its available, total and pinned figures."""
    if resident is None:
        return None
    rss, file_bytes = resident
    return base.with_rss(rss, file_bytes) if base is not None else HostSample(rss_bytes=rss, file_bytes=file_bytes)


def _reset_peaks(devices: Iterable[str]) -> None:
    import torch

    for device in devices:
        try:
            torch.cuda.reset_peak_memory_stats(device)
        except (RuntimeError, AttributeError) as exc:
            log_once("reset_peak", "gpumemd: could not reset peak stats (%s)", exc)
