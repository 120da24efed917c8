"""The real CUDA path of the foundation (skipped without a CUDA device; see conftest.py)."""

from __future__ import annotations

import torch

import gpumemd
from gpumemd.probes.allocator import AllocatorProbe
from gpumemd.records.device import Device


def test_allocator_probe_is_silent_until_the_job_touches_cuda() -> None:
    probe = AllocatorProbe()
    if not torch.cuda.is_initialized():
        assert probe.read() == ()
    x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    samples = probe.read()
    assert samples and samples[0].device == Device.cuda(x.device.index)
    assert samples[0].allocated_bytes is not None and samples[0].allocated_bytes >= 64 << 20
    assert samples[0].reserved_bytes is not None and samples[0].reserved_bytes >= samples[0].allocated_bytes


def test_step_records_carry_step_end_allocated(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = torch.nn.Linear(1024, 1024, device="cuda")
    opt = torch.optim.Adam(model.parameters())
    with gpumemd.attached(output_dir=str(tmp_path), sample_interval_s=0, census=False) as agent:
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
    assert records[-1].nvml == () or records[-1].nvml[0].total_bytes > 0
