"""What an out-of-memory post-mortem knows: the parsed message, the breakdown, the suggestions.

Pure data (no torch): ``gpumemd.analysis`` builds these from the message text, the census and the
allocator snapshot; the report writers turn them into JSON, Markdown and HTML.
"""

from __future__ import annotations

from dataclasses import dataclass, field

OOM_KINDS: tuple[str, ...] = ("cuda", "device", "cpu", "mps")
"""``cuda``: a CUDA caching-allocator OOM; ``device``: a ``torch.OutOfMemoryError`` of another
accelerator; ``cpu``: ``DefaultCPUAllocator: can't allocate memory``; ``mps``: Apple's backend."""

VERDICTS: tuple[str, ...] = ("request_exceeds_device", "fragmentation", "capacity", "unknown")


@dataclass(frozen=True, slots=True)
class OomMessage:
    """The numbers in an out-of-memory message. ``None`` means "the message did not say"."""

    kind: str
    format: str  # "cuda-2.1+", "cuda-legacy", "cuda-async", "cuda-runtime", "cpu", "mps" or "unparsed"
    requested_bytes: int | None = None
    device: int | None = None
    total_bytes: int | None = None  # the device's total capacity
    free_bytes: int | None = None  # free on the device, as the driver reported it
    allowed_bytes: int | None = None  # the per-process cap (set_per_process_memory_fraction)
    process_bytes: int | None = None  # this process, non-PyTorch memory included (NVML)
    allocated_bytes: int | None = None  # allocated by PyTorch (private pools included)
    private_pool_bytes: int | None = None  # CUDA graphs / MemPool
    reserved_unallocated_bytes: int | None = None  # cached by PyTorch but free
    reserved_bytes: int | None = None  # reserved in total by PyTorch


@dataclass(frozen=True, slots=True)
class BreakdownItem:
    """One slice of the device: ``key`` is stable (JSON, CLI), ``label`` is for people."""

    key: str
    label: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class Breakdown:
    """Where the memory of the failing device went, against its total."""

    device: str  # "cuda:0", "cpu"
    total_bytes: int | None  # device total, or the cap when one is set; host total for "cpu"
    items: tuple[BreakdownItem, ...]
    requested_bytes: int | None
    allocated_bytes: int | None
    reserved_bytes: int | None
    largest_free_block_bytes: int | None  # largest inactive block in the allocator's cache
    device_free_bytes: int | None  # free outside PyTorch's cache (driver view)
    verdict: str  # one of VERDICTS
    verdict_why: str

    def get(self, key: str) -> int:
        """Bytes of the item ``key`` (0 when the breakdown has no such item)."""
        for item in self.items:
            if item.key == key:
                return item.nbytes
        return 0

    @property
    def activations_bytes(self) -> int:
        """Graph-retained plus invisible: on a device, mostly activations saved for backward."""
        return self.get("graph_retained") + self.get("invisible")

    @property
    def tensor_bytes(self) -> int:
        """Bytes in live tensors, visible or not (everything but cache, free and foreign memory)."""
        keys = ("parameters", "gradients", "optimizer_state", "buffers", "graph_retained", "other", "invisible")
        return sum(self.get(k) for k in keys)


@dataclass(frozen=True, slots=True)
class Suggestion:
    """One thing to change, what it should save, and the measurement that led to it."""

    kind: str  # stable key: "activation_checkpointing", "expandable_segments", ...
    title: str
    saving_bytes: int
    why: str
    how: str = ""  # a line of code or configuration


@dataclass(frozen=True, slots=True)
class SnapshotSite:
    """Live bytes grouped by the first frame of their allocation stack."""

    frame: str  # "file.py:40:forward"
    nbytes: int
    blocks: int


@dataclass(frozen=True, slots=True)
class SnapshotSummary:
    """One device's allocator state, read from a ``torch.cuda.memory._snapshot()`` dict."""

    device: int
    segments: int
    reserved_bytes: int
    allocated_bytes: int
    active_bytes: int
    inactive_bytes: int
    largest_free_block_bytes: int
    expandable_segments: int  # segments with is_expandable
    trace_entries: int
    oom_requested_bytes: int | None = None  # size of the last "oom" trace entry
    oom_device_free_bytes: int | None = None
    sites: tuple[SnapshotSite, ...] = field(default_factory=tuple)


@dataclass(frozen=True, slots=True)
class ObserverCall:
    """One call of PyTorch's CUDA out-of-memory observer, argument meaning as in the allocator:
    ``obs(device, alloc_size, allowed_memory_maximum or device_total, device_free)``."""

    device: int
    requested_bytes: int  # the rounded size the allocator tried to obtain (a segment, maybe > the tensor)
    total_or_cap_bytes: int  # the device total, or the per-process cap when one is set (NOT "allocated")
    device_free_bytes: int  # cudaMemGetInfo's free
    wall_time: float
