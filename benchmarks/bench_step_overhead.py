"""The agent's per-step cost on a real CPU training loop: attached vs not attached, same run.

Usage: python benchmarks/bench_step_overhead.py [--steps 100] [--rounds 20] [--hidden 768] [--census]

Each round runs the loop attached and not attached back to back (alternating which goes first), and
the per-round difference of medians is reported (median and IQR over rounds), so slow drift in the
machine's speed cancels. The agent
runs with its defaults except the census (measured separately in bench_census.py) and the
exporter (bench_exporter.py); `--census` includes the census at its default 1% budget.
Prints a markdown table: median step time both ways, the paired difference in µs/step, and the
agent's own measure of its training-thread time per step and as % of the step.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

import gpumemd


def make_job(hidden: int, batch: int):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, hidden)
    y = torch.randint(0, 10, (batch,))

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def time_steps(step, n: int) -> list[float]:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100, help="steps per half-round")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--census", action="store_true", help="leave the census on (default budget 1%%)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    step = make_job(args.hidden, args.batch)
    time_steps(step, 30)  # warm-up: allocator, optimizer state
    bare: list[float] = []
    attached: list[float] = []
    paired: list[float] = []  # per round: median attached - median bare (cancels slow drift)
    agent_per_step: list[float] = []
    out = tempfile.mkdtemp(prefix="gpumemd-bench-")
    for i in range(args.rounds):
        # alternate which half goes first, so a trend within a round hits both alike
        if i % 2:
            b = time_steps(step, args.steps)
        with gpumemd.attached(output_dir=out, census=args.census) as agent:
            a = time_steps(step, args.steps)
            oh = agent.state().overhead
            agent_per_step.append(oh.training_thread_seconds_total / max(1, oh.steps))
        if not i % 2:
            b = time_steps(step, args.steps)
        bare += b
        attached += a
        paired.append(statistics.median(a) - statistics.median(b))
    if args.census:
        # The census is spaced to the budget over the job's life, so measure it over one long attachment
        # (the per-round attaches above each pay a first census at their first step).
        with gpumemd.attached(output_dir=out, census=True) as agent:
            long_run = time_steps(step, args.rounds * args.steps)
            oh = agent.state().overhead
            censuses = agent.state().censuses_total
        print(f"one attachment of {len(long_run)} steps: agent {oh.seconds_per_step * 1e6:.1f} µs/step, "
              f"{oh.ratio:.2%} of wall time, {censuses} censuses taking {oh.census_seconds_total * 1e3:.0f} ms")
    bm, am = statistics.median(bare), statistics.median(attached)
    q = statistics.quantiles(paired, n=4)
    own = statistics.median(agent_per_step)
    print(f"torch {torch.__version__}, 1 thread, hidden={args.hidden}, batch={args.batch}, "
          f"{args.rounds} rounds x {args.steps} steps each way, census={'on' if args.census else 'off'}")
    print()
    print("| step (not attached) | step (attached) | paired difference (median, IQR) | agent's own time "
          "| % of step |")
    print("|---|---|---|---|---|")
    print(f"| {bm * 1e3:.2f} ms | {am * 1e3:.2f} ms | {statistics.median(paired) * 1e6:+.0f} µs "
          f"({q[0] * 1e6:+.0f} to {q[2] * 1e6:+.0f}) | {own * 1e6:.1f} µs | {own / bm * 100:.2f}% |")


if __name__ == "__main__":
    main()
