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
figure beside it (the two should agree within 1.5x, docs/overhead-and-benchmarks.md), split into the
training thread's time (censuses included), the censuses' and the sampler thread's, per step.
``GPUMEMD_BENCH_PROFILE=DIR``: one more attached run per job, not timed, writes a cProfile of the agent's functions per
step to ``DIR/profile-<job>.txt`` (what to cut next, when the figure is over budget).
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
from pathlib import Path
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


def child(job: str, device: str, attached: bool, steps: int, warmup: int, *, profile: str = "") -> dict[str, Any]:
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
    before = agent.overhead() if agent is not None else None
    profiler = None
    if agent is not None and profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    wall = time.perf_counter() - t0
    result: dict[str, Any] = {"step_s": wall / steps, "own_share": 0.0}
    if agent is not None and before is not None:
        after = agent.overhead()
        thread_s = after.training_thread_seconds_total - before.training_thread_seconds_total
        result.update(own_share=(after.seconds_total - before.seconds_total) / wall, thread_us=1e6 * thread_s / steps,
                      census_us=1e6 * (after.census_seconds_total - before.census_seconds_total) / steps,
                      sampler_us=1e6 * (after.sampler_seconds_total - before.sampler_seconds_total) / steps,
                      stride=agent.stride)
        if profiler is not None:
            profiler.disable()
            _write_profile(profiler, Path(profile) / f"profile-{job}.txt", steps)
        import gpumemd

        gpumemd.detach()
    return result


def _write_profile(profiler: Any, path: Path, steps: int) -> None:
    """The agent's functions by own time per step (the job's own are left out): what to cut next."""
    import pstats

    rows = [(tt, nc, f"{f.split('gpumemd/')[-1]}:{ln} {fn}", ct)
            for (f, ln, fn), (_, nc, tt, ct, _) in pstats.Stats(profiler).stats.items()  # type: ignore[attr-defined]
            if "/gpumemd/" in f]
    rows.sort(reverse=True)
    lines = [f"{1e6 * tt / steps:8.2f} us/step own {1e6 * ct / steps:8.2f} cum  {nc / steps:7.3f} calls/step  {name}"
             for tt, nc, name, ct in rows[:40]]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{steps} steps under cProfile (which inflates Python-heavy code)\n" + "\n".join(lines) + "\n")


def run_child(job: str, device: str, attached: bool, steps: int, warmup: int, *, profile: str = "") -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", job, device, "1" if attached else "0", str(steps), str(warmup),
           profile]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=os.environ.copy())
    if proc.returncode != 0:
        raise RuntimeError(f"{job} ({'on' if attached else 'off'}) failed:\n{proc.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def measure(job: str, device: str, pairs: int, steps: int, warmup: int) -> dict[str, Any]:
    ratios, own, plain = [], [], []
    last_on: dict[str, Any] = {}
    for i in range(pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        got = {attached: run_child(job, device, attached, steps, warmup) for attached in order}
        ratios.append(got[True]["step_s"] / got[False]["step_s"])
        own.append(got[True]["own_share"])
        last_on = got[True]
        plain.append(got[False]["step_s"])
    if os.environ.get("GPUMEMD_BENCH_PROFILE"):  # one more attached run, under cProfile and not timed
        run_child(job, device, True, steps, warmup, profile=os.environ["GPUMEMD_BENCH_PROFILE"])
    return {"job": job, "plain_ms": 1e3 * statistics.median(plain), "ratio": statistics.median(ratios),
            "low": min(ratios), "high": max(ratios), "own": statistics.median(own), "pairs": pairs,
            "parts": last_on}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        job, device, attached, steps, warmup, profile = argv[1:7]
        print(json.dumps(child(job, device, attached == "1", int(steps), int(warmup), profile=profile)))
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
    print("| job | plain ms/step | attached/plain (median) | spread (min-max) | agent's own figure | "
          "of which, µs/step: training thread, censuses, sampler (stride) |")
    print("|---|---|---|---|---|---|")
    for job in args.jobs:
        r = measure(job, args.device, args.pairs, args.steps, args.warmup)
        p = r["parts"]
        print(f"| {job} | {r['plain_ms']:.2f} | {r['ratio']:.4f}x | {r['low']:.4f}-{r['high']:.4f} | "
              f"{100 * r['own']:.2f}% | {p.get('thread_us', 0):.1f}, {p.get('census_us', 0):.1f}, "
              f"{p.get('sampler_us', 0):.1f} ({p.get('stride')}) |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
