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


HOST_LIMIT_WORDS = {
    "ram": "the host's RAM",
    "cgroup": "the cgroup memory limit",
    "rlimit_as": "the address-space rlimit (RLIMIT_AS, ulimit -v)",
    "rlimit_data": "the data-segment rlimit (RLIMIT_DATA, ulimit -d)",
}
"""Each host limit, in words (``HostLimit.kind`` -> the phrase reports, logs and doctor print)."""


@dataclass(frozen=True, slots=True)
class HostLimit:
    """One bound on this process's memory: its size and what already counts against it.

    ``ram``: the host's total and what is not available; ``cgroup``: the memory limit of the process's
    cgroup (or an ancestor's) and its working set (usage less inactive page cache, which the kernel
    reclaims before it kills); ``rlimit_as`` / ``rlimit_data``: the soft rlimit and the process's
    virtual / data size, which is what the kernel checks them against."""

    kind: str  # a key of HOST_LIMIT_WORDS
    limit_bytes: int
    used_bytes: int

    @property
    def headroom_bytes(self) -> int:
        return max(0, self.limit_bytes - self.used_bytes)

    @property
    def words(self) -> str:
        return HOST_LIMIT_WORDS.get(self.kind, self.kind)


@dataclass(frozen=True, slots=True)
class HostSample:
    """This process and its host.

    ``available_bytes`` is the headroom under the limit that binds: the least of the host's available
    RAM, the cgroup memory limit less its usage and the rlimits less the process's size; ``total_bytes``
    is that limit's size and ``limit`` its kind. ``limits`` holds every limit found (host RAM first)."""

    rss_bytes: int
    available_bytes: int | None = None
    total_bytes: int | None = None
    pinned_bytes: int | None = None  # torch's pinned-host caching allocator, when CUDA reports it
    limit: str | None = None  # the kind of the binding limit ("ram", "cgroup", "rlimit_as", "rlimit_data")
    limits: tuple[HostLimit, ...] = ()
    file_bytes: int | None = None
    """Of ``rss_bytes``, the pages mapped from files and shared memory (statm's ``shared``): a memory-mapped
    dataset's page cache, which the kernel takes back when memory runs short, and shared segments. The
    leak detector's host series leaves them out (``LeakSeries.feed``)."""

    @property
    def limit_words(self) -> str:
        """The binding limit in words ("the host's RAM" when none is known)."""
        return HOST_LIMIT_WORDS.get(self.limit or "ram", self.limit or "")

    def with_rss(self, rss: int, file_bytes: int | None = None) -> HostSample:
        """This reading with the RSS read now. Growth since this reading came out of the headroom: RSS
        growth is what a leak adds to the cgroup's usage, the process's size and the host's used RAM
        alike, so the headroom read seconds ago is not stale by a fast leak's growth (a shrink is left
        to the next full reading: freed memory is not always given back to the limit)."""
        grown = rss - self.rss_bytes
        available = self.available_bytes
        if available is not None and grown > 0:
            available = max(0, available - grown)
        return HostSample(rss, available, self.total_bytes, self.pinned_bytes, self.limit, self.limits, file_bytes)


@dataclass(frozen=True, slots=True)
class WorkerSample:
    """One child process of the job (a DataLoader worker, or any other child)."""

    pid: int
    rss_bytes: int
    uss_bytes: int | None = None  # its own pages (copy-on-read shows here); None: not read (the per-step read)
    pss_bytes: int | None = None  # its proportional share of the pages it shares with the job
    file_bytes: int | None = None  # of rss_bytes, pages mapped from files and shared memory (``HostSample``)


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
