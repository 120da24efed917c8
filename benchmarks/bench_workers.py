"""The cost of following the job's worker processes and growing tensors, on the training thread.

    python benchmarks/bench_workers.py

1. Workers: with 4 child processes alive (sleepers standing in for DataLoader workers), the per-step
   read (``WorkersProbe.rss``: the training thread's children file and each child's statm, kept open)
   is timed; the agent makes it once every ``WORKERS_EVERY`` steps, and only on sampled steps (a step
   that does not sample costs one counter decrement, as before). Reported: µs per read, µs per step
   amortized, and its share of a 10 ms and a 1 ms step. The sampler thread's full reading (USS and PSS
   from smaps_rollup) is timed too: it runs off the training thread, every ``sample_interval_s``.
2. Growing tensors: one family pass (``TensorFamilies.observe``) over the tensors a survivor scan
   lists in a typical step (30 young tensors), which runs on scan steps only (every 10 to 50 steps).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import torch

from gpumemd.probes.process.workers import WorkersProbe
from gpumemd.probes.survival.tensor_families import TensorFamilies
from gpumemd.step_reading import WORKERS_EVERY


def _timed(fn: object, n: int) -> float:
    """Median of 7 runs of ``n`` calls, in seconds per call."""
    runs = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(n):
            fn()  # type: ignore[operator]
        runs.append((time.perf_counter() - start) / n)
    return statistics.median(runs)


def workers_table() -> None:
    children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) for _ in range(4)]
    probe = WorkersProbe()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            sample = probe.rss()
            if sample is not None and len(sample.workers) == 4:
                break
        per_read = _timed(probe.rss, 2_000)
        full = _timed(probe.read, 20)
    finally:
        for child in children:
            child.kill()
            child.wait()
        probe.close()
    per_step = per_read / WORKERS_EVERY
    print(f"workers (4 children): per-step read {per_read * 1e6:.1f} µs, once every {WORKERS_EVERY} steps = "
          f"{per_step * 1e6:.2f} µs/step = {per_step / 0.010:.4%} of a 10 ms step, "
          f"{per_step / 0.001:.3%} of a 1 ms step")
    print(f"workers (4 children): sampler thread's full reading (RSS, USS, PSS) {full * 1e3:.2f} ms, off the "
          "training thread")


def families_table() -> None:
    families = TensorFamilies()
    young = [torch.zeros(32, 128), torch.zeros(32, 16), torch.zeros(()), *(torch.zeros(128, 128) for _ in range(4)),
             *(torch.zeros(128) for _ in range(4)), *(torch.zeros(64, 10) for _ in range(19))]
    step = [0]

    def scan() -> None:
        step[0] += 10
        families.observe(young, step[0])

    per_scan = _timed(scan, 2_000)
    print(f"growing tensors: one family pass over {len(young)} young tensors {per_scan * 1e6:.1f} µs per scan "
          f"({per_scan / 10 * 1e6:.2f} µs/step at the most frequent scan, every 10 steps)")


if __name__ == "__main__":
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    workers_table()
    families_table()
