"""A hand-made CUDA allocator snapshot in exactly the shape ``torch.cuda.memory._snapshot()`` returns
(TORCH_MEMORY_API.md §2.2), and the real-format OOM messages of both generations (§4.3)."""

from __future__ import annotations

from typing import Any

MiB = 2**20
GiB = 2**30
SEG_A = 0x7F00_0000_0000
SEG_B = 0x7F00_4000_0000
FRAMES = [
    {"filename": "/job/model.py", "line": 40, "name": "forward"},
    {"filename": "/job/train.py", "line": 88, "name": "train_step"},
]

# torch 2.13 wording (format of PR #99699), as the allocator builds it with format_size.
NEW_MESSAGE = (
    "CUDA out of memory. Tried to allocate 8.00 MiB. GPU 0 has a total capacity of 79.10 GiB of which "
    "3.00 MiB is free. Process 4242 has 79.09 GiB memory in use. Including non-PyTorch memory, this process "
    "has 79.09 GiB memory in use. Of the allocated memory 76.25 GiB is allocated by PyTorch, with 1.00 GiB "
    "allocated in private pools (e.g., CUDA Graphs), and 2.12 GiB is reserved by PyTorch but unallocated. "
    "If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
    "to avoid fragmentation.  See documentation for Memory Management  "
    "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)
OLD_MESSAGE = (
    "CUDA out of memory. Tried to allocate 152.00 MiB (GPU 0; 31.72 GiB total capacity; 24.89 GiB already "
    "allocated; 6.12 MiB free; 30.70 GiB reserved in total by PyTorch) If reserved memory is >> allocated "
    "memory try setting max_split_size_mb to avoid fragmentation.  See documentation for Memory Management "
    "and PYTORCH_CUDA_ALLOC_CONF"
)
CPU_MESSAGE = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
    "allocate 1152921504606846976 bytes. Error code 12 (Cannot allocate memory)"
)


def _block(size: int, state: str, requested: int | None = None, frames: bool = True) -> dict[str, Any]:
    return {"address": 0, "size": size, "requested_size": requested if requested is not None else size,
            "state": state, "frames": list(FRAMES) if frames and state != "inactive" else []}


def _segment(address: int, blocks: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    at = address
    for b in blocks:  # block addresses: the segment address plus the sizes before them
        b["address"] = at
        at += b["size"]
    active = [b for b in blocks if b["state"] != "inactive"]
    return {
        "device": 0,
        "address": address,
        "total_size": sum(b["size"] for b in blocks),
        "allocated_size": sum(b["size"] for b in blocks if b["state"] == "active_allocated"),
        "active_size": sum(b["size"] for b in active),
        "requested_size": sum(b["requested_size"] for b in active),
        "stream": 0,
        "segment_type": kind,
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "frames": [],
        "blocks": blocks,
    }


def make_snapshot(history: int = 0) -> dict[str, Any]:
    """20 MiB large segment (14 MiB allocated, free holes of 4 and 2 MiB) + a 2 MiB small segment.

    The last trace entry is the OOM for an 8 MiB request with 3 MiB free on the device: the cache
    holds 6 MiB + ~2 MiB free, but no single block of 8 MiB (fragmentation). ``history`` pads the
    trace with that many extra alloc/free_requested/free_completed entries.
    """
    seg_a = _segment(SEG_A, [
        _block(8 * MiB, "active_allocated", 8 * MiB - 100),
        _block(4 * MiB, "inactive"),
        _block(6 * MiB, "active_allocated"),
        _block(2 * MiB, "inactive"),
    ], "large")
    seg_b = _segment(SEG_B, [
        _block(512, "active_allocated", 400),
        _block(2 * MiB - 512, "inactive"),
    ], "small")
    t0 = 1_763_700_000_000_000

    def entry(action: str, addr: int, size: int, n: int, frames: bool = True) -> dict[str, Any]:
        e: dict[str, Any] = {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t0 + n,
                             "compile_context": "N/A", "user_metadata": ""}
        if frames:
            e["frames"] = list(FRAMES)
        return e

    trace = [
        entry("segment_alloc", SEG_A, 20 * MiB, 0),
        entry("alloc", SEG_A, 8 * MiB, 1),
        entry("alloc", SEG_A + 12 * MiB, 6 * MiB, 2),
        entry("segment_alloc", SEG_B, 2 * MiB, 3),
        entry("alloc", SEG_B, 512, 4),
    ]
    scratch = SEG_A + 8 * MiB
    for n in range(history // 3):
        trace.append(entry("alloc", scratch, 4 * MiB, 10 + 3 * n))
        trace.append(entry("free_requested", scratch, 4 * MiB, 11 + 3 * n))
        trace.append(entry("free_completed", scratch, 4 * MiB, 12 + 3 * n))
    trace.append({"action": "oom", "size": 8 * MiB, "device_free": 3 * MiB, "stream": 0,
                  "time_us": t0 + 10 + history, "compile_context": "N/A", "user_metadata": "",
                  "frames": list(FRAMES)})
    return {
        "segments": [seg_a, seg_b],
        "device_traces": [trace],
        "allocator_settings": {
            "PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1, "garbage_collection_threshold": 0.0,
            "expandable_segments": False, "pinned_num_register_threads": 1,
            "release_lock_on_cudamalloc": False, "pinned_use_cuda_host_register": False,
            "roundup_power2_divisions": {"1": 0, "2": 0, "4": 0},
        },
        "external_annotations": [],
    }
