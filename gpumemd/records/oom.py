"""What an out-of-memory post-mortem knows: the parsed message, the breakdown, the suggestions.

Pure data (no torch): ``gpumemd.analysis`` builds these from the message text, the census and the
allocator snapshot; the report writers turn them into JSON, Markdown and HTML.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpumemd.records.census import GroupKey
from gpumemd.records.device import CPU, Device
from gpumemd.records.plain import AS_ORDINAL

# The one set of words for breakdown items, used by report.md, report.html and ``gpumemd report``
# alike (report.json keeps the stable keys). Host memory has its own words where a key means
# something else there ("non_pytorch" is other processes on a host, the CUDA context on a GPU).
BREAKDOWN_LABELS: dict[str, str] = {
    "leaked": "leaked (held by the leak in the verdict)",
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "buffers": "buffers",
    "graph_retained": "autograd graphs kept alive",
    "other": "other tensors",
    "unattributed": "allocated, not attributed (no census)",
    "invisible": "invisible to the census (mostly saved activations)",
    "private_pool_free": "free in private pools (CUDA graphs, MemPool): for their own graphs only",
    "reserved_unallocated": "cached by PyTorch, unallocated",
    "non_pytorch": "outside PyTorch (CUDA context, NCCL, other processes)",
    "free": "free on the device",
    "headroom": "free under the process cap (min of the device's free memory and cap − reserved)",
}
HOST_LABELS: dict[str, str] = {
    "process_other": "rest of this process (interpreter, libraries, unseen tensors)",
    "workers": "the job's worker processes (DataLoader workers and other children)",
    "non_pytorch": "other processes and the kernel",
    "free": "available on the host",
}


# Under a host limit other than RAM (``HostSample.limit``) the host items partition that limit instead.
LIMIT_LABELS: dict[tuple[str, str], str] = {
    ("cgroup", "non_pytorch"): "rest of the cgroup (other processes, kernel memory, page cache in use)",
    ("cgroup", "free"): "left under the cgroup memory limit",
    ("rlimit_as", "non_pytorch"): "address space mapped but not resident (reserved, not yet touched)",
    ("rlimit_as", "free"): "left under RLIMIT_AS (ulimit -v)",
    ("rlimit_data", "non_pytorch"): "data segment mapped but not resident",
    ("rlimit_data", "free"): "left under RLIMIT_DATA (ulimit -d)",
}


def breakdown_label(key: str, device: Device | None = None, default: str | None = None,
                    limit: str | None = None) -> str:
    """The words for breakdown item ``key`` on ``device`` (on the host, under ``limit``); ``default``
    (an older report's own label) or the key itself for a key this version does not know."""
    if device == CPU and limit is not None and (limit, key) in LIMIT_LABELS:
        return LIMIT_LABELS[(limit, key)]
    if device == CPU and key in HOST_LABELS:
        return HOST_LABELS[key]
    return BREAKDOWN_LABELS.get(key) or default or key


@dataclass(frozen=True, slots=True)
class OomMessage:
    """The numbers in an out-of-memory message. ``None`` means "the message did not say"."""

    kind: str  # "cuda" (the caching allocator), "device" (another accelerator's OutOfMemoryError), "cpu", "mps"
    format: str  # "cuda-2.1+", "cuda-legacy", "cuda-async", "cuda-runtime", "xpu", "cpu", "mps" or "unparsed"
    # (ROCm's "HIP out of memory" is the CUDA caching allocator's text: "cuda-2.1+" or "cuda-legacy")
    requested_bytes: int | None = None
    device: Device | None = field(default=None, metadata=AS_ORDINAL)  # the CUDA device it names
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
class LeakCause:
    """A leak found at the OOM: the census groups an active leak finding (or a census diff) points
    at, what they held when the device ran out, and how fast they grew."""

    holder: str  # short: "`kept`", "TrainerState.history", or the group when no holder was found
    held_bytes: int  # storage + graph bytes of the leaking groups at the OOM (or estimated, see source)
    graph_bytes: int  # of which autograd graph (saved tensors of kept graphs): never activations
    tensor_count: int
    description: str  # the largest leaking group: "float32[512, 1024]"
    source: str  # "finding": an active leak finding; "census": a group that grew between censuses
    kind: str = "tensor_leak"  # a FINDING_KINDS value
    state: str = "suspected"  # the finding's state; "grew" for a census diff
    slope_bytes_per_step: float | None = None
    onset_step: int | None = None  # first step of the growth (the census step before it for "census")
    holder_detail: str | None = None  # the full holder line: "`kept` in main() at train.py:12 → list of 770 items"
    series: str | None = None  # the finding's series
    estimated: bool = False  # no census group matched: held_bytes is the finding's growth, projected
    census_step: int | None = None  # the census was an earlier one (at the OOM it failed): held_bytes is
    # what it saw plus the finding's slope since, that projection in ``bytes_by_category`` as "projected"
    groups: int = 1  # how many census groups the leak spans
    bytes_by_category: tuple[tuple[str, int], ...] = ()  # census category -> bytes ("graph": graph bytes too)
    summary: str = ""  # the sentence the reports print: "`kept` grew ~2.00 MiB/step since step 60 and held ..."
    group_keys: tuple[GroupKey, ...] = ()  # the census groups it spans (the reports mark their rows)


@dataclass(frozen=True, slots=True)
class Breakdown:
    """Where the memory of the failing device went, against its total."""

    device: Device  # cuda:0, or cpu for the host
    total_bytes: int | None  # device total, or the cap when one is set (cap_bytes); host total for "cpu"
    items: tuple[BreakdownItem, ...]
    requested_bytes: int | None
    allocated_bytes: int | None
    reserved_bytes: int | None
    largest_free_block_bytes: int | None  # largest inactive large-pool block (on the failing stream)
    device_free_bytes: int | None  # free outside PyTorch's cache (driver view)
    # "request_exceeds_device", "fragmentation", "capacity", "unknown", or "leak": a leak held more
    # than the failing request when the device ran out (``leak``)
    verdict: str
    verdict_why: str
    leak: LeakCause | None = None  # an active leak at the OOM (the cause when verdict == "leak")
    # Under torch.cuda.set_per_process_memory_fraction the items partition the cap (total_bytes): what
    # PyTorch reserved, and the ``headroom`` item for what it could still reserve. Memory outside PyTorch
    # is not counted against the cap, so it is a figure of its own then, not an item.
    cap_bytes: int | None = None  # the per-process cap; None: no cap set (or none known)
    memory_fraction: float | None = None  # the cap over the device total, when known
    device_total_bytes: int | None = None  # the device's own total (equals total_bytes without a cap)
    headroom_bytes: int | None = None  # what the allocator could still reserve: min(device free, cap − reserved)
    non_pytorch_bytes: int | None = None  # device memory outside PyTorch's allocator (other processes included)
    # Why this device is the one shown when the error did not name its own (a device OOM in a process
    # that uses several): "The error does not name its device; showing cuda:1, the fullest ...". None
    # when the error (or the observer, or the only device in use) named it.
    device_note: str | None = None
    # On the host: the kind of limit the items partition ("ram", "cgroup", "rlimit_as", "rlimit_data";
    # ``HostSample.limit``): total_bytes is that limit's size, the "free" item what was left under it.
    host_limit: str | None = None
    # Allocations the allocator had refused up front under the process cap (memory_stats
    # num_oom_rejections, torch 2.13+, at the last sample before the OOM); None where not read.
    oom_rejections: int | None = None

    def get(self, key: str) -> int:
        """Bytes of the item ``key`` (0 when the breakdown has no such item)."""
        return next((item.nbytes for item in self.items if item.key == key), 0)

    @property
    def activations_bytes(self) -> int:
        """Graph-retained plus invisible: on a device, mostly activations saved for backward. A leak's
        graphs are in the ``leaked`` item instead (they are not this step's activations)."""
        return self.get("graph_retained") + self.get("invisible")

    @property
    def tensor_bytes(self) -> int:
        """Bytes in live tensors, visible or not (everything but cache, free and foreign memory)."""
        keys = ("leaked", "parameters", "gradients", "optimizer_state", "buffers", "graph_retained", "other",
                "invisible")
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

    device: Device = field(metadata=AS_ORDINAL)  # a CUDA device
    segments: int
    reserved_bytes: int
    allocated_bytes: int
    active_bytes: int
    inactive_bytes: int
    largest_free_block_bytes: int  # inactive, large pool, on the OOM's stream when the trace names it
    expandable_segments: int  # segments with is_expandable
    trace_entries: int
    oom_requested_bytes: int | None = None  # size of the last "oom" trace entry
    oom_device_free_bytes: int | None = None
    sites: tuple[SnapshotSite, ...] = field(default_factory=tuple)
    # Free blocks in private pools (CUDA graphs, MemPool): kept for their graphs' replays, never
    # handed to other allocations, so neither free memory for the OOM's request nor fragmentation.
    private_pool_free_bytes: int = 0


@dataclass(frozen=True, slots=True)
class ObserverCall:
    """One call of PyTorch's CUDA out-of-memory observer, argument meaning as in the allocator:
    ``obs(device, alloc_size, allowed_memory_maximum or device_total, device_free)``."""

    device: Device = field(metadata=AS_ORDINAL)  # a CUDA device
    requested_bytes: int  # the rounded size the allocator tried to obtain (a segment, maybe > the tensor)
    total_or_cap_bytes: int  # the device total, or the per-process cap when one is set (NOT "allocated")
    device_free_bytes: int  # cudaMemGetInfo's free
    wall_time: float
