"""Memory planning: analytic vs traced vs measured peaks, and the cost of phase measurement.

    /work/venv/bin/python benchmarks/bench_estimate.py [--steps 200]

Part 1, for each test model (fp32, Adam, one CPU training step):
- analytic: ``gpumemd.analysis.memory_estimate`` from the parameter count alone (no activations), and for
  the GPT models also from the transformer shape (Korthikanti et al. activations);
- traced: ``gpumemd.probes.planning.trace.trace_model`` on the meta device;
- measured: a real CPU step after one warm-up step: the live bytes before it (parameters, buffers,
  optimizer state; exact) plus the peak of torch's CPU allocator events during zero_grad, forward,
  backward and step (``gpumemd.probes.planning.cpu_peak``). Saved-for-backward is counted in the real step
  with the same saved-tensor counter.

Part 2: median wall time of a training step with the step profile off, on but the step not
sampled, and on a sampled step, plus the component's own hook time (``StepProfile.overhead_s``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "unit"))

import estimate_models as em
import torch
from torch import nn

import gpumemd
from gpumemd.analysis.memory_estimate import TransformerShape, estimate
from gpumemd.components.step_profiler import StepProfileComponent
from gpumemd.probes.planning.cpu_peak import measure_cpu_peak
from gpumemd.probes.planning.trace import SavedTensorCounter, scalar_loss, storage_key, trace_model


def gpt_medium() -> nn.Module:
    return em.TinyGPT(vocab=2048, seq=128, hidden=256, heads=8, layers=4)


MODELS: list[tuple[str, Callable[[], nn.Module], tuple[int, ...], str, TransformerShape | None]] = [
    ("mlp", em.mlp, (32, 100), "float32", None),
    ("cnn", em.cnn, (8, 3, 16, 16), "float32", None),
    ("tied autoencoder", em.tied, (16, 64), "float32", None),
    ("SDPA attention block", em.sdpa, (8, 256, 64), "float32", None),
    ("tiny GPT (2x64, s=32)", em.gpt, (4, 32), "int64",
     TransformerShape(layers=2, hidden=64, heads=4, seq=32, batch=4, vocab=128)),
    ("GPT (4x256, s=128)", gpt_medium, (8, 128), "int64",
     TransformerShape(layers=4, hidden=256, heads=8, seq=128, batch=8, vocab=2048)),
]


def live_bytes(tensors: list[torch.Tensor]) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        key = storage_key(t)
        if key is None or key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def measured(factory: Callable[[], nn.Module], shape: tuple[int, ...], dtype: str) -> tuple[int, int]:
    torch.manual_seed(0)
    model = factory()
    opt = torch.optim.Adam(model.parameters())

    def batch() -> torch.Tensor:
        return torch.randint(0, 128, shape) if dtype == "int64" else torch.randn(shape)

    def step(counter: SavedTensorCounter | None = None) -> None:
        opt.zero_grad(set_to_none=True)
        x = batch()
        if counter is not None:
            with counter:
                loss = scalar_loss(model(x))
        else:
            loss = scalar_loss(model(x))
        loss.backward()
        opt.step()

    step()  # warm-up: optimizer state exists from here on, as in a long job
    opt.zero_grad(set_to_none=True)
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    before = live_bytes([*model.parameters(), *model.buffers(), *state])
    counter = SavedTensorCounter(exclude=[*model.parameters(), *model.buffers()])
    _, peak = measure_cpu_peak(lambda: step(counter))
    return before + peak.peak_bytes, counter.bytes


def mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def part1() -> None:
    print("| model | params | analytic peak, params only (MiB) | analytic peak, shape (MiB) | traced peak, meta (MiB) "
          "| traced peak, fake-cpu (MiB) | measured peak (MiB) | traced saved, meta / fake-cpu (MiB) "
          "| measured saved (MiB) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, factory, shape, dtype, tshape in MODELS:
        traced = trace_model(factory, shape, input_dtype=dtype, optimizer="adam")
        fake = trace_model(factory, shape, input_dtype=dtype, optimizer="adam", backend="fake-cpu")
        analytic = estimate(traced.parameters, precision="fp32", optimizer="adam")
        with_shape = (
            estimate(traced.parameters, precision="fp32", optimizer="adam", shape=tshape).peak_bytes
            if tshape is not None else None
        )
        peak, saved = measured(factory, shape, dtype)
        print(f"| {name} | {traced.parameters:,} | {mib(analytic.peak_bytes)} | "
              f"{mib(with_shape) if with_shape is not None else '-'} | {mib(traced.peak_bytes)} | "
              f"{mib(fake.peak_bytes)} | {mib(peak)} | "
              f"{mib(traced.saved_for_backward_bytes)} / {mib(fake.saved_for_backward_bytes)} | {mib(saved)} |")


def timed_loop(steps: int, **attach: Any) -> tuple[list[float], list[float]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    opt = torch.optim.Adam(model.parameters())
    x, y = torch.randn(64, 512), torch.randint(0, 10, (64,))
    times: list[float] = []
    overheads: list[float] = []
    out = tempfile.mkdtemp(prefix="gpumemd-bench-")
    with gpumemd.attached(model=model, optimizer=opt, output_dir=out, sample_interval_s=0, census=False,
                          leak_detection=False, **attach) as agent:
        last = None
        for _ in range(steps):
            t0 = time.perf_counter()
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            profile = agent.state().step_profile
            if profile is not None and profile is not last:
                overheads.append(profile.overhead_s)
                last = profile
    return times[10:], overheads


def part2(steps: int, rounds: int = 3) -> None:
    # The three configurations alternate, round after round, so drift on a shared machine hits all.
    off: list[float] = []
    unsampled: list[float] = []
    sampled: list[float] = []
    overheads: list[float] = []
    for _ in range(rounds):
        off += timed_loop(steps)[0]
        unsampled += timed_loop(steps, step_profile=True, step_profile_every_steps=10**6)[0]
        times, over = timed_loop(steps, step_profile=True, step_profile_every_steps=1)
        sampled += times
        overheads += over
    med = statistics.median
    print()
    print(f"| training step (MLP 512-1024-1024-10, batch 64, CPU; median of {len(off)} steps) | ms |")
    print("|---|---:|")
    print(f"| step profile off | {med(off) * 1e3:.3f} |")
    print(f"| step profile on, step not sampled | {med(unsampled) * 1e3:.3f} |")
    print(f"| step profile on, every step sampled | {med(sampled) * 1e3:.3f} |")
    print(f"| component's own hook time per sampled step (median overhead_s) | {med(overheads) * 1e3:.3f} |")
    print(f"| component's hook time per non-sampled step (forward pre-hook + forward hook + optimizer pre-hook "
          f"+ on_step, direct) | {unsampled_hook_cost() * 1e3:.4f} |")


def unsampled_hook_cost(calls: int = 20_000) -> float:
    """Seconds per non-sampled step spent in the component's hooks, timed by calling them directly."""
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gpumemd.attached(model=model, optimizer=opt, output_dir=tempfile.mkdtemp(prefix="gpumemd-bench-"),
                          sample_interval_s=0, census=False, leak_detection=False, step_profile=True,
                          step_profile_every_steps=10**6) as agent:
        component: Any = agent.component(StepProfileComponent)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()  # one real step, so there is a step record to hand to on_step
        record = agent.steps()[-1]
        t0 = time.perf_counter()
        for _ in range(calls):
            component._on_forward_start(model, ())
            component._on_forward_end(model, (), None)
            component._on_optimizer_pre(opt, (), {})
            component.on_step(record)
        return (time.perf_counter() - t0) / calls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, 1 torch thread\n")
    part1()
    part2(args.steps)


if __name__ == "__main__":
    main()
