"""Time to write one OOM report on the crash path: 10k live tensors and a 100k-entry allocation history.

Usage: python benchmarks/bench_oom_report.py [--tensors 10000] [--history 100000] [--steps 500] [--rounds 5]

A real CPU job holds ``--tensors`` live tensors (a model plus a list of activations-like tensors) and
has run ``--steps`` steps (the timeline). The CUDA side cannot run here, so the snapshot is a
hand-built dict in PyTorch's exact format (TORCH_MEMORY_API.md §2.2) with ``--history`` trace entries,
each with a 3-frame Python stack, as ``_record_memory_history(max_entries=100_000)`` would leave it; a
probe hands it to the OOM observer, which is then called as PyTorch calls it. Each round times
``OomComponent.handle`` end to end: census at the OOM, snapshot summary, report.json/md/html, the
snapshot pickle, fsync and the atomic rename. Prints a markdown table (median and max of the rounds).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from gpumemd.api import build_agent
from gpumemd.components.census_component import CensusComponent, CensusOptions
from gpumemd.components.oom_component import OomComponent, OomOptions
from gpumemd.config import Config
from gpumemd.probes.census.census_steps import census_steps
from gpumemd.probes.snapshots.snapshot import SnapshotProbe

MiB = 2**20
MESSAGE = ("CUDA out of memory. Tried to allocate 512.00 MiB. GPU 0 has a total capacity of 79.10 GiB of which "
           "100.00 MiB is free. Of the allocated memory 70.00 GiB is allocated by PyTorch, and 8.00 GiB is "
           "reserved by PyTorch but unallocated.")


def make_snapshot(history: int, segments: int = 400, blocks_per_segment: int = 25) -> dict[str, Any]:
    frames = [{"filename": f"/job/model_{i}.py", "line": 40 + i, "name": "forward"} for i in range(3)]
    segs = []
    address = 0x7F00_0000_0000
    for s in range(segments):
        blocks = []
        at = address
        for b in range(blocks_per_segment):
            size = 2 * MiB
            state = "inactive" if b % 5 == 4 else "active_allocated"
            blocks.append({"address": at, "size": size, "requested_size": size - 64, "state": state,
                           "frames": frames if state != "inactive" else []})
            at += size
        total = at - address
        allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
        segs.append({"device": 0, "address": address, "total_size": total, "allocated_size": allocated,
                     "active_size": allocated, "requested_size": allocated, "stream": 0,
                     "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": False,
                     "frames": [], "blocks": blocks})
        address = at + 4096 * (s + 1)
    actions = ("alloc", "free_requested", "free_completed")
    trace = [{"action": actions[i % 3], "addr": 0x7F00_0000_0000 + (i // 3 % 1000) * MiB, "size": MiB,
              "stream": 0, "time_us": 1_763_700_000_000_000 + i, "compile_context": "N/A",
              "user_metadata": "", "frames": frames} for i in range(history - 1)]
    trace.append({"action": "oom", "size": 512 * MiB, "device_free": 100 * MiB, "stream": 0,
                  "time_us": 1_763_700_000_000_000 + history, "compile_context": "N/A", "user_metadata": "",
                  "frames": frames})
    return {"segments": segs, "device_traces": [trace], "allocator_settings": {"expandable_segments": False},
            "external_annotations": []}


class BenchProbe(SnapshotProbe):
    def __init__(self, snapshot: dict[str, Any]) -> None:
        super().__init__(torch_module=object())
        self.snapshot = snapshot
        self.observers: list[Any] = []

    def cuda_initialized(self) -> bool:
        return True

    def capture(self) -> dict[str, Any] | None:
        return self.snapshot

    def memory_summary(self, device: int) -> str | None:
        return "(memory_summary text)"

    def attach_oom_observer(self, observer: Any) -> bool:
        self.observers.append(observer)
        return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=10_000)
    parser.add_argument("--history", type=int, default=100_000)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    live_params = sum(1 for _ in model.parameters()) * 4  # params, grads, two moments
    kept = [torch.randn(16, 16) for _ in range(max(0, args.tensors - live_params))]
    snapshot = make_snapshot(args.history)
    probe = BenchProbe(snapshot)
    out = tempfile.mkdtemp(prefix="gpumemd-bench-oom-")
    config = Config(output_dir=out, sample_interval_s=0, nvml=False, census=False, leak_detection=False,
                    oom_cooldown_s=0, oom_max_reports=args.rounds + 1, keep_steps=args.steps)
    census = CensusComponent(config.options(CensusOptions), census_fn=census_steps)
    component = OomComponent(config.options(OomOptions), snapshot_probe=probe, census=census)
    agent = build_agent(config, model=model, optimizer=opt, components=[component]).start()
    try:
        for _ in range(args.steps):  # the timeline; a real step is cheap here, the report is what we time
            model(torch.randn(4, 64)).sum().backward()
            opt.step()
        times = []
        for _ in range(args.rounds):
            probe.observers[0](0, 512 * MiB, 79 * 2**30, 100 * MiB)  # PyTorch's call, before the raise
            exc = torch.cuda.OutOfMemoryError(MESSAGE)
            start = time.perf_counter()
            path = component.handle(exc, source="bench")
            times.append(time.perf_counter() - start)
            assert isinstance(path, str), "no report written"
        census = agent.state().census
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    finally:
        agent.stop()
    del kept
    print("| live tensors (census) | history entries | timeline steps | report size | median | max |")
    print("|---|---|---|---|---|---|")
    print(f"| {census.tensor_count if census else '?'} | {args.history} | {min(args.steps, config.keep_steps)} "
          f"| {size / MiB:.1f} MiB | {statistics.median(times):.2f} s | {max(times):.2f} s |")


if __name__ == "__main__":
    main()
