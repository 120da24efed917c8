"""CUDA graphs' private pools (torch.compile ``mode="reduce-overhead"``, ``torch.cuda.MemPool``): their
free blocks serve only their own graphs' replays, so they are neither free memory for an OOM's request
nor fragmentation; and a pool growing with each graph recorded is not an allocated-bytes leak."""

from __future__ import annotations

from typing import Any

from gpumemd.analysis.breakdown import cuda_breakdown
from gpumemd.analysis.oom_message import parse_oom_message
from gpumemd.analysis.snapshot_summary import summarize_snapshot
from gpumemd.probes.device.allocator import sample_from_stats
from gpumemd.records.device import Device
from gpumemd.records.oom import ObserverCall

MiB = 2**20
GiB = 2**30


def _segment(address: int, pool: tuple[int, int], blocks: list[tuple[int, str]]) -> dict[str, Any]:
    at, out = address, []
    for size, state in blocks:
        out.append({"address": at, "size": size, "requested_size": size if state != "inactive" else 0,
                    "state": state, "frames": []})
        at += size
    active = [b for b in out if b["state"] != "inactive"]
    return {"device": 0, "address": address, "total_size": sum(b["size"] for b in out),
            "allocated_size": sum(b["size"] for b in active), "active_size": sum(b["size"] for b in active),
            "requested_size": sum(b["requested_size"] for b in active), "stream": 0, "segment_type": "large",
            "segment_pool_id": pool, "is_expandable": False, "frames": [], "blocks": out}


def test_free_blocks_in_a_private_pool_are_not_free_memory_or_fragmentation() -> None:
    snap = {"segments": [
        _segment(0x7F0000000000, (0, 0), [(60 * MiB, "active_allocated"), (2 * MiB, "inactive")]),
        _segment(0x7F0010000000, (1, 0), [(20 * MiB, "active_allocated"), (40 * MiB, "inactive")]),  # a graph's pool
    ], "device_traces": [[{"action": "oom", "size": 16 * MiB, "device_free": 1 * MiB, "stream": 0}]]}
    summary = summarize_snapshot(snap)[Device.cuda(0)]
    assert summary.inactive_bytes == 2 * MiB and summary.private_pool_free_bytes == 40 * MiB
    assert summary.largest_free_block_bytes == 2 * MiB  # the pool's 40 MiB block cannot serve the request
    b = cuda_breakdown(device=Device.cuda(0), snapshot=summary,
                       observer=ObserverCall(Device.cuda(0), 16 * MiB, 80 * GiB, 1 * MiB, wall_time=0.0))
    # 42 MiB "cached" would have looked like a fragmented cache; 2 MiB of it is usable: it does not fit
    assert b.verdict == "capacity", b.verdict_why


def test_private_pool_reserved_bytes_are_read_from_memory_stats() -> None:
    stats = {"allocated_bytes.all.current": 5 * GiB, "reserved_bytes.all.current": 6 * GiB,
             "reserved_bytes_by_private_pools.1_0.all.current": GiB,
             "reserved_bytes_by_private_pools.1_0.all.peak": 2 * GiB,
             "reserved_bytes_by_private_pools.2_0.all.current": 512 * MiB,
             "reserved_bytes_by_private_pools.2_0.large_pool.current": 512 * MiB}
    sample = sample_from_stats(0, stats)
    assert sample is not None and sample.private_pool_reserved_bytes == GiB + 512 * MiB
    plain = sample_from_stats(0, {"allocated_bytes.all.current": 1, "reserved_bytes.all.current": 2})
    assert plain is not None and plain.private_pool_reserved_bytes is None


def test_the_messages_private_pool_bytes_are_read_apart_from_allocated() -> None:
    """Without a snapshot: torch's message counts the free blocks of private pools in "allocated by
    PyTorch" (CUDACachingAllocator.cpp: ``allocated_bytes + allocated_in_private_pools``, summed over the
    pools' free-block sets), so allocated is 1 GiB less and that GiB is neither tensors nor cache."""
    text = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 80.00 GiB of which "
            "1.00 GiB is free. Of the allocated memory 70.00 GiB is allocated by PyTorch, with 10.00 GiB allocated "
            "in private pools (e.g., CUDA Graphs), and 4.00 GiB is reserved by PyTorch but unallocated.")
    message = parse_oom_message(text)
    b = cuda_breakdown(device=Device.cuda(0), message=message)
    assert b.allocated_bytes == 60 * GiB and b.reserved_bytes == 74 * GiB
    assert b.get("private_pool_free") == 10 * GiB and b.get("reserved_unallocated") == 4 * GiB
    assert b.get("unattributed") == 60 * GiB
    # 4 GiB cached + 1 GiB free >= 2 GiB: fragmentation, never counting the pools' 10 GiB as free
    assert b.verdict == "fragmentation" and "4.00 GiB cached" in b.verdict_why


def test_rejections_under_the_cap_are_told_in_the_verdict() -> None:
    sample = sample_from_stats(0, {"allocated_bytes.all.current": 3 * GiB, "reserved_bytes.all.current": 4 * GiB,
                                   "num_oom_rejections": 3}, memory_fraction=0.5, cap_bytes=4 * GiB)
    assert sample is not None and sample.num_oom_rejections == 3
    b = cuda_breakdown(device=Device.cuda(0), allocator=sample,
                       observer=ObserverCall(Device.cuda(0), 2 * GiB, 4 * GiB, 40 * GiB, wall_time=0.0))
    assert b.oom_rejections == 3
    assert "refused 3 allocations up front as past the process cap" in b.verdict_why
    quiet = cuda_breakdown(device=Device.cuda(0), allocator=sample_from_stats(
        0, {"allocated_bytes.all.current": 3 * GiB, "reserved_bytes.all.current": 4 * GiB, "num_oom_rejections": 0}))
    assert "refused" not in quiet.verdict_why
