"""The real CUDA path: PyTorch's OOM observer fires, the snapshot is taken there, memory_viz reads it."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
import torch.cuda._memory_viz as memory_viz

import gpumemd


def test_a_real_cuda_oom_leaves_a_report_with_the_observer_snapshot(out_dir: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024).cuda()  # the job initialises CUDA, never the agent
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    agent = gpumemd.attach(model=model, optimizer=opt, output_dir=out_dir, sample_interval_s=0,
                           record_history=True, history_max_entries=10_000)
    for _ in range(3):  # on_step attaches the observer and starts the history
        model(torch.randn(64, 1024, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    total = torch.cuda.get_device_properties(0).total_memory
    with pytest.raises(torch.OutOfMemoryError):
        with gpumemd.oom_guard():
            torch.empty(2 * total, dtype=torch.uint8, device="cuda")  # < 1 EiB: the observer fires
    path = agent.reports()[0]
    assert "snapshot.pickle" in os.listdir(path)
    with open(os.path.join(path, "report.json"), encoding="utf-8") as f:
        report = json.load(f)
    assert report["snapshot"]["source"] == "oom_observer"
    # The observer's figure is cudaMemGetInfo's total, which the driver may keep below totalGlobalMem
    # (its own reserve, vGPU, WSL): not equal, but never above it nor far below.
    assert 0.9 * total <= report["observer"]["total_or_cap_bytes"] <= total
    assert report["breakdown"]["verdict"] == "request_exceeds_device"
    with open(os.path.join(path, "snapshot.pickle"), "rb") as f:
        snapshot = pickle.load(f)
    assert "segments:" in memory_viz.segsum(snapshot)
    assert "OutOfMemoryError" in memory_viz.trace(snapshot)
    assert report["memory_summary"]


def test_an_oom_the_job_catches_is_counted_and_reported_from_the_observer(out_dir: str) -> None:
    from gpumemd.exporter.collector import StateCollector

    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    agent = gpumemd.attach(model=model, optimizer=opt, output_dir=out_dir, sample_interval_s=0)
    total = torch.cuda.get_device_properties(0).total_memory
    skipped: list[int] = []
    try:
        for step in range(6):  # a skip-the-batch loop: the OOM never reaches an excepthook
            try:
                if step == 2:
                    torch.empty(2 * total, dtype=torch.uint8, device="cuda")
                model(torch.randn(64, 1024, device="cuda")).sum().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            except torch.OutOfMemoryError:
                skipped.append(step)
        assert skipped == [2]
        state = agent.state()
        assert state.ooms_caught == 1 and state.oom_caught_steps == (2,)
        ooms = [s.value for m in StateCollector(agent.state).collect() for s in m.samples
                if s.name == "gpumemd_ooms_total"]
        assert ooms == [1.0]
    finally:
        gpumemd.detach()
    (path,) = agent.reports()
    with open(os.path.join(path, "report.json"), encoding="utf-8") as f:
        report = json.load(f)
    assert report["source"] == "caught" and report["outcome"].startswith("caught")
    assert report["snapshot"]["source"] == "oom_observer" and "snapshot.pickle" in os.listdir(path)
    assert report["observer"]["requested_bytes"] >= 2 * total
