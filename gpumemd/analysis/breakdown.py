"""Where the failing device's memory went at the OOM, and whether fragmentation or capacity is to blame.

Pure: every input is a record. Precedence for each number, most exact first: the allocator snapshot
taken inside the OOM observer, the observer's arguments, the OOM message, the last allocator sample.
"""

from __future__ import annotations

from gpumemd.analysis.units import format_bytes
from gpumemd.records.census import Census
from gpumemd.records.oom import Breakdown, BreakdownItem, ObserverCall, OomMessage, SnapshotSummary
from gpumemd.records.samples import AllocatorSample, HostSample

# Census category -> (breakdown key, label).
_CATEGORY_ITEMS: tuple[tuple[str, str, str], ...] = (
    ("parameter", "parameters", "parameters"),
    ("gradient", "gradients", "gradients"),
    ("optimizer_state", "optimizer_state", "optimizer state"),
    ("buffer", "buffers", "buffers"),
    ("graph", "graph_retained", "graph-retained (autograd graphs kept alive)"),
    ("other", "other", "other tensors"),
)


def normalize_device(device: str) -> str:
    """``"cuda"`` -> ``"cuda:0"``; other strings unchanged."""
    return "cuda:0" if device == "cuda" else device


def census_bytes_on(census: Census | None, device: str) -> dict[str, int]:
    """Census bytes per category on one device; graph-retained bytes count towards ``graph``."""
    out = {cat: 0 for cat, _, _ in _CATEGORY_ITEMS}
    if census is None:
        return out
    device = normalize_device(device)
    for group in census.groups:
        if normalize_device(group.key.device) != device:
            continue
        out[group.key.category] = out.get(group.key.category, 0) + group.nbytes
        out["graph"] += group.graph_bytes
    return out


def fmt(n: int | None) -> str:
    """Bytes in verdicts and suggestions: ``8388608`` -> ``"8.00 MiB"``."""
    return format_bytes(n, digits=2, missing="unknown")


def _first(*values: int | None) -> int | None:
    return next((v for v in values if v is not None), None)


def cuda_breakdown(
    *,
    device: int,
    message: OomMessage | None = None,
    observer: ObserverCall | None = None,
    snapshot: SnapshotSummary | None = None,
    allocator: AllocatorSample | None = None,
    census: Census | None = None,
    nvml_total_bytes: int | None = None,
) -> Breakdown:
    """The breakdown of ``cuda:<device>`` against its total (or its per-process cap)."""
    msg = message or OomMessage(kind="cuda", format="unparsed")
    obs_total = observer.total_or_cap_bytes if observer else None
    total = _first(msg.allowed_bytes, obs_total, msg.total_bytes, nvml_total_bytes)
    requested = _first(observer.requested_bytes if observer else None, msg.requested_bytes,
                       snapshot.oom_requested_bytes if snapshot else None)
    allocated = _first(snapshot.allocated_bytes if snapshot else None, msg.allocated_bytes,
                       allocator.allocated_bytes if allocator else None)
    reserved = _first(snapshot.reserved_bytes if snapshot else None, msg.reserved_bytes,
                      allocator.reserved_bytes if allocator else None)
    device_free = _first(observer.device_free_bytes if observer else None, msg.free_bytes,
                         snapshot.oom_device_free_bytes if snapshot else None)
    largest = snapshot.largest_free_block_bytes if snapshot else None
    by_cat = census_bytes_on(census, f"cuda:{device}")
    items = [BreakdownItem(key, label, by_cat[cat]) for cat, key, label in _CATEGORY_ITEMS]
    seen = sum(by_cat.values())
    if allocated is not None and census is None:
        items.append(BreakdownItem("unattributed", "allocated, not attributed (no census)", allocated))
    elif allocated is not None:
        # Saved activations live in C++ (autograd), not in gc-visible tensors: allocated minus what
        # the census saw is, mid-step, mostly activations.
        items.append(BreakdownItem("invisible", "invisible to the census (mostly saved activations)",
                                   max(0, allocated - seen)))
    if reserved is not None and allocated is not None:
        items.append(BreakdownItem("reserved_unallocated", "reserved by PyTorch but unallocated (cache)",
                                   max(0, reserved - allocated)))
    if total is not None and reserved is not None and device_free is not None:
        items.append(BreakdownItem("non_pytorch", "not PyTorch's (CUDA context, NCCL, other processes)",
                                   max(0, total - reserved - device_free)))
    if device_free is not None:
        items.append(BreakdownItem("free", "free on the device", device_free))
    verdict, why = _cuda_verdict(requested=requested, total=total, allocated=allocated, reserved=reserved,
                                 device_free=device_free, largest=largest)
    return Breakdown(
        device=f"cuda:{device}", total_bytes=total, items=tuple(items), requested_bytes=requested,
        allocated_bytes=allocated, reserved_bytes=reserved, largest_free_block_bytes=largest,
        device_free_bytes=device_free, verdict=verdict, verdict_why=why,
    )


def _cuda_verdict(
    *,
    requested: int | None,
    total: int | None,
    allocated: int | None,
    reserved: int | None,
    device_free: int | None,
    largest: int | None,
) -> tuple[str, str]:
    if requested is None:
        return "unknown", "the request size is unknown (no observer call, no parsable message)"
    if total is not None and requested > total:
        return ("request_exceeds_device",
                f"one request of {fmt(requested)} is larger than the whole device ({fmt(total)}): "
                "a size or shape bug, not memory pressure")
    if allocated is None or reserved is None:
        return "unknown", "the allocator's state at the OOM is unknown"
    cached_free = max(0, reserved - allocated)
    free_total = cached_free + (device_free or 0)
    if free_total >= requested and (device_free or 0) < requested:
        biggest = fmt(largest)
        return ("fragmentation",
                f"{fmt(free_total)} was free ({fmt(cached_free)} cached by PyTorch + {fmt(device_free or 0)} on the "
                f"device), more than the {fmt(requested)} requested, but the largest free block was {biggest}: "
                "the free memory was in pieces")
    return ("capacity",
            f"the job needed {fmt(requested)} more with {fmt(allocated)} already allocated and only "
            f"{fmt(free_total)} free in all: the working set does not fit")


def cpu_breakdown(
    *,
    message: OomMessage | None = None,
    host: HostSample | None = None,
    census: Census | None = None,
) -> Breakdown:
    """The breakdown of host memory at a CPU allocation failure."""
    requested = message.requested_bytes if message else None
    total = host.total_bytes if host else None
    available = host.available_bytes if host else None
    rss = host.rss_bytes if host else None
    by_cat = census_bytes_on(census, "cpu")
    items = [BreakdownItem(key, label, by_cat[cat]) for cat, key, label in _CATEGORY_ITEMS]
    seen = sum(by_cat.values())
    if rss is not None:
        items.append(BreakdownItem("process_other", "rest of the process (interpreter, libraries, unseen tensors)",
                                   max(0, rss - seen)))
    if total is not None and available is not None and rss is not None:
        items.append(BreakdownItem("non_pytorch", "other processes and the kernel",
                                   max(0, total - available - rss)))
    if available is not None:
        items.append(BreakdownItem("free", "available on the host", available))
    if requested is not None and total is not None and requested > total:
        verdict, why = ("request_exceeds_device",
                        f"one request of {fmt(requested)} is larger than the host's {fmt(total)} of RAM: "
                        "a size or shape bug, not memory pressure")
    elif requested is not None and available is not None and requested > available:
        verdict, why = ("capacity", f"the request of {fmt(requested)} exceeds the {fmt(available)} available")
    else:
        verdict, why = "unknown", "the host had room by its own account (overcommit limits or cgroup caps?)"
    return Breakdown(
        device="cpu", total_bytes=total, items=tuple(items), requested_bytes=requested,
        allocated_bytes=rss, reserved_bytes=None, largest_free_block_bytes=None,
        device_free_bytes=available, verdict=verdict, verdict_why=why,
    )
