"""Where the failing device's memory went at the OOM, and whether a leak, fragmentation or capacity is to blame.

Pure: every input is a record. Precedence for each number, most exact first: the allocator snapshot
taken inside the OOM observer, the observer's arguments, the OOM message, the last allocator sample.
What a leak held at the OOM, and the verdict that blames it, are in ``oom_leak``.
"""

from __future__ import annotations

import dataclasses

from gpumemd.analysis.headroom import cap_from_observer, reservable_bytes
from gpumemd.analysis.units import format_bytes
from gpumemd.records.census import Census, category_bytes
from gpumemd.records.device import CPU, Device
from gpumemd.records.oom import Breakdown, BreakdownItem, ObserverCall, OomMessage, SnapshotSummary, breakdown_label
from gpumemd.records.samples import AllocatorSample, HostSample, WorkersSample

# Census category -> breakdown key.
CATEGORY_KEYS: dict[str, str] = {
    "parameter": "parameters",
    "gradient": "gradients",
    "optimizer_state": "optimizer_state",
    "buffer": "buffers",
    "graph": "graph_retained",
    "other": "other",
}


def breakdown_item(key: str, nbytes: int, device: Device, limit: str | None = None) -> BreakdownItem:
    return BreakdownItem(key, breakdown_label(key, device, limit=limit), nbytes)


def _census_items(census: Census | None, device: Device) -> tuple[list[BreakdownItem], int]:
    """The items of the census's categories on ``device`` (graph-retained bytes count towards
    ``graph``), and the bytes the census saw there."""
    by_cat = category_bytes(g for g in (census.groups if census is not None else ()) if g.key.device == device)
    return [breakdown_item(key, by_cat[cat], device) for cat, key in CATEGORY_KEYS.items()], sum(by_cat.values())


def fmt(n: int | None) -> str:
    """Bytes in verdicts and suggestions: ``8388608`` -> ``"8.00 MiB"``."""
    return format_bytes(n, digits=2, missing="unknown")


def _first(*values: int | None) -> int | None:
    return next((v for v in values if v is not None), None)


@dataclasses.dataclass(frozen=True)
class _Limits:
    """What bounded the failing device at the OOM: its total, the per-process cap and the room left."""

    device_total: int | None
    cap: int | None  # set_per_process_memory_fraction's cap; None: no cap known
    fraction: float | None
    device_free: int | None  # the driver's free memory, device-wide
    headroom: int | None  # what the allocator could still reserve: min(device_free, cap - reserved)

    @property
    def total(self) -> int | None:
        """What the breakdown is measured against: the cap when one is set (the job could use no more)."""
        return self.cap if self.cap is not None else self.device_total


def cap_words(cap: int, fraction: float | None) -> str:
    """"the process cap of 12.00 GiB (fraction 0.50)": a verdict's words for the cap."""
    return f"the process cap of {fmt(cap)}" + (f" (fraction {fraction:.2f})" if fraction is not None else "")


def _limits(msg: OomMessage, *, observer: ObserverCall | None, allocator: AllocatorSample | None,
            snapshot: SnapshotSummary | None, nvml_total_bytes: int | None, reserved: int | None) -> _Limits:
    """Tell the cap from the device total. The message says both ("total capacity", "X allowed;"); the
    observer's third argument is the cap when one is set and the total otherwise; the allocator sample
    carries the fraction gpumemd read from torch; NVML knows the total."""
    obs_total = observer.total_or_cap_bytes if observer else None
    known_total = _first(msg.total_bytes, nvml_total_bytes)
    sampled_cap = allocator.cap_bytes if allocator else None
    # A fraction read from torch says whether a cap is set; without one, the observer's figure may.
    read = allocator is not None and allocator.memory_fraction is not None
    cap = _first(msg.allowed_bytes, sampled_cap, None if read else cap_from_observer(obs_total, known_total))
    device_total = _first(msg.total_bytes, obs_total if cap is None else None, nvml_total_bytes)
    fraction = allocator.memory_fraction if allocator is not None and sampled_cap is not None else None
    if cap is not None and fraction is None and device_total:
        fraction = cap / device_total
    device_free = _first(observer.device_free_bytes if observer else None, msg.free_bytes,
                         snapshot.oom_device_free_bytes if snapshot else None)
    return _Limits(device_total=device_total, cap=cap, fraction=fraction, device_free=device_free,
                   headroom=reservable_bytes(device_free, reserved, cap))


def _room_items(limits: _Limits, reserved: int | None, device: Device) -> tuple[list[BreakdownItem], int | None]:
    """The items after PyTorch's own, and the memory outside PyTorch. Without a cap: outside PyTorch
    (device total - reserved - free: the context, NCCL, other processes) and free, which with PyTorch's
    items make up the device. Under a cap: only the headroom left under it, so that the items partition
    the cap; memory outside PyTorch does not count against the cap and is reported beside it."""
    non_pytorch = None
    if limits.device_total is not None and reserved is not None and limits.device_free is not None:
        non_pytorch = max(0, limits.device_total - reserved - limits.device_free)
    items = []
    if limits.cap is not None:
        if limits.headroom is not None:
            items.append(breakdown_item("headroom", limits.headroom, device))
        return items, non_pytorch
    if non_pytorch is not None:
        items.append(breakdown_item("non_pytorch", non_pytorch, device))
    if limits.device_free is not None:
        items.append(breakdown_item("free", limits.device_free, device))
    return items, non_pytorch


def cuda_breakdown(
    *,
    device: Device,
    message: OomMessage | None = None,
    observer: ObserverCall | None = None,
    snapshot: SnapshotSummary | None = None,
    allocator: AllocatorSample | None = None,
    census: Census | None = None,
    nvml_total_bytes: int | None = None,
) -> Breakdown:
    """The breakdown of CUDA ``device`` against its total (or its per-process cap)."""
    msg = message or OomMessage(kind="cuda", format="unparsed")
    requested = _first(observer.requested_bytes if observer else None, msg.requested_bytes,
                       snapshot.oom_requested_bytes if snapshot else None)
    # torch's message counts the free blocks of private pools (CUDA graphs, MemPool) in "allocated by
    # PyTorch" ("with X allocated in private pools"): they serve only their graphs. Read apart here.
    msg_private = msg.private_pool_bytes or 0
    private_free = snapshot.private_pool_free_bytes if snapshot else msg_private
    msg_allocated = None if msg.allocated_bytes is None else max(0, msg.allocated_bytes - msg_private)
    allocated = _first(snapshot.allocated_bytes if snapshot else None, msg_allocated,
                       allocator.allocated_bytes if allocator else None)
    reserved = _first(snapshot.reserved_bytes if snapshot else None, msg.reserved_bytes,
                      allocator.reserved_bytes if allocator else None)
    limits = _limits(msg, observer=observer, allocator=allocator, snapshot=snapshot,
                     nvml_total_bytes=nvml_total_bytes, reserved=reserved)
    largest = snapshot.largest_free_block_bytes if snapshot else None
    items, seen = _census_items(census, device)
    if allocated is not None and census is None:
        items.append(breakdown_item("unattributed", allocated, device))
    elif allocated is not None:
        # Saved activations live in C++ (autograd), not in gc-visible tensors: allocated minus what
        # the census saw is, mid-step, mostly activations.
        items.append(breakdown_item("invisible", max(0, allocated - seen), device))
    if reserved is not None and allocated is not None:
        if private_free:
            items.append(breakdown_item("private_pool_free", private_free, device))
        items.append(breakdown_item("reserved_unallocated", max(0, reserved - allocated - private_free), device))
    room, non_pytorch = _room_items(limits, reserved, device)
    items += room
    verdict, why = _cuda_verdict(requested=requested, allocated=allocated, reserved=reserved, limits=limits,
                                 largest=largest, private_free=private_free)
    rejections = allocator.num_oom_rejections if allocator else None
    if rejections:
        why += (f"; before it, the allocator had refused {rejections} allocation{'s' if rejections != 1 else ''} "
                "up front as past the process cap (num_oom_rejections: throw_on_cudamalloc_oom with a memory "
                "fraction), each an OutOfMemoryError the job caught or retried")
    return Breakdown(
        device=device, total_bytes=limits.total, items=tuple(items), requested_bytes=requested,
        allocated_bytes=allocated, reserved_bytes=reserved, largest_free_block_bytes=largest,
        device_free_bytes=limits.device_free, verdict=verdict, verdict_why=why, cap_bytes=limits.cap,
        memory_fraction=limits.fraction, device_total_bytes=limits.device_total, headroom_bytes=limits.headroom,
        non_pytorch_bytes=non_pytorch, oom_rejections=rejections,
    )


def _cuda_verdict(
    *,
    requested: int | None,
    allocated: int | None,
    reserved: int | None,
    limits: _Limits,
    largest: int | None,
    private_free: int = 0,
) -> tuple[str, str]:
    if requested is None:
        return "unknown", "the request size is unknown (no observer call, no parsable message)"
    cap, total = limits.cap, limits.device_total
    if cap is not None and requested > cap:
        return ("request_exceeds_device",
                f"one request of {fmt(requested)} is larger than {cap_words(cap, limits.fraction)} "
                "(set_per_process_memory_fraction): a size or shape bug, or a cap set too low")
    if total is not None and requested > total:
        return ("request_exceeds_device",
                f"one request of {fmt(requested)} is larger than the whole device ({fmt(total)}): "
                "a size or shape bug, not memory pressure")
    if allocated is None or reserved is None:
        return "unknown", "the allocator's state at the OOM is unknown"
    cached_free = max(0, reserved - allocated - private_free)  # a private pool's free blocks serve only its graphs
    room = limits.headroom or 0
    free_total = cached_free + room
    where = "on the device" if cap is None else f"left under {cap_words(cap, limits.fraction)}"
    if free_total >= requested and room < requested:
        biggest = fmt(largest)
        return ("fragmentation",
                f"{fmt(free_total)} was free ({fmt(cached_free)} cached by PyTorch + {fmt(room)} {where}), "
                f"more than the {fmt(requested)} requested, but the largest free block was {biggest}: "
                "the free memory was in pieces")
    bound = "" if cap is None else (f" under {cap_words(cap, limits.fraction)}, with "
                                    f"{fmt(limits.device_free)} free on the device")
    return ("capacity",
            f"the job needed {fmt(requested)} more with {fmt(allocated)} already allocated and only "
            f"{fmt(free_total)} free in all{bound}: the working set does not fit")


def cpu_breakdown(
    *,
    message: OomMessage | None = None,
    host: HostSample | None = None,
    census: Census | None = None,
    workers: WorkersSample | None = None,
) -> Breakdown:
    """The breakdown of host memory at a CPU allocation failure, against the limit that binds: the
    host's RAM, or a cgroup memory limit or an rlimit when that leaves less room. The job's worker
    processes (their PSS, else their RSS) are an item of their own, out of "other processes"."""
    requested = message.requested_bytes if message else None
    total = host.total_bytes if host else None
    available = host.available_bytes if host else None
    rss = host.rss_bytes if host else None
    limit = host.limit if host else None
    items, seen = _census_items(census, CPU)
    if rss is not None:
        items.append(breakdown_item("process_other", max(0, rss - seen), CPU))
    in_workers = _workers_bytes(workers)
    if in_workers:
        items.append(breakdown_item("workers", in_workers, CPU))
    if total is not None and available is not None and rss is not None:
        items.append(breakdown_item("non_pytorch", max(0, total - available - rss - in_workers), CPU, limit))
    if available is not None:
        items.append(breakdown_item("free", available, CPU, limit))
    verdict, why = _host_verdict(requested, total, available, host)
    return Breakdown(
        device=CPU, total_bytes=total, items=tuple(items), requested_bytes=requested,
        allocated_bytes=rss, reserved_bytes=None, largest_free_block_bytes=None,
        device_free_bytes=available, verdict=verdict, verdict_why=why, host_limit=limit,
    )


def _host_verdict(requested: int | None, total: int | None, available: int | None,
                  host: HostSample | None) -> tuple[str, str]:
    words = host.limit_words if host else "the host's RAM"
    if requested is not None and total is not None and requested > total:
        limit = f"the host's {fmt(total)} of RAM" if words == "the host's RAM" else f"{words} ({fmt(total)})"
        return ("request_exceeds_device",
                f"one request of {fmt(requested)} is larger than {limit}: a size or shape bug, not memory pressure")
    if requested is not None and available is not None and requested > available:
        return "capacity", f"the request of {fmt(requested)} exceeds the {fmt(available)} left under {words}"
    return "unknown", "the host had room by its own account (overcommit limits?)"


def _workers_bytes(workers: WorkersSample | None) -> int:
    """What the job's child processes add to the host's use: their PSS (shared pages split), else RSS."""
    if workers is None or not workers.workers:
        return 0
    pss = workers.pss_bytes
    return pss if pss is not None else workers.rss_bytes
