"""What tracking an active leak costs a job: the same leaking job with and without the agent.

Usage: python benchmarks/bench_leak_tracking.py [--step-ms 0.25 2] [--pairs 6] [--steps 6000] [--no-leak] [--batch 64]
       python benchmarks/bench_leak_tracking.py --step-ms 2 --leak-rate 10   # a 10-tensor/step leak
       python benchmarks/bench_leak_tracking.py --step-ms 2 --leak-rate 10 --keep 2000   # no leak: a bounded deque
       python benchmarks/bench_leak_tracking.py --child on --hidden 8 --steps 3000   # one run (to profile)
       python benchmarks/bench_leak_tracking.py --child on --no-leak --gap-ms 3   # one run, a 3 ms pause every 20 steps

The job: a linear classifier (SGD, batch 8; an MLP with AdamW when its step is 1 ms or more) whose width
is calibrated once to ``--step-ms``, leaking one small tensor a step (``--leak-rate N``: N) from step 50 (``kept``): the
leak is suspected and then confirmed within the run, so from the first few hundred steps on the agent
tracks an active finding (survivor scans, count series, culprit bookkeeping). ``--no-leak`` runs the
same job without the leak: the agent's cost on a healthy job, for comparison.

Each run is a fresh process, ``on`` (``attach()`` at its defaults) and ``off`` alternating, in pairs
whose order is random. A run times each step after a warm-up of ``--warmup`` steps (the first census,
the leak's onset, its suspicion and confirmation, and their one-off culprit searches) and reports its
mean step (each step capped at three times its median, so a preemption by another process does not
count; the agent's own long step ends, a census, are rare here and within the cap) and, when on, the
agent's own figure and the leak component's clocked time (scans and evaluations) per step. Printed per
step time: the on/off ratio (median over pairs, and its range), the difference in µs per step, the
difference in process CPU time per step (all threads; a preemption by another process costs none, so it
is the steadier figure on a loaded machine), and the agent's own figures over the measured steps.
``--gap-ms N`` (one ``--child`` run): a busy pause of N ms after every 20th step, outside the timed
steps; the agent's own figure is then that of an agent that runs after pauses, as it does in
``bench_step_overhead.py``'s agent-on blocks, which follow 21 to 42 steps with it off (its work is the
same, step for step, and costs ~1.5x there: docs/overhead-and-benchmarks.md).
``PYTHONPATH=DIR`` (run from outside the checkout) measures the gpumemd in DIR, e.g. an export of an
earlier commit; the header says which one ran.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

LEAK_FROM = 50
CAP = 3.0


def make_job(hidden: int, mlp: bool, batch: int = 64) -> Any:
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    if mlp:
        model = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))
        opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        model = torch.nn.Sequential(torch.nn.Linear(hidden, 10))
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        batch = 8
    x, y = torch.randn(batch, hidden), torch.randint(0, 10, (batch,))

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def child(args: argparse.Namespace) -> None:
    """One run: the job for ``--steps`` steps, with the agent (``on``) or without; one JSON line with
    the figures of the steps after the warm-up."""
    import torch

    step = make_job(args.hidden, args.mlp, args.batch)
    agent = leak = None
    if args.child == "on":
        import logging

        import gpumemd
        from gpumemd.components.leak import LeakComponent

        logging.getLogger("gpumemd").setLevel(logging.ERROR)
        agent = gpumemd.attach(output_dir=tempfile.mkdtemp(prefix="bench-leak-tracking-"), quiet=True)
        leak = agent.component(LeakComponent)

    def own() -> tuple[float, float, float]:
        if agent is None or leak is None:
            return 0.0, 0.0, 0.0
        return agent.state().overhead.seconds_total, leak.scan_seconds + leak.evaluate_seconds, leak.scan_seconds

    kept: Any = collections.deque(maxlen=args.keep) if args.keep else []
    times = []
    own0, cpu0 = (0.0, 0.0, 0.0), (0.0, 0.0)
    for n in range(1, args.steps + 1):
        if n == args.warmup + 1:
            own0, cpu0 = own(), (time.process_time(), 0.0)
        t0 = time.perf_counter()
        step()
        if n >= LEAK_FROM and not args.no_leak:
            kept.extend(torch.zeros(16) for _ in range(args.leak_rate))
        times.append(time.perf_counter() - t0)
        if args.gap_ms and n % 20 == 0:
            until = time.perf_counter() + args.gap_ms / 1e3
            while time.perf_counter() < until:
                pass
    cpu = time.process_time() - cpu0[0]
    own1 = own()
    measured = times[args.warmup:]
    cap = CAP * statistics.median(measured)
    out: dict[str, Any] = {"step_s": sum(min(t, cap) for t in measured) / len(measured),
                           "cpu_s": cpu / len(measured),
                           "own_s": (own1[0] - own0[0]) / len(measured), "leak_s": (own1[1] - own0[1]) / len(measured),
                           "scan_s": (own1[2] - own0[2]) / len(measured)}
    if agent is not None:
        out["findings"] = sorted({f"{f.state} {f.kind}" for f in agent.state().findings})
        agent.stop()
    print(json.dumps(out))


def calibrate(target_s: float, mlp: bool, batch: int) -> int:
    """The width whose step takes about ``target_s`` here (the lower quartile of ~0.3 s of steps)."""
    hidden = 64 if mlp else 8
    for _ in range(4):
        step = make_job(hidden, mlp, batch)
        for _ in range(20):
            step()
        took = []
        for _ in range(max(50, int(0.3 / target_s))):
            t0 = time.perf_counter()
            step()
            took.append(time.perf_counter() - t0)
        q1 = statistics.quantiles(took, n=4)[0]
        if not mlp and q1 > target_s and hidden == 8:
            break  # the linear classifier at its narrowest: as short as a real step gets here
        hidden = max(8, round(hidden * (target_s / q1) ** (0.5 if mlp else 1.0)))
    return hidden


def run_one(mode: str, hidden: int, mlp: bool, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, os.path.abspath(__file__), "--child", mode, "--hidden", str(hidden),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch)]
    command += ["--mlp"] if mlp else []
    command += ["--no-leak"] if args.no_leak else ["--leak-rate", str(args.leak_rate), "--keep", str(args.keep)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMEMD_")}
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def measure(step_ms: float, args: argparse.Namespace) -> None:
    mlp = step_ms >= 1.0
    hidden = calibrate(step_ms / 1000, mlp, args.batch)
    rng = random.Random(step_ms)
    ratios, diffs, cpus, own, leak, scans, offs, findings = [], [], [], [], [], [], [], set()
    for _ in range(args.pairs):
        modes = ["on", "off"]
        rng.shuffle(modes)
        runs = {mode: run_one(mode, hidden, mlp, args) for mode in modes}
        on, off = runs["on"], runs["off"]
        ratios.append(on["step_s"] / off["step_s"])
        diffs.append((on["step_s"] - off["step_s"]) * 1e6)
        cpus.append((on["cpu_s"] - off["cpu_s"]) * 1e6)
        own.append(on["own_s"] * 1e6)
        leak.append(on["leak_s"] * 1e6)
        scans.append(on["scan_s"] * 1e6)
        offs.append(off["step_s"] * 1e3)
        findings.update(on["findings"])
    job = f"MLP width {hidden}, AdamW, batch {args.batch}" if mlp else f"linear width {hidden}, SGD"
    leaking = "none" if args.no_leak else f"{args.leak_rate} tensor{'s' if args.leak_rate > 1 else ''}/step"
    leaking += f", the newest {args.keep:,} kept" if args.keep and not args.no_leak else ""
    print(f"| {statistics.median(offs):.3f} ms ({job}) | {leaking} | "
          f"{(statistics.median(ratios) - 1) * 100:+.2f}% [{(min(ratios) - 1) * 100:+.2f}, "
          f"{(max(ratios) - 1) * 100:+.2f}] | {statistics.median(diffs):+.1f} µs [{min(diffs):+.1f}, "
          f"{max(diffs):+.1f}] | {statistics.median(cpus):+.1f} µs | {statistics.median(own):.1f} µs | "
          f"{statistics.median(leak):.1f} µs (scans {statistics.median(scans):.1f}) | "
          f"{', '.join(sorted(findings)) or 'none'} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step-ms", type=float, nargs="+", default=[0.25, 2.0])
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--warmup", type=int, default=3000)
    parser.add_argument("--no-leak", action="store_true")
    parser.add_argument("--leak-rate", type=int, default=1, help="tensors the job keeps a step (default 1)")
    parser.add_argument("--keep", type=int, default=0,
                        help="keep only the newest N in a deque(maxlen=N): a healthy job that churns them")
    parser.add_argument("--child", choices=["on", "off"])
    parser.add_argument("--hidden", type=int, default=8)
    parser.add_argument("--mlp", action="store_true")
    parser.add_argument("--gap-ms", type=float, default=0.0, help="(--child) a busy pause after every 20th step")
    parser.add_argument("--batch", type=int, default=64,
                        help="the MLP's batch (default 64); a larger one calibrates to a narrower MLP whose working "
                             "set stays in cache, so its step time varies less between processes")
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    print(f"{args.pairs} pairs of fresh processes per row, {args.steps} steps each, measured after step "
          f"{args.warmup}; ranges are min..max over pairs\n")
    import gpumemd

    print(f"gpumemd from {os.path.dirname(gpumemd.__file__)}")
    print("| job step (agent off) | leak | wall-clock on/off - 1 [range] | wall µs/step [range] | CPU µs/step | "
          "agent's own figure | leak component (scans + evaluations) | findings |")
    print("|---|---|---|---|---|---|---|---|")
    for step_ms in args.step_ms:
        measure(step_ms, args)


if __name__ == "__main__":
    main()
