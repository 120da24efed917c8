"""The agent must not itself leak: its memory stays flat however many steps the job runs."""

from __future__ import annotations

import gc
import tracemalloc

import gpumemd


def _traced_bytes() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


def test_agent_memory_is_flat_over_many_steps(out_dir: str) -> None:
    with gpumemd.attached(output_dir=out_dir, sample_interval_s=0, census=False, keep_steps=200,
                          leak_window_steps=100, leak_check_every_steps=10):
        # Fill every bounded structure first: the ring, the detector's windows, the scans' count
        # history and the chain marks (they fill per sample or per scan: every 10 to 50 steps here).
        for _ in range(20_000):
            gpumemd.mark_step()
        tracemalloc.start()
        try:
            # Traced only from here: until every bounded structure has turned over once (the ring
            # of 200 sampled records, 256 chain marks taken every 10 steps), traced bytes still rise.
            for _ in range(15_000):
                gpumemd.mark_step()
            after_warm = _traced_bytes()
            for _ in range(20_000):
                gpumemd.mark_step()
            after_many = _traced_bytes()
        finally:
            tracemalloc.stop()
    # 20,000 more steps may not keep more than a few KiB (no per-step growth): a leak of even one
    # small object per step would show up as hundreds of KiB here.
    assert after_many - after_warm < 32 * 1024, (after_warm, after_many)
