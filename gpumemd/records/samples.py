"""What the probes read: one allocator, NVML or host reading, decided on by nobody yet."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpumemd.records.device import Device
from gpumemd.records.plain import AS_ORDINAL


@dataclass(frozen=True, slots=True)
class AllocatorSample:
    """One device's caching-allocator statistics (``torch.cuda.memory_stats``), in bytes or counts.

    Every field but ``device`` is optional: older torch versions lack some keys, and the
    ``cudaMallocAsync`` backend fills only allocated/reserved/active. ``None`` means "not reported",
    never 0.
    """

    device: Device = field(metadata=AS_ORDINAL)  # a CUDA device
    allocated_bytes: int | None = None
    allocated_peak_bytes: int | None = None
    reserved_bytes: int | None = None
    reserved_peak_bytes: int | None = None
    active_bytes: int | None = None
    active_peak_bytes: int | None = None
    inactive_split_bytes: int | None = None
    requested_bytes: int | None = None
    num_alloc_retries: int | None = None
    num_ooms: int | None = None
    num_oom_rejections: int | None = None  # allocations refused up front by the per-process cap (2.13+)
    num_device_alloc: int | None = None
    num_device_free: int | None = None
    segment_count: int | None = None
    # The per-process cap (``torch.cuda.set_per_process_memory_fraction``): the allocator refuses to
    # reserve past ``cap_bytes`` whatever the device has free. ``memory_fraction`` is None when it was
    # not read (older torch, fake probes), 1.0 with no cap; ``cap_bytes`` is None unless a cap is set.
    memory_fraction: float | None = None
    cap_bytes: int | None = None

    @property
    def cached_free_bytes(self) -> int | None:
        """Reserved but unallocated: the allocator's cache (what NVML-only tools mistake for use)."""
        if self.reserved_bytes is None or self.allocated_bytes is None:
            return None
        return self.reserved_bytes - self.allocated_bytes


@dataclass(frozen=True, slots=True)
class NvmlDeviceSample:
    """The driver's view of one device, from NVML (creates no CUDA context)."""

    device: Device = field(metadata=AS_ORDINAL)  # the CUDA device it is, as this process numbers them
    total_bytes: int
    used_bytes: int
    free_bytes: int
    process_used_bytes: int | None = None  # None: NVML could not attribute use to this pid (containers)


@dataclass(frozen=True, slots=True)
class HostSample:
    """This process and its host."""

    rss_bytes: int
    available_bytes: int | None = None
    total_bytes: int | None = None
    pinned_bytes: int | None = None  # torch's pinned-host caching allocator, when CUDA reports it


@dataclass(frozen=True, slots=True)
class WorkerSample:
    """One child process of the job (a DataLoader worker, or any other child)."""

    pid: int
    rss_bytes: int
    uss_bytes: int | None = None  # its own pages (copy-on-read shows here); None: not read (the per-step read)
    pss_bytes: int | None = None  # its proportional share of the pages it shares with the job


@dataclass(frozen=True, slots=True)
class WorkersSample:
    """The job's child processes at one reading."""

    workers: tuple[WorkerSample, ...] = ()

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(w.pid for w in self.workers)

    @property
    def rss_bytes(self) -> int:
        return sum(w.rss_bytes for w in self.workers)

    @property
    def pss_bytes(self) -> int | None:
        """Their proportional share (what they add to the host's use without counting the pages
        they share with the job twice); None unless every worker's was read."""
        if not self.workers or any(w.pss_bytes is None for w in self.workers):
            return None
        return sum(w.pss_bytes or 0 for w in self.workers)

    @property
    def uss_bytes(self) -> int | None:
        if not self.workers or any(w.uss_bytes is None for w in self.workers):
            return None
        return sum(w.uss_bytes or 0 for w in self.workers)
