"""What one action at a sampled step end costs the job beyond the time it takes: its "not clocked" part.

Usage: python benchmarks/bench_unclocked.py [--actions none pread pread5 busy] [--hidden 440] [--seconds 30]

The job: ``bench_leak_tracking.py``'s MLP (AdamW, batch 64; width 440 is ~1-2 ms a step on a 2-core VM),
no agent. In rounds of three 21-step blocks in random order, the "on" block runs the action after every
10th step (as the agent's stride does) and two "off" blocks do not; per round, on minus the mean of
the offs, per step. The action's own time is clocked around it, so ``wall - clocked`` is what it left
to the job's next steps (caches, TLB, a system call's exit). Actions: ``none`` (the method's zero),
``pread`` (one read of a kept-open ``/proc/self/statm``, as a quick step end does), ``pread5`` (five in a
row), ``busy`` (a 30 µs busy wait: clocked, and should leave nothing).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _actions() -> dict[str, Callable[[], None]]:
    fd = os.open("/proc/self/statm", os.O_RDONLY)

    def none() -> None:
        pass

    def pread() -> None:
        os.pread(fd, 128, 0)

    def pread5() -> None:
        for _ in range(5):
            os.pread(fd, 128, 0)

    def busy() -> None:
        until = time.perf_counter() + 30e-6
        while time.perf_counter() < until:
            pass

    return {"none": none, "pread": pread, "pread5": pread5, "busy": busy}


def measure(step: Callable[[], None], action: Callable[[], None], seconds: float, rng: random.Random
            ) -> tuple[float, float, float, int]:
    """(wall µs/step, its standard error, clocked µs/step, rounds)."""
    pc = time.perf_counter
    diffs: list[float] = []
    clocked: list[float] = []
    order = [0, 1, 2]
    deadline = pc() + seconds
    while pc() < deadline:
        rng.shuffle(order)
        took = {}
        acted = 0.0
        for kind in order:
            t0 = pc()
            for i in range(21):
                step()
                if kind == 0 and i % 10 == 9:
                    a = pc()
                    action()
                    acted += pc() - a
            took[kind] = pc() - t0
        diffs.append((took[0] - (took[1] + took[2]) / 2) / 20)
        clocked.append(acted / 20)
    se = statistics.stdev(diffs) / len(diffs) ** 0.5
    return statistics.fmean(diffs) * 1e6, se * 1e6, statistics.fmean(clocked) * 1e6, len(diffs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--actions", nargs="+", default=["none", "pread", "pread5", "busy"])
    ap.add_argument("--hidden", type=int, default=440)
    ap.add_argument("--seconds", type=float, default=30.0)
    args = ap.parse_args()
    import torch
    from bench_leak_tracking import make_job

    torch.set_num_threads(1)
    step = make_job(args.hidden, True, 64)
    for _ in range(300):
        step()
    t0 = time.perf_counter()
    for _ in range(100):
        step()
    print(f"MLP width {args.hidden}: {(time.perf_counter() - t0) * 10:.2f} ms a step; the action after every 10th\n")
    print("| action | wall µs/step (mean ± s.e.) | clocked µs/step | not clocked | rounds |\n|---|---|---|---|---|")
    actions = _actions()
    rng = random.Random(0)
    for name in args.actions:
        wall, se, clocked, rounds = measure(step, actions[name], args.seconds, rng)
        print(f"| {name} | {wall:+.1f} ± {se:.1f} | {clocked:.2f} | {wall - clocked:+.1f} | {rounds} |", flush=True)


if __name__ == "__main__":
    main()
