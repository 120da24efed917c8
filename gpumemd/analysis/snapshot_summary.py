"""Summarise a ``torch.cuda.memory._snapshot()`` dict per device (pure; no torch).

The dict holds only builtins (TORCH_MEMORY_API.md §2.2): ``segments`` (with ``blocks`` in address
order and their ``state``) and ``device_traces`` (one chronological list per device). Every key is
read with ``.get``: older torch and hand-made snapshots omit some of them. One pass over the data,
so a 100k-entry history costs tens of milliseconds on the OOM path.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from gpumemd.analysis.alloc_sites import site_frames
from gpumemd.records.device import Device
from gpumemd.records.oom import SnapshotSite, SnapshotSummary

_TOP_SITES = 10


def _frame_key(frames: Any, internal: Sequence[str], library: Sequence[str] = ()) -> str | None:
    """The innermost frame outside torch and gpumemd (frames[0] is nearest the allocation, usually
    inside torch or C++), with the user's own frame further out when that one is a library's; else
    the innermost frame: the line a person can change."""
    if not frames or not isinstance(frames, Sequence):
        return None
    mappings = [f for f in frames if isinstance(f, Mapping)]
    if not mappings:
        return None
    outside, own = site_frames(mappings, internal, library)
    key = _full(outside if outside is not None else mappings[0])
    return key if own is None or own is outside else f"{key}, called from {_full(own)}"


def _full(frame: Mapping[str, Any]) -> str:
    return f"{frame.get('filename', '?')}:{frame.get('line', '?')}:{frame.get('name', '?')}"


def _int(value: Any) -> int:
    """A number from a snapshot someone sent: wrong types count as 0 instead of failing the summary."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0
    if isinstance(value, int):  # before isfinite, which overflows on a 2,000-bit int
        return value if abs(value) < 2**63 else 0
    return int(value) if math.isfinite(value) and abs(value) < 2**63 else 0


def _list(value: Any) -> list[Any]:
    """A list from a snapshot someone sent; anything else (an int where a list belongs) reads as empty."""
    return list(value) if isinstance(value, (list, tuple)) else []


def _largest_free(by_stream: dict[int, int], oom: Mapping[str, Any] | None) -> int:
    """The largest free large-pool block on the stream that failed (the OOM trace entry's), else on any."""
    stream = oom.get("stream") if oom is not None else None
    if isinstance(stream, int) and not isinstance(stream, bool):
        return by_stream.get(stream, 0)
    return max(by_stream.values(), default=0)


def _count_segment(s: dict[str, Any], seg: Mapping[str, Any], dirs: tuple[Sequence[str], Sequence[str]]) -> None:
    """One segment and its blocks into its device's tallies ``s``."""
    s["segments"] += 1
    s["reserved"] += _int(seg.get("total_size", 0))
    s["expandable"] += 1 if seg.get("is_expandable") else 0
    # A free block can serve a large request only from the large pool (small-pool segments are
    # 2 MiB, for requests up to 1 MiB) and on its own stream. Older snapshots without the type count.
    large = seg.get("segment_type", "large") == "large"
    largest: dict[int, int] = s["largest_free"]  # stream -> largest free large-pool block
    stream = _int(seg.get("stream", 0))
    blocks = seg.get("blocks")
    private = _private_pool(seg)
    for block in blocks if isinstance(blocks, list) else ():
        if not isinstance(block, Mapping):
            continue
        size = _int(block.get("size", 0))
        state = block.get("state")
        if state == "inactive" and private:
            s["private_free"] += size  # only its own graphs' replays can use it
            continue
        if state == "inactive":
            s["inactive"] += size
            if large:
                largest[stream] = max(largest.get(stream, 0), size)
            continue
        s["active"] += size
        if state == "active_allocated":
            s["allocated"] += size
            site = _frame_key(block.get("frames"), *dirs)
            if site is not None:
                bytes_, count = s["sites"].get(site, (0, 0))
                s["sites"][site] = (bytes_ + size, count + 1)


def _private_pool(seg: Mapping[str, Any]) -> bool:
    """Is the segment in a private pool (CUDA graphs, MemPool)? ``(0, 0)`` is the default pool."""
    pool = seg.get("segment_pool_id")
    return isinstance(pool, (tuple, list)) and len(pool) == 2 and any(_int(part) != 0 for part in pool)


def summarize_snapshot(snapshot: Mapping[str, Any] | list[Any], *,
                       internal: Sequence[str] = (), library: Sequence[str] = ()) -> dict[Device, SnapshotSummary]:
    """CUDA device -> its summary. A bare list is read as ``memory_snapshot()``'s segment list.
    ``internal``, ``library``: directory prefixes of torch and gpumemd, and of the standard library and
    installed packages (``gpumemd.probes.holding.package_dirs``): a site is the first frame outside the former,
    with the first outside both when that is another."""
    segments = snapshot if isinstance(snapshot, list) else _list(snapshot.get("segments"))
    traces = [] if isinstance(snapshot, list) else _list(snapshot.get("device_traces"))
    acc: defaultdict[int, dict[str, Any]] = defaultdict(lambda: {
        "segments": 0, "reserved": 0, "allocated": 0, "active": 0, "inactive": 0, "largest_free": {}, "expandable": 0,
        "sites": {}, "private_free": 0})
    for seg in segments:
        if isinstance(seg, Mapping):
            _count_segment(acc[_int(seg.get("device", 0))], seg, (internal, library))
    out: dict[Device, SnapshotSummary] = {}
    for device in set(acc) | set(range(len(traces))):
        entries = traces[device] if device < len(traces) and isinstance(traces[device], list) else []
        if device not in acc and not entries:
            continue
        s = acc[device]
        oom = next((e for e in reversed(entries) if isinstance(e, Mapping) and e.get("action") == "oom"), None)
        sites = sorted(s["sites"].items(), key=lambda kv: kv[1][0], reverse=True)[:_TOP_SITES]
        cuda = Device.cuda(device)
        out[cuda] = SnapshotSummary(
            device=cuda,
            segments=s["segments"],
            reserved_bytes=s["reserved"],
            allocated_bytes=s["allocated"],
            active_bytes=s["active"],
            inactive_bytes=s["inactive"],
            largest_free_block_bytes=_largest_free(s["largest_free"], oom),
            expandable_segments=s["expandable"],
            trace_entries=len(entries),
            oom_requested_bytes=_int(oom["size"]) if oom is not None and "size" in oom else None,
            oom_device_free_bytes=_int(oom["device_free"]) if oom is not None and "device_free" in oom else None,
            sites=tuple(SnapshotSite(frame=k, nbytes=v[0], blocks=v[1]) for k, v in sites),
            private_pool_free_bytes=s["private_free"],
        )
    return out


def expandable_segments_enabled(snapshot: Mapping[str, Any] | list[Any]) -> bool | None:
    """What the snapshot's ``allocator_settings`` say about ``expandable_segments`` (None: unknown)."""
    if not isinstance(snapshot, Mapping):
        return None
    settings = snapshot.get("allocator_settings")
    if not isinstance(settings, Mapping) or "expandable_segments" not in settings:
        return None
    return bool(settings["expandable_segments"])
