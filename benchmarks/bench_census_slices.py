"""A census in slices on the heaps long leaks leave: the longest slice, against the same census whole.

    python benchmarks/bench_census_slices.py [--tensors 85000] [--losses 10000] [--chain 8000]

Three heaps, each made fresh in this process and measured on its own:

- ``tensors``: a list keeping that many small CPU tensors (the leak of ``bench_attribution.py``);
- ``losses``: a list keeping that many losses with their autograd graphs (``losses.append(loss)``);
- ``chain``: one loss summed over that many steps with its graph (``total = total + loss``).

For each, ``census_steps`` runs once as the census component runs it in step ends (graph walk in
slices of ``GRAPH_SLICE_NODES``) and once as ``take_census`` runs it (graph walk whole), each slice
timed, as the component runs them (collector held off). What a step end pays is at most the longest
slice plus the slices the component runs after it while the step end has paid less than
``components.census_component.CENSUS_SLICE_S``; the longest slice is the part no step end can split.
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from typing import Any

import torch

from gpumemd.probes.census.census_steps import GRAPH_SLICE_NODES, CensusRequest, census_steps
from gpumemd.probes.heap.gc_pause import collector_paused, hold_automatic, release_automatic
from gpumemd.records.census import Census


def _slices(graph_slice_nodes: int | None, models: list[Any]) -> tuple[list[float], Census]:
    """Each slice timed, run as the census component runs them: the collector held off in a slice and
    automatic collections waiting while the census is under way."""
    work = census_steps(CensusRequest(holders=0, graph_slice_nodes=graph_slice_nodes), models=models)
    times = []
    hold = hold_automatic()
    try:
        while True:
            started = time.perf_counter()
            try:
                with collector_paused():
                    next(work)
            except StopIteration as done:
                times.append(time.perf_counter() - started)
                return times, done.value
            times.append(time.perf_counter() - started)
    finally:
        release_automatic(hold)


def _tensors(n: int) -> Callable[[], list[Any]]:
    def make() -> list[Any]:
        return [torch.randn(32, 16) for _ in range(n)]

    return make


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                               torch.nn.ReLU(), torch.nn.Linear(16, 1))


def _row(name: str, model: torch.nn.Module | None) -> None:
    models = [model] if model is not None else []
    gc.collect()
    sliced, census = _slices(GRAPH_SLICE_NODES, models)
    whole, whole_census = _slices(None, models)
    ms = [f"{max(t) * 1000:.0f} ms" for t in (sliced, whole)]
    print(f"| {name} | {census.objects_scanned:,} | {len(sliced)} | {ms[0]} | {sum(sliced) * 1000:.0f} ms "
          f"| {ms[1]} | {sum(whole) * 1000:.0f} ms | {census.bytes_by_category()['graph']:,} "
          f"({'cut' if census.graph_truncated else 'whole'}) | {whole_census.bytes_by_category()['graph']:,} "
          f"({'cut' if whole_census.graph_truncated else 'whole'}) |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=85_000)
    parser.add_argument("--losses", type=int, default=10_000)
    parser.add_argument("--chain", type=int, default=8_000)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, graph slices of {GRAPH_SLICE_NODES:,} nodes\n")
    print("| heap | gc objects | slices | longest slice | all slices | whole graph walk: longest slice "
          "| all slices | graph bytes, sliced | graph bytes, whole |")
    print("|---|---|---|---|---|---|---|---|---|")
    kept: Any = _tensors(args.tensors)()
    _row(f"{args.tensors:,} kept tensors", None)
    del kept
    model = _mlp()
    kept = [model(torch.randn(4, 16)).pow(2).mean() for _ in range(args.losses)]
    _row(f"{args.losses:,} kept losses with graphs", model)
    del kept
    total = torch.zeros(())
    for _ in range(args.chain):
        total = total + model(torch.randn(4, 16)).pow(2).mean()
    _row(f"a loss summed over {args.chain:,} steps", model)
    del total
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
