"""The real CUDA path of the foundation (skipped without a CUDA device; see conftest.py)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import torch

import gpumemd
from gpumemd.records.device import Device

_BEFORE_AND_AFTER = textwrap.dedent("""
    import json, torch
    from gpumemd.probes.device.allocator import AllocatorProbe
    probe = AllocatorProbe()
    before = [torch.cuda.is_initialized(), len(probe.read()), torch.cuda.is_initialized()]
    x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    samples = probe.read()
    print(json.dumps({"before": before, "device": x.device.index,
                      "samples": [[s.device.cuda_index, s.allocated_bytes, s.reserved_bytes] for s in samples]}))
""")


def test_allocator_probe_is_silent_until_the_job_touches_cuda() -> None:
    # A fresh process: in this one an earlier test may have initialised CUDA already.
    root = str(pathlib.Path(__file__).resolve().parents[2])  # this tree's gpumemd, not an installed one
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run([sys.executable, "-c", _BEFORE_AND_AFTER], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert facts["before"] == [False, 0, False]  # nothing read, and reading did not initialise CUDA
    (device, allocated, reserved), *_ = facts["samples"]
    assert device == facts["device"]
    assert allocated is not None and allocated >= 64 << 20
    assert reserved is not None and reserved >= allocated


def test_step_records_carry_step_end_allocated(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = torch.nn.Linear(1024, 1024, device="cuda")
    opt = torch.optim.Adam(model.parameters())
    with gpumemd.attached(output_dir=str(tmp_path), sample_interval_s=0, census=False) as agent:
        nvml_on = agent.state().probes_available.get("nvml")
        for _ in range(3):
            model(torch.randn(256, 1024, device="cuda")).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        records = agent.steps()
    assert len(records) == 3
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    sample = records[-1].allocator_for(torch.cuda.current_device())
    assert sample is not None and sample.allocated_bytes is not None
    # step end: parameters + Adam's two moments at least
    assert sample.allocated_bytes >= 3 * params
    if nvml_on:  # NVML is here: the record must carry its reading
        device = torch.cuda.current_device()
        nvml = [n for n in records[0].nvml if n.device == Device.cuda(device)]  # read at attach, < 1 s before
        assert nvml and nvml[0].total_bytes > 0 and nvml[0].used_bytes > 0
