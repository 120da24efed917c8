"""What the agent's optimizer hook costs every step, on its own: the part of the fixed cost nobody clocks.

Usage: python benchmarks/bench_step_hook.py [--rounds 5000] [--hidden 8]

The job is bench_step_overhead.py's fastest (a linear classifier, SGD, batch 8, one intra-op thread). Each
round runs one 20-step block per variant in a random order: no hook, a no-op global optimizer post-hook,
and the hook ``StepClock.install_hook`` registers, on its fast path (the clock's primary optimizer is the
job's, and no sample is due within the run). Per round, each variant's mean step minus the no-hook block's;
printed: the mean over rounds with its standard error. ``PYTHONPATH=DIR`` measures the step clock in DIR.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

BLOCK = 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5000)
    parser.add_argument("--hidden", type=int, default=8)
    args = parser.parse_args()

    import torch
    from bench_step_overhead import make_job
    from torch.optim.optimizer import _global_optimizer_post_hooks, register_optimizer_step_post_hook

    import gpumemd
    from gpumemd.step_clock import StepClock

    torch.set_num_threads(1)
    made: list[torch.optim.Optimizer] = []
    original = torch.optim.SGD.__init__

    def keep(self: Any, *a: Any, **k: Any) -> None:  # the job's optimizer, to make it the clock's primary
        original(self, *a, **k)
        made.append(self)

    torch.optim.SGD.__init__ = keep  # type: ignore[method-assign]
    step = make_job(args.hidden, 8, sgd=True, linear=True)
    torch.optim.SGD.__init__ = original  # type: ignore[method-assign]
    clock = StepClock(lambda _: None, lambda: True)
    clock._other_step(made[0])  # the primary optimizer: its steps take the hook's fast path
    clock.until_sample = 1 << 40  # no sample due within the run
    clock.install_hook()
    handle = clock._hook_handle
    agent_hook = _global_optimizer_post_hooks[handle.id]
    handle.remove()

    def no_op(optimizer: Any, a: Any, k: Any) -> None:
        pass

    variants: dict[str, Callable[..., None] | None] = {"none": None, "no-op hook": no_op, "agent's hook": agent_hook}
    for _ in range(2000):
        step()
    diffs: dict[str, list[float]] = {name: [] for name in variants}
    plain: list[float] = []  # the no-hook block's mean step, per round
    for _ in range(args.rounds):
        order = list(variants)
        random.shuffle(order)
        took: dict[str, float] = {}
        for name in order:
            hook = variants[name]
            registered = register_optimizer_step_post_hook(hook) if hook is not None else None
            start = time.perf_counter()
            for _ in range(BLOCK):
                step()
            took[name] = (time.perf_counter() - start) / BLOCK
            if registered is not None:
                registered.remove()
        plain.append(took["none"])
        for name in variants:
            diffs[name].append(took[name] - took["none"])
    print(f"gpumemd from {Path(gpumemd.__file__).parent}; torch {torch.__version__}; job step "
          f"{statistics.median(plain) * 1e3:.3f} ms; {args.rounds:,} rounds of {BLOCK}-step blocks; the agent's "
          f"hook counted {clock.steps_total - 1:,} steps")
    for name in ("no-op hook", "agent's hook"):
        values = diffs[name]
        se = statistics.stdev(values) / len(values) ** 0.5
        print(f"{name}: {statistics.fmean(values) * 1e6:+.2f} ± {se * 1e6:.2f} µs a step over no hook")


if __name__ == "__main__":
    main()
