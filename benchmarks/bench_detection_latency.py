"""Detection latency at defaults: a 1 MiB/step tensor leak in a fast CPU loop, from step 300 and from
step 1,000, and the same loop without a leak (it must stay silent).

    python benchmarks/bench_detection_latency.py            # onsets 300 and 1000, 3 repeats each
    python benchmarks/bench_detection_latency.py --repeats 1 --onsets 300

Prints, per run, the steps from onset to ``suspected`` and to ``confirmed`` (the finding's
``updated_step`` minus the onset), the series that decided, and the median per onset. Each run is a
fresh interpreter (a job's own process: freed heap left by an earlier run in the same process absorbs
the next leak's first megabytes, and its host RSS does not move) that attaches an agent with only
``output_dir`` set. The loop is a 2-layer MLP on a 32×64 batch (well under 1 ms a step); the
leak appends one fresh 1 MiB float32 tensor to a list every step. Timing-dependent parts of the
agent (the stride, the census cadence) follow the machine: rerun on a quiet one.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import statistics
import tempfile
from concurrent.futures import ProcessPoolExecutor

import torch

import gpumemd

MIB = 2**20


def run(onset: int | None, *, max_after: int = 1500, healthy_steps: int = 3000) -> dict[str, int | str | None]:
    """Steps from onset to each state (None: not reached) and the series that decided; for a healthy
    run, the number of findings."""
    logging.getLogger("gpumemd").setLevel(logging.ERROR)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    kept: list[torch.Tensor] = []
    first: dict[str, int] = {}
    series = None
    agent = gpumemd.attach(model=model, optimizer=opt, output_dir=tempfile.mkdtemp(prefix="bench-latency-"), quiet=True)
    try:
        steps = healthy_steps if onset is None else onset + max_after
        for step in range(steps):
            model(torch.randn(32, 64)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if onset is not None and step >= onset:
                kept.append(torch.ones(MIB // 4))  # the leak: 1 MiB/step, never released
            for finding in agent.state().findings:
                if finding.state in ("suspected", "confirmed"):
                    first.setdefault(finding.state, finding.updated_step)
                    series = finding.series
            if "confirmed" in first:
                break
        findings = len(agent.state().findings)
    finally:
        gpumemd.detach()
    if onset is None:
        return {"findings": findings}
    return {"series": series, **{state: (first[state] - onset if state in first else None)
                                 for state in ("suspected", "confirmed")}}


def run_fresh(onset: int | None) -> dict[str, int | str | None]:
    """``run`` in a fresh interpreter."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(run, onset).result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--onsets", type=int, nargs="+", default=[300, 1000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-healthy", action="store_true")
    args = parser.parse_args()
    print("| onset | run | onset → suspected | onset → confirmed | series |\n|---|---|---|---|---|")
    for onset in args.onsets:
        confirmed: list[int] = []
        for n in range(args.repeats):
            got = run_fresh(onset)
            print(f"| {onset} | {n + 1} | {got['suspected']} | {got['confirmed']} | {got['series']} |", flush=True)
            if isinstance(got["confirmed"], int):
                confirmed.append(got["confirmed"])
        if confirmed:
            print(f"| {onset} | median | | {statistics.median(confirmed):.0f} | |", flush=True)
    if not args.no_healthy:
        print(f"\nhealthy loop, 3,000 steps: {run_fresh(None)['findings']} findings")


if __name__ == "__main__":
    main()
