"""Census cost next to the bare floor, at about 0.2M, 0.8M and 1.5M gc-tracked objects with 10k tensors.

    /work/venv/bin/python benchmarks/bench_census.py [--repeat 7] [--sizes 200000,800000,1500000]

The floor is what any live-tensor scan pays at least, measured in the same process right before:
``[o for o in gc.get_objects() if isinstance(o, torch.Tensor)]``. The census is
``take_census(models=[model], optimizers=opts, holders=0)`` over the same heap: a small MLP with
gradients, 10k loose CPU tensors (a fifth of them views, to exercise storage dedup) and, from the
second size on, Adam state (creating the first optimizer imports torch._dynamo, which alone takes
the heap past 0.2M objects, so the 0.2M heap is measured before it exists). The holder chain is
``who_holds`` on a tensor in a list that a function's local holds, and on a tensor in a list that
an object attribute holds.
Medians of ``--repeat`` runs (floor and census alternate, so load changes hit both alike); prints
a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any


def _median_s(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _interleaved_medians_s(a: Callable[[], Any], b: Callable[[], Any], repeat: int) -> tuple[float, float]:
    """Alternate the two so a change in machine load hits both alike (the box may be shared)."""
    times_a, times_b = [], []
    for _ in range(repeat):
        times_a.append(_median_s(a, 1))
        times_b.append(_median_s(b, 1))
    return statistics.median(times_a), statistics.median(times_b)


class _Trainer:
    def __init__(self) -> None:
        self.history: list[Any] = []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--sizes", default="200000,800000,1500000", help="target gc-tracked object counts")
    parser.add_argument("--tensors", type=int, default=10_000)
    args = parser.parse_args(argv)

    import torch

    from gpumemd.probes.census.census_steps import take_census
    from gpumemd.probes.holding.holders import who_holds

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    model(torch.randn(4, 64)).sum().backward()
    # Creating the first optimizer imports torch._dynamo (a large import): the smallest heap is
    # measured before that, without optimizer state; the optimizer is made before the next size.
    opts: list[Any] = []
    bases = [torch.randn(16) for _ in range(args.tensors * 4 // 5)]
    tensors: list[Any] = bases + [b[:8] for b in bases[: args.tensors // 5]]  # views: same storages
    trainer = _Trainer()
    trainer.history.extend(torch.randn(4) for _ in range(10))
    losses = [torch.randn(4) for _ in range(10)]

    filler: list[list[int]] = []
    lines: list[str | None] = []
    rows = []
    for target in (int(s) for s in args.sizes.split(",")):
        if not opts and target > 400_000:
            opt = torch.optim.Adam(model.parameters())
            opt.step()
            opts.append(opt)
        gc.collect()
        missing = target - len(gc.get_objects())
        if missing > 0:
            filler.extend([i] for i in range(missing))  # small lists: gc-tracked, cheap to make
        tracked = len(gc.get_objects())

        def floor() -> int:
            return len([o for o in gc.get_objects() if isinstance(o, torch.Tensor)])

        def census() -> Any:
            return take_census(models=[model], optimizers=opts, holders=0)

        gc.disable()  # a collection in the middle of one run would distort that run only
        try:
            floor_s, census_s = _interleaved_medians_s(floor, census, args.repeat)
            lines.clear()
            local_s = _median_s(lambda: lines.append(who_holds(losses[-1], time_budget_s=10.0)), args.repeat)
            attr_s = _median_s(
                lambda: lines.append(who_holds(trainer.history[-1], time_budget_s=10.0)), args.repeat
            )
            local_line, attr_line = lines[0], lines[-1]
        finally:
            gc.enable()
        result = census()
        rows.append((tracked, result.tensor_count, floor_s, census_s, local_s, attr_s, local_line, attr_line))
        del result

    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, repeat {args.repeat} (median)\n")
    print("| gc-tracked objects | storages counted | floor: get_objects + isinstance | census "
          "| census / floor | holder: frame local | holder: attribute |")
    print("|---|---|---|---|---|---|---|")
    for tracked, storages, floor_s, census_s, local_s, attr_s, _, _ in rows:
        print(f"| {tracked / 1e6:.2f} M | {storages:,} | {floor_s * 1e3:.0f} ms | {census_s * 1e3:.0f} ms "
              f"| {census_s / floor_s:.2f}x | {local_s * 1e3:.0f} ms | {attr_s * 1e3:.0f} ms |")
    print(f"\nholder lines: {rows[-1][6]!r}; {rows[-1][7]!r}")
    del tensors, filler
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
