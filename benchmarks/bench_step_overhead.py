"""The agent's per-step cost on a real CPU training loop: attached vs not attached, same run.

Usage: python benchmarks/bench_step_overhead.py [--steps 300] [--rounds 5] [--hidden 768]

Rounds alternate detached / attached so drift in the machine's speed hits both alike. The agent
runs with its defaults except the census (measured separately in bench_census.py) and the
exporter (bench_exporter.py); `--census` includes the census at its default 1% budget.
Prints a markdown table: median step time both ways, the difference in µs/step and as % of the
step, and the agent's own measure of its training-thread time per step.
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
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--census", action="store_true", help="leave the census on (default budget 1%%)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    step = make_job(args.hidden, args.batch)
    time_steps(step, 30)  # warm-up: allocator, optimizer state
    bare: list[float] = []
    attached: list[float] = []
    agent_per_step: list[float] = []
    out = tempfile.mkdtemp(prefix="gpumemd-bench-")
    for _ in range(args.rounds):
        bare += time_steps(step, args.steps)
        with gpumemd.attached(output_dir=out, census=args.census) as agent:
            attached += time_steps(step, args.steps)
            oh = agent.state().overhead
            agent_per_step.append(oh.training_thread_seconds_total / max(1, oh.steps))
    b, a = statistics.median(bare), statistics.median(attached)
    print(f"torch {torch.__version__}, 1 thread, hidden={args.hidden}, batch={args.batch}, "
          f"{args.rounds}x{args.steps} steps each way, census={'on' if args.census else 'off'}")
    print()
    print("| step (not attached) | step (attached) | difference | agent's own time | % of step |")
    print("|---|---|---|---|---|")
    own = statistics.median(agent_per_step)
    print(f"| {b * 1e3:.2f} ms | {a * 1e3:.2f} ms | {(a - b) * 1e6:+.0f} µs | {own * 1e6:.1f} µs "
          f"| {own / b * 100:.2f}% |")


if __name__ == "__main__":
    main()
