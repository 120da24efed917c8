"""Soak: the agent's own memory stays bounded over a long job (issue 11: 1M steps).

    python benchmarks/soak_leak.py                 # 1,000,000 steps (~10 minutes here, tracemalloc on)
    python benchmarks/soak_leak.py --steps 200000

A tiny real training step (a 4x4 linear layer, SGD) under ``gpumemd.attach()`` at its defaults; at
checkpoints it prints what the agent holds: the step ring, the detector's series and block floors,
the survivor tracker's weakrefs and groups, the graph chains, the kept censuses, the findings, and
the Python heap the agent's modules allocated (tracemalloc, filtered to gpumemd's files). Bounded
means these stop growing once the ring is full.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
import tracemalloc

import torch

import gpumemd
from gpumemd.components.census_component import CensusComponent
from gpumemd.components.leak import LeakComponent


def _sizes(agent: gpumemd.Agent) -> dict[str, int]:
    leak = agent.component(LeakComponent)
    census = agent.component(CensusComponent)
    parts = leak._parts  # type: ignore[union-attr]
    assert parts is not None  # the agent is running
    detector = parts.series.detector
    tracker = parts.tracker
    chains = parts.chains
    floors = sum(len(t.floors) for t in detector._tracks.values())
    return {
        "ring": len(agent.steps()),
        "series": len(detector._tracks),
        "floors": floors,
        "tracked tensors": len(tracker.counts.refs) if tracker else 0,
        "tensor groups": len(tracker.counts._counts) if tracker else 0,
        "chains": len(chains._chains) if chains else 0,
        "chain marks": len(chains._marks) if chains else 0,
        "past counts": len(parts.series.scans.counts.count_past) + len(parts.series.scans.chain_nodes.count_past),
        "censuses kept": len(census.recent_censuses()) if census is not None else 0,  # type: ignore[attr-defined]
        "findings": len(agent.findings()),
        "samples": agent.samples_total,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--checkpoints", type=int, default=5)
    args = parser.parse_args()
    logging.getLogger("gpumemd").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(2, 4)
    tracemalloc.start()
    filters = [tracemalloc.Filter(True, "*gpumemd*")]
    every = max(1, args.steps // args.checkpoints)
    start = time.perf_counter()
    print("| step | agent heap (tracemalloc) | sizes |")
    print("|---|---|---|")
    with gpumemd.attached(output_dir=tempfile.mkdtemp(prefix="gpumemd-soak-")) as agent:
        for step in range(1, args.steps + 1):
            loss = model(x).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % every == 0:
                snap = tracemalloc.take_snapshot().filter_traces(filters)
                heap = sum(s.size for s in snap.statistics("filename"))
                print(f"| {step:,} | {heap / 1024:,.0f} KiB | {_sizes(agent)} |", flush=True)
        own = agent.overhead()
    took = time.perf_counter() - start
    print(f"\n{args.steps:,} steps in {took:.0f} s; the agent's own time {own.seconds_per_step * 1e6:.1f} µs/step")


if __name__ == "__main__":
    main()
