"""Phase breakdowns of a real CPU training loop reach the outputs: /metrics and the OOM report."""

from __future__ import annotations

import json
import os

import torch
from torch import nn

import gpumemd
from gpumemd.components.oom_component import OomComponent
from gpumemd.exporter.collector import build_families


def test_a_real_loops_step_profile_reaches_the_metrics_and_the_oom_report(out_dir: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(100, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.Adam(model.parameters())
    with gpumemd.attached(model=model, optimizer=opt, output_dir=out_dir, step_profile=True, step_profile_every_steps=2,
                          sample_interval_s=0, nvml=False, port=None) as agent:
        for _ in range(4):
            loss = nn.functional.cross_entropy(model(torch.randn(32, 100)), torch.randint(0, 10, (32,)))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        state = agent.state()
        oom = agent.component(OomComponent)
        assert oom is not None
        path = oom.write_report()
    assert state.step_profile is not None and state.step_profile.step == 3
    saved = 4 * (32 * 100 + 32 * 256)  # the input (Linear1) and the ReLU output (ReLU, Linear2)
    params = sum(p.nbytes for p in model.parameters())

    [family] = [f for f in build_families(state) if f.name == "gpumemd_step_profile_bytes"]
    exported = {s.labels["point"]: s.value for s in family.samples}
    # CPU: no allocator points, so no forward_start/forward_peak/... series at all.
    assert exported == {"saved_for_backward": saved, "parameters": params, "gradients": params,
                        "optimizer_state": state.step_profile.optimizer_state_bytes}

    assert path is not None
    with open(os.path.join(path, "report.json"), encoding="utf-8") as f:
        report = json.load(f)
    assert report["step_profile"]["step"] == 3 and report["step_profile"]["device"] == "cpu"
    assert {x["name"]: x["nbytes"] for x in report["step_profile"]["figures"]}["saved_for_backward"] == saved
    with open(os.path.join(path, "report.md"), encoding="utf-8") as f:
        assert "## Step profile" in f.read()
