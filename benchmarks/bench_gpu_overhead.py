"""What the agent costs a GPU training job, measured as a user would: the same script with and without
``gpumemd.attach(quiet=True)`` at its defaults, in alternating fresh processes.

Usage: python benchmarks/bench_gpu_overhead.py [--pairs 3] [--steps 1500] [--warmup 400] [--jobs mlp transformer]
       python benchmarks/bench_gpu_overhead.py --device cpu --pairs 1 --steps 300 --warmup 100  # the harness itself

Two jobs: ``mlp``, a 2-layer MLP with bf16 autocast and AdamW, launch-bound (~1-2 ms/step on an H100/H200:
the device finishes each kernel before the CPU launches the next, so everything the agent does on the
training thread is exposed); ``transformer``, a 4-layer d=1024 encoder with a synchronize each step
(~10 ms/step). Each process times its steps after the warm-up (a synchronize before each clock read) and
prints its mean step time and, when attached, the agent's own figure (``agent.overhead()``: its seconds
per wall second). Pairs run off/on, then on/off, alternating, so a drift of the machine hits both.
Prints, per job, the ratio attached/plain of each pair, their median and spread, and the agent's own
figure beside it: the two should agree within 1.5x (docs/overhead-and-benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any


def build(job: str, device: str) -> Any:
    import torch

    torch.manual_seed(0)
    if job == "mlp":
        width = 1024 if device == "cuda" else 128  # on CPU only the harness is exercised: keep it quick
        model = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                    torch.nn.Linear(4 * width, width))
        x = torch.randn(64, width)
    else:
        d = 1024 if device == "cuda" else 128
        layer = torch.nn.TransformerEncoderLayer(d, 16, 4 * d, batch_first=True)
        model = torch.nn.TransformerEncoder(layer, 4)
        x = torch.randn(16, 512, d) if device == "cuda" else torch.randn(2, 64, d)
    model, x = model.to(device), x.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):  # CPU bf16 is slow
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def child(job: str, device: str, attached: bool, steps: int, warmup: int) -> dict[str, Any]:
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    step = build(job, device)
    agent = None
    if attached:
        import gpumemd

        agent = gpumemd.attach(quiet=True, output_dir=tempfile.mkdtemp(prefix="gpumemd-bench-"))
    for _ in range(warmup):
        step()
    sync()
    own_before = agent.overhead().seconds_total if agent is not None else 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    wall = time.perf_counter() - t0
    own = (agent.overhead().seconds_total - own_before) if agent is not None else 0.0
    if agent is not None:
        import gpumemd

        gpumemd.detach()
    return {"step_s": wall / steps, "own_share": own / wall}


def run_child(job: str, device: str, attached: bool, steps: int, warmup: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", job, device, "1" if attached else "0", str(steps), str(warmup)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=os.environ.copy())
    if proc.returncode != 0:
        raise RuntimeError(f"{job} ({'on' if attached else 'off'}) failed:\n{proc.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def measure(job: str, device: str, pairs: int, steps: int, warmup: int) -> dict[str, Any]:
    ratios, own, plain = [], [], []
    for i in range(pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        got = {attached: run_child(job, device, attached, steps, warmup) for attached in order}
        ratios.append(got[True]["step_s"] / got[False]["step_s"])
        own.append(got[True]["own_share"])
        plain.append(got[False]["step_s"])
    return {"job": job, "plain_ms": 1e3 * statistics.median(plain), "ratio": statistics.median(ratios),
            "low": min(ratios), "high": max(ratios), "own": statistics.median(own), "pairs": pairs}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        job, device, attached, steps, warmup = argv[1:6]
        print(json.dumps(child(job, device, attached == "1", int(steps), int(warmup))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--warmup", type=int, default=400)
    parser.add_argument("--jobs", nargs="+", default=["mlp", "transformer"], choices=["mlp", "transformer"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args(argv)
    import torch

    where = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    print(f"bench_gpu_overhead: torch {torch.__version__} on {where}; {args.pairs} alternating pairs, "
          f"{args.steps} timed steps after {args.warmup} of warm-up, attach(quiet=True) at defaults\n")
    print("| job | plain ms/step | attached/plain (median) | spread (min-max) | agent's own figure |")
    print("|---|---|---|---|---|")
    for job in args.jobs:
        r = measure(job, args.device, args.pairs, args.steps, args.warmup)
        print(f"| {job} | {r['plain_ms']:.2f} | {r['ratio']:.4f}x | {r['low']:.4f}-{r['high']:.4f} | "
              f"{100 * r['own']:.2f}% |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
