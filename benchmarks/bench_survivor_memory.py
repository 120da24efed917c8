"""Memory of the long-lived tensor tracker per tracked tensor (what ``survivors.MAX_TRACKED`` costs).

    python benchmarks/bench_survivor_memory.py            # 50,000 tensors
    python benchmarks/bench_survivor_memory.py 200000     # the default cap

Keeps N small CPU tensors alive, made in batches of 500 with a scan after each (as a job leaking
tensors between scans), and reads tracemalloc's traced bytes before and after, by source line. The
tensors' own Python objects (measured apart, the same N tensors with no tracker) are subtracted. The
Python storage object torch keeps once a tensor is sized (``untyped_storage()``) is shown apart: it
lives as long as the tensor. A measurement: prints its figures and exits 0.
"""

from __future__ import annotations

import gc
import sys
import tracemalloc

import torch

from gpumemd.probes.survival.survivors import SurvivorTracker


def _made(n: int, tracker: SurvivorTracker | None) -> tuple[int, list[torch.Tensor], tracemalloc.Snapshot]:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    keep: list[torch.Tensor] = []
    for _ in range(n // 500 + 1):
        keep.extend(torch.empty(3) for _ in range(500))
        if tracker is not None:
            tracker.scan()
    if tracker is not None:
        tracker.scan()
        tracker.scan()
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    snapshot = tracemalloc.take_snapshot()
    tracemalloc.stop()
    return used, keep, snapshot


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 50_000
    torch.set_num_threads(1)
    alone, keep, _ = _made(n, None)
    del keep
    tracker = SurvivorTracker(max_tracked=n)
    tracker.install()
    used, _kept, snapshot = _made(n, tracker)  # alive until the figures are read
    tracked, _ = tracker.counts.total()
    storage = sum(s.size for s in snapshot.statistics("lineno")
                  if "survivors.py" in s.traceback[0].filename and "untyped_storage" in _line(s))
    print(f"tensors tracked: {tracked:,} (capped: {tracker.counts.capped})")
    print(f"tracker, per tensor:        {(used - alone - storage) / tracked:6.0f} B")
    print(f"storage objects, per tensor: {storage / tracked:6.0f} B (torch's; freed with the tensor)")
    print(f"at the default cap (200,000): ~{(used - alone) / tracked * 200_000 / 1e6:.0f} MB")
    tracker.uninstall()


def _line(stat: tracemalloc.Statistic) -> str:
    import linecache

    frame = stat.traceback[0]
    return linecache.getline(frame.filename, frame.lineno)


if __name__ == "__main__":
    main()
