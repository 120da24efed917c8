"""One training step as the agent recorded it, and the agent's published state."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpumemd.records.samples import AllocatorSample, HostSample, NvmlDeviceSample

if TYPE_CHECKING:
    from gpumemd.records.census import Census
    from gpumemd.records.findings import Finding
    from gpumemd.records.phases import PhaseBreakdown


@dataclass(frozen=True, slots=True)
class StepRecord:
    """The memory picture at the end of one training step (after ``optimizer.step()``).

    ``duration_s`` is wall time since the previous step end (None for the first step).
    ``phase`` is the label set with ``gpumemd.phase(...)`` ("train" by default).
    """

    step: int
    wall_time: float
    duration_s: float | None
    allocator: tuple[AllocatorSample, ...] = ()
    host: HostSample | None = None
    nvml: tuple[NvmlDeviceSample, ...] = ()
    phase: str = "train"
    census_total_bytes: int | None = None  # filled on steps where a census ran

    def allocator_for(self, device: int) -> AllocatorSample | None:
        for sample in self.allocator:
            if sample.device == device:
                return sample
        return None


@dataclass(frozen=True, slots=True)
class Identity:
    """Who this process is in its job: used in labels, ports, log lines and file names."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    hostname: str = ""
    pid: int = 0
    source: str = "default"  # "torch.distributed", "torchrun", "slurm", "openmpi" or "default"


@dataclass(frozen=True, slots=True)
class Overhead:
    """The agent's own cost on the training thread, and its share of wall time since attach."""

    training_thread_seconds_total: float = 0.0  # everything the agent did inside the job's thread
    census_seconds_total: float = 0.0  # the part of it spent in tensor censuses
    sampler_seconds_total: float = 0.0  # background thread time (not on the training thread)
    wall_seconds: float = 0.0
    steps: int = 0

    @property
    def ratio(self) -> float:
        """Training-thread seconds spent in the agent per wall second since attach (0..1)."""
        if self.wall_seconds <= 0:
            return 0.0
        return min(1.0, self.training_thread_seconds_total / self.wall_seconds)

    @property
    def seconds_per_step(self) -> float:
        return self.training_thread_seconds_total / self.steps if self.steps else 0.0


@dataclass(frozen=True, slots=True)
class AgentState:
    """The latest immutable picture, swapped atomically by the agent; outputs only read it.

    A Prometheus scrape or a report writer reads one ``AgentState`` and never takes a lock the
    training thread waits on.
    """

    identity: Identity
    attached_at: float
    updated_at: float
    step: int | None = None
    steps_total: int = 0
    last_step: StepRecord | None = None
    allocator: tuple[AllocatorSample, ...] = ()
    nvml: tuple[NvmlDeviceSample, ...] = ()
    host: HostSample | None = None
    census: Census | None = None
    censuses_total: int = 0
    findings: tuple[Finding, ...] = ()
    reports: tuple[str, ...] = ()
    ooms_total: int = 0
    phases: PhaseBreakdown | None = None
    phase: str = "train"
    overhead: Overhead = field(default_factory=Overhead)
    probe_errors: Mapping[str, int] = field(default_factory=dict)
    probes_available: Mapping[str, bool] = field(default_factory=dict)
