"""Fragmentation is what ``empty_cache()`` cannot release.

``reserved − allocated`` also counts whole cached segments, which the allocator frees and retries with
before it raises an OOM; the non-releasable part is ``inactive_split_bytes.all.current``. torch does not
count blocks of expandable segments there (pytorch/pytorch#159564: it reads 0), so under
``expandable_segments:True`` gpumemd reports no figure at all. A free block serves a large request only
from the large pool and on its own stream. Data in torch's shapes: ``memory_stats`` dicts and
``torch.cuda.memory._snapshot()`` dicts (TORCH_MEMORY_API.md §1.1, §2.2).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from gpumemd.analysis.breakdown import cuda_breakdown
from gpumemd.analysis.snapshot_summary import summarize_snapshot
from gpumemd.api import build_agent
from gpumemd.components.leak import LeakComponent, LeakOptions
from gpumemd.config import Config
from gpumemd.probes.device.allocation_history import AllocationHistory
from gpumemd.probes.device.allocator import AllocatorProbe, expandable_segments_from_env
from gpumemd.records.device import Device
from gpumemd.records.oom import ObserverCall
from gpumemd.records.step import Identity

MiB, GiB = 2**20, 2**30
SIDE_STREAM = 94_000_000_000_000  # a cudaStream_t as the snapshot writes it (an int)


def stats(*, cached: int = 0, split: int = 0) -> dict[str, int]:
    """``memory_stats`` of a job with 4 GiB allocated, ``cached`` bytes in whole cached segments and
    ``split`` bytes in inactive split blocks."""
    allocated = 4 * GiB
    reserved = allocated + cached + split
    return {"allocated_bytes.all.current": allocated, "allocated_bytes.all.peak": allocated + GiB,
            "reserved_bytes.all.current": reserved, "reserved_bytes.all.peak": reserved,
            "active_bytes.all.current": allocated, "inactive_split_bytes.all.current": split,
            "inactive_split.all.current": 1 if split else 0, "segment.all.current": 8, "segment.all.allocated": 8}


def probe(stats_fn: Any, environ: dict[str, str] | None = None) -> AllocatorProbe:
    return AllocatorProbe(stats_fn=stats_fn, is_initialized=lambda: True, device_count=lambda: 1,
                          backend_fn=lambda: "native", environ=environ or {})


@pytest.mark.parametrize(("environ", "expandable"), [
    ({}, False),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True),
    ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:128,expandable_segments:True"}, True),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False", "PYTORCH_ALLOC_CONF": "expandable_segments:True"},
     False),  # torch reads the CUDA variable first
    ({"PYTORCH_CUDA_ALLOC_CONF": "roundup_power2_divisions:[256:1,512:2,>:8],expandable_segments:true"}, True),
])
def test_inactive_split_is_absent_under_expandable_segments(environ: dict[str, str], expandable: bool) -> None:
    assert expandable_segments_from_env(environ) is expandable
    p = probe(lambda d: stats(split=0), environ)
    [sample] = p.read()
    assert p.expandable_segments is expandable
    # torch's 0 there is not a measurement: absent, like cudaMallocAsync's
    assert sample.inactive_split_bytes == (None if expandable else 0)
    assert sample.reserved_bytes == 4 * GiB


# --- the leak detector's fragmentation series ---------------------------------------------------------


class NoHistory:
    def __init__(self) -> None:
        self.cuda = SimpleNamespace(memory=SimpleNamespace(_record_memory_history=lambda *a, **k: None))
        self._C = SimpleNamespace()


def findings(tmp_path: Any, grow: str, environ: dict[str, str] | None = None) -> set[tuple[str, str]]:
    """Leak findings after 300 steps whose ``grow`` part (cached or split) rises 1 MiB/step from step 60."""
    step = {"n": 0}

    def stats_fn(device: int) -> dict[str, int]:
        grown = max(0, step["n"] - 60) * MiB
        return stats(**{grow: grown})

    config = Config(output_dir=str(tmp_path), sample_interval_s=0, census=False, nvml=False, leak_warmup_steps=20,
                    leak_window_steps=100, leak_check_every_steps=10, leak_min_bytes_per_step=256 * 1024)
    component = LeakComponent(config.options(LeakOptions), census=None, snapshot_fn=lambda: {"segments": []},
                              history=AllocationHistory(NoHistory()))
    agent = build_agent(config, allocator_probe=probe(stats_fn, environ), identity=Identity(rank=0, world_size=1),
                        components=[component], max_stride=1)
    agent.start()
    try:
        for n in range(300):
            step["n"] = n
            agent.mark_step(n)
        return {(f.kind, f.series) for f in agent.findings()}
    finally:
        agent.stop()


def test_a_growing_releasable_cache_is_not_fragmentation(tmp_path: Any) -> None:
    # reserved − allocated grows 1 MiB/step in whole cached segments: empty_cache() (or the allocator's
    # own retry before an OOM) gives it back. Nothing to report.
    assert findings(tmp_path, "cached") == set()


def test_growing_split_blocks_are_fragmentation(tmp_path: Any) -> None:
    assert findings(tmp_path, "split") == {("fragmentation", "inactive_split_bytes{device=0}")}


def test_no_fragmentation_finding_under_expandable_segments(tmp_path: Any) -> None:
    # torch reports inactive_split 0 there whatever happens; the cache growth is not a finding either
    assert findings(tmp_path, "cached", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}) == set()


# --- the largest free block at an OOM -------------------------------------------------------------------


def _block(size: int, state: str) -> dict[str, Any]:
    return {"address": 0, "size": size, "requested_size": size if state != "inactive" else 0, "state": state,
            "frames": []}


def _segment(address: int, stream: int, kind: str, blocks: list[dict[str, Any]]) -> dict[str, Any]:
    at = address
    for b in blocks:
        b["address"] = at
        at += b["size"]
    active = [b for b in blocks if b["state"] != "inactive"]
    return {"device": 0, "address": address, "total_size": sum(b["size"] for b in blocks),
            "allocated_size": sum(b["size"] for b in active), "active_size": sum(b["size"] for b in active),
            "requested_size": sum(b["requested_size"] for b in active), "stream": stream, "segment_type": kind,
            "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": blocks}


def snapshot(oom_stream: int | None) -> dict[str, Any]:
    """Default stream: a 20 MiB large segment with a 1 MiB hole, a 2 MiB small-pool segment almost
    free; a side stream: a segment with a 64 MiB free block. The OOM is an 8 MiB request."""
    segments = [
        _segment(0x7F0000000000, 0, "large", [_block(19 * MiB, "active_allocated"), _block(MiB, "inactive")]),
        _segment(0x7F0002000000, 0, "small", [_block(512, "active_allocated"), _block(2 * MiB - 512, "inactive")]),
        _segment(0x7F0010000000, SIDE_STREAM, "large", [_block(64 * MiB, "inactive"), _block(MiB, "active_allocated")]),
    ]
    trace: list[dict[str, Any]] = []
    if oom_stream is not None:
        trace.append({"action": "oom", "size": 8 * MiB, "device_free": 3 * MiB, "stream": oom_stream,
                      "time_us": 1_763_700_000_000_000, "compile_context": "N/A", "user_metadata": ""})
    return {"segments": segments, "device_traces": [trace], "allocator_settings": {"expandable_segments": False},
            "external_annotations": []}


def test_largest_free_block_is_large_pool_on_the_failing_stream() -> None:
    summary = summarize_snapshot(snapshot(oom_stream=0))[Device.cuda(0)]
    assert summary.largest_free_block_bytes == MiB  # not the small pool's ~2 MiB, not the side stream's 64 MiB
    assert summary.inactive_bytes == MiB + 2 * MiB - 512 + 64 * MiB  # all free blocks still count as free
    assert summarize_snapshot(snapshot(oom_stream=SIDE_STREAM))[Device.cuda(0)].largest_free_block_bytes == 64 * MiB
    # no OOM entry (a snapshot taken at report time): the stream is unknown, any large-pool block counts
    assert summarize_snapshot(snapshot(oom_stream=None))[Device.cuda(0)].largest_free_block_bytes == 64 * MiB


def test_the_fragmentation_verdict_names_the_usable_block() -> None:
    summary = summarize_snapshot(snapshot(oom_stream=0))[Device.cuda(0)]
    b = cuda_breakdown(device=Device.cuda(0), snapshot=summary,
                       observer=ObserverCall(Device.cuda(0), 8 * MiB, 80 * GiB, 3 * MiB, wall_time=0.0))
    assert b.verdict == "fragmentation" and b.largest_free_block_bytes == MiB
    assert "the largest free block was 1.00 MiB" in b.verdict_why
