"""The exporter on a real CUDA device: allocator series match torch's own figures."""

from __future__ import annotations

import urllib.request

import torch
from prometheus_client.parser import text_string_to_metric_families

import gpumemd


def scrape(url: str) -> dict[tuple[str, str], float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {(s.name, s.labels.get("device", "")): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_allocator_series_follow_torch_on_the_job_device(out_dir: str) -> None:
    model = torch.nn.Linear(1024, 1024).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = gpumemd.attach(port=0, output_dir=out_dir, sample_interval_s=0)
    assert agent.exporter_url is not None
    keep = []
    for _ in range(5):
        model(torch.randn(64, 1024, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
        keep.append(torch.empty(1024 * 1024, device="cuda"))  # 4 MiB kept per step

    agent.tick()  # a fresh allocator sample, with nothing allocated after it
    metrics = scrape(agent.exporter_url)

    assert metrics[("gpumemd_allocator_allocated_bytes", "0")] == torch.cuda.memory_allocated(0)
    assert metrics[("gpumemd_allocator_reserved_bytes", "0")] == torch.cuda.memory_reserved(0)
    step_end = agent.steps()[-1].allocator_for(0)
    assert step_end is not None
    assert metrics[("gpumemd_step_end_allocated_bytes", "0")] == step_end.allocated_bytes
    assert metrics[("gpumemd_allocator_alloc_retries_total", "0")] == 0  # born at 0 at attach
    devices = {device for (name, device) in metrics if name == "gpumemd_allocator_allocated_bytes"}
    assert devices == {"0"}  # never a device the job did not touch
    if ("gpumemd_device_total_bytes", "0") in metrics:  # NVML present on this machine
        total = metrics[("gpumemd_device_total_bytes", "0")]
        assert total >= metrics[("gpumemd_device_used_bytes", "0")] > 0
