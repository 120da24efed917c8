"""Holder paths on a large heap: how long ``who_holds`` pauses the caller for each kind of path, at about
1M gc-tracked objects, with the leak component's budget (``HOLDER_BUDGET_S``).

    python benchmarks/bench_holder_paths.py [--objects 1000000] [--repeat 5]

Each path is a realistic leak, looked up from its newest item (which the locals reach downwards,
without a heap scan) and from its oldest (which takes heap scans): a list of ``functools.partial``
callbacks, of closures, of exceptions that keep their frames, of numpy arrays sharing a tensor's
storage (the gc does not track arrays), a forward hook's closure on a module, a deque three
attributes down, a dict attribute and a plain list. The heap is filled with small gc-tracked lists
(cheap to make) after the leaks are made. Prints one markdown row per path: the median and the worst pause over
``--repeat`` look-ups, the longest single heap scan, and the line (a cut path says so).
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any


class _Stats:
    def __init__(self) -> None:
        self.window: collections.deque[Any] = collections.deque()


class _Trainer:
    def __init__(self) -> None:
        self.stats = _Stats()
        self.attn_maps: dict[int, Any] = {}


def _make_report(value: Any) -> Callable[[], float]:
    return lambda: float(value.sum())


def _failing(value: Any) -> None:
    act = value + 1
    raise RuntimeError(act.shape)


def _attach_probe(model: Any) -> None:
    acts: list[Any] = []
    model[1].register_forward_hook(lambda module, inputs, output: acts.append(output.detach()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--objects", type=int, default=1_000_000, help="gc-tracked objects to fill the heap to")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--items", type=int, default=500, help="leaked objects per container")
    args = parser.parse_args(argv)

    import torch

    from gpumemd.probes.holding import holders

    n = args.items
    callbacks = [functools.partial(print, torch.zeros(4)) for _ in range(n)]
    reports = [_make_report(torch.zeros(4)) for _ in range(n)]
    errors: list[BaseException] = []
    for _ in range(n):
        try:
            _failing(torch.zeros(4))
        except RuntimeError as exc:
            errors.append(exc)
    arrays = [torch.zeros(4).numpy() for _ in range(n)]
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    _attach_probe(model)
    for _ in range(n):
        model(torch.zeros(1, 4))
    trainer = _Trainer()
    trainer.stats.window.extend(torch.zeros(4) for _ in range(n))
    trainer.attn_maps.update((i, torch.zeros(4)) for i in range(n))
    losses = [torch.zeros(4) for _ in range(n)]

    def hook_tensor() -> Any:
        fn = next(iter(model[1]._forward_hooks.values()))
        return fn.__closure__[0].cell_contents[-1]

    def frame_local(index: int = -1) -> Any:
        tb = errors[index].__traceback__
        assert tb is not None and tb.tb_next is not None
        return next(o for o in gc.get_referents(tb.tb_next.tb_frame) if isinstance(o, torch.Tensor))

    targets: list[tuple[str, Callable[[], Any]]] = [
        ("list of partials", lambda: callbacks[-1].args[0]),
        ("list of closures", lambda: reports[-1].__closure__[0].cell_contents),  # type: ignore[index]
        ("exceptions keeping frames", frame_local),
        ("numpy arrays (untracked)", lambda: arrays[-1].base),
        ("forward hook closure", hook_tensor),
        ("deque 3 attributes down", lambda: trainer.stats.window[-1]),
        ("dict attribute", lambda: trainer.attn_maps[n - 1]),
        ("plain list", lambda: losses[-1]),
        # the oldest item: beyond what the locals are followed down to (their newest items), so the
        # climb scans the heap until it meets them
        ("list of partials, oldest item", lambda: callbacks[0].args[0]),
        ("list of closures, oldest item", lambda: reports[0].__closure__[0].cell_contents),  # type: ignore[index]
        ("exceptions keeping frames, oldest", lambda: frame_local(0)),
        ("numpy arrays, oldest item", lambda: arrays[0].base),
        ("dict attribute, oldest item", lambda: trainer.attn_maps[0]),
    ]

    gc.collect()
    filler = [[i] for i in range(max(0, args.objects - len(gc.get_objects())))]
    tracked = len(gc.get_objects())
    budget = holders.HOLDER_BUDGET_S
    scans: list[float] = []
    original = holders._Climb._climb

    def timed_climb(self: Any, frontier: Any, frontier_ids: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(self, frontier, frontier_ids)
        finally:
            scans.append(time.perf_counter() - start)

    holders._Climb._climb = timed_climb  # type: ignore[method-assign]
    rows = []
    for name, target in targets:
        times, lines = [], []
        scans.clear()
        for _ in range(args.repeat):
            start = time.perf_counter()
            lines.append(holders.who_holds(target(), time_budget_s=budget))
            times.append(time.perf_counter() - start)
        rows.append((name, statistics.median(times), max(times), max(scans, default=0.0),
                     len(scans) / args.repeat, lines[-1]))
    holders._Climb._climb = original  # type: ignore[method-assign]

    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {tracked / 1e6:.2f} M gc-tracked objects, "
          f"budget {budget * 1e3:.0f} ms, {args.repeat} look-ups each\n")
    print("| path | median pause | worst pause | longest scan | heap scans | line |")
    print("|---|---|---|---|---|---|")
    for name, median, worst, scan, count, line in rows:
        print(f"| {name} | {median * 1e3:.0f} ms | {worst * 1e3:.0f} ms | {scan * 1e3:.0f} ms | {count:.0f} | {line} |")
    del filler
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
