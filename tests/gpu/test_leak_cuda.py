"""The leak detector on a real CUDA device: the allocator's step-end bytes raise the alarm and, with
allocation history switched on at suspicion, the finding names the line that allocates the leak."""

from __future__ import annotations

import pytest
import torch

import gpumemd
from gpumemd.records.device import Device

# The detector at its defaults; the one mechanism under test is switched on: allocation history at
# suspicion, which names the allocating line.
SETTINGS = {"sample_interval_s": 0, "leak_history_on_suspect": True, "history_max_entries": 10_000}


def test_cuda_tensor_leak_is_found_with_its_allocation_site(out_dir: str) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept_outputs = []
    try:
        with gpumemd.attached(output_dir=out_dir, **SETTINGS) as agent:
            for step in range(1500):
                out = model(torch.randn(256, 64, device="cuda"))
                loss = out.pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                if step >= 40:
                    kept_outputs.append(out.detach().clone())  # the leak: 512 KiB per step
                if any(f.state == "confirmed" for f in agent.findings()):
                    break
            findings = agent.findings()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    # One finding per cause: picked by what it is (kind, device), never by its series' spelling.
    device = [f for f in findings if f.kind == "tensor_leak" and f.device == Device.cuda(0)]
    assert device, [f.summary for f in findings]
    f = device[0]
    assert f.state == "confirmed"
    assert f.slope_bytes_per_step == pytest.approx(512 * 1024, rel=0.2)
    assert f.steps_to_oom is not None and f.steps_to_oom > 0
    assert "kept_outputs" in f.summary  # the census names the holding list
    assert f.sites and "test_leak_cuda.py" in f.sites[0], f.sites  # the allocating line
