"""Phases and find_batch_size on a real CUDA device (skipped without one)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import torch
from torch import nn

import gpumemd


def make(device: str = "cuda"):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                          nn.Linear(4096, 10)).to(device)
    return model, torch.optim.AdamW(model.parameters(), foreach=True)


def test_step_profile_on_cuda_reads_the_allocator(out_dir: str) -> None:
    model, opt = make()
    with gpumemd.attached(model=model, optimizer=opt, output_dir=out_dir, step_profile=True,
                          step_profile_every_steps=2, sample_interval_s=0) as agent:
        for _ in range(4):
            opt.zero_grad(set_to_none=True)  # no gradients at forward start
            x = torch.randn(256, 1024, device="cuda")
            y = torch.randint(0, 10, (256,), device="cuda")
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        profile = agent.state().step_profile
    assert profile is not None and profile.device.kind == "cuda"
    assert profile.forward_start_bytes is not None and profile.forward_peak_bytes is not None
    assert profile.after_backward_bytes is not None and profile.after_step_bytes is not None
    assert profile.gradient_bytes is not None and profile.parameter_bytes is not None
    # the forward rises by at least what it keeps for backward (less the input, allocated before it)
    assert profile.forward_peak_bytes - profile.forward_start_bytes >= profile.saved_for_backward_bytes - x.nbytes
    # after backward the gradients exist (set_to_none: none at forward start)
    assert profile.gradient_bytes == profile.parameter_bytes
    assert profile.after_backward_bytes - profile.forward_start_bytes >= profile.gradient_bytes // 2
    # AdamW's foreach step needs a temporary the size of the parameters
    transient = profile.optimizer_step_transient_bytes
    assert transient is not None and transient >= profile.parameter_bytes // 2


_UNDER_A_FRACTION = textwrap.dedent("""
    import json, torch
    from torch import nn
    from gpumemd.batch_size import find_batch_size
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 10)).cuda()
    opt = torch.optim.Adam(model.parameters())
    total = torch.cuda.get_device_properties(0).total_memory
    cap = 2 * 1024**3
    torch.cuda.set_per_process_memory_fraction(cap / total, 0)

    def step(batch_size):
        x = torch.randn(batch_size, 1024, device="cuda")
        y = torch.randint(0, 10, (batch_size,), device="cuda")
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def peak_of(batch_size):
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
        try:
            step(batch_size)
        except torch.OutOfMemoryError:
            return None
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    size, peak = find_batch_size(step, start=64, max=1 << 20)
    print(json.dumps({"cap": cap, "size": size, "peak": peak, "again": peak_of(size), "double": peak_of(2 * size)}))
""")


def test_find_batch_size_under_a_memory_fraction() -> None:
    # A fresh process: a fraction set back to 1.0 still leaves the allocator's cap flag set in this one.
    root = str(pathlib.Path(__file__).resolve().parents[2])  # this tree's gpumemd, not an installed one
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run([sys.executable, "-c", _UNDER_A_FRACTION], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    cap, size, margin = facts["cap"], facts["size"], 0.1
    assert size > 64
    # Measured again, independently of the search: the size fits the cap with the margin kept ...
    assert facts["again"] is not None and facts["again"] <= cap * (1 - margin)
    # ... and it is the boundary, not any small size: twice it does not fit with that margin.
    assert facts["double"] is None or facts["double"] > cap * (1 - margin) or 2 * size > 1 << 20
