"""What the probes read: one allocator, NVML or host reading, decided on by nobody yet."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpumemd.records.device import Device
from gpumemd.records.plain import AS_ORDINAL, IN_MEMORY_ONLY


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
    # Reserved by private pools (CUDA graphs: torch.compile's "reduce-overhead", MemPool), summed over
    # ``reserved_bytes_by_private_pools`` (torch 2.13+; None where torch does not report it). Blocks
    # allocated there count in ``allocated_bytes`` too: a pool growing with each recorded graph.
    private_pool_reserved_bytes: int | None = None

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
    # Wall time of the reading: the sampler reads NVML every sample_interval_s, so a step end pairs
    # its allocator reading with one up to that old (``records.step.nvml_paired``). Not in the files.
    read_at: float | None = field(default=None, metadata=IN_MEMORY_ONLY)


@dataclass(frozen=True, slots=True)
class HostSample:
    """This process and its host."""

    rss_bytes: int
    available_bytes: int | None = None
    total_bytes: int | None = None
    pinned_bytes: int | None = None  # torch's pinned-host caching allocator, when CUDA reports it
