"""A GPU smoke run for ``gpu_check.sh``: a real OOM report that torch's memory_viz opens, a leak found on
CUDA, and the exporter's device series. Prints one ``SMOKE <name> PASS|FAIL <detail>`` line per check."""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import urllib.request

import torch

import gpumemd
from gpumemd.records.device import Device


def check(name: str, ok: bool, detail: str = "") -> bool:
    print(f"SMOKE {name} {'PASS' if ok else 'FAIL'} {detail}".rstrip(), flush=True)
    return ok


def oom_report(out: str) -> bool:
    import torch.cuda._memory_viz as memory_viz

    agent = gpumemd.attach(output_dir=out, record_history=True)  # before any CUDA use, as the README says
    model = torch.nn.Linear(1024, 1024).cuda()
    total = torch.cuda.get_device_properties(0).total_memory
    try:
        with gpumemd.oom_guard():
            model(torch.randn(64, 1024, device="cuda")) + torch.empty(2 * total, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError:
        pass
    reports = agent.reports()
    gpumemd.detach()
    if not check("oom_report_written", len(reports) == 1, str(reports)):
        return False
    with open(os.path.join(reports[0], "snapshot.pickle"), "rb") as f:
        snapshot = pickle.load(f)
    html = memory_viz.trace_plot(snapshot)
    ok = "segments:" in memory_viz.segsum(snapshot) and html.lstrip().startswith("<!DOCTYPE html>")
    import json

    with open(os.path.join(reports[0], "report.json"), encoding="utf-8") as f:
        source = json.load(f)["snapshot"]["source"]
    return check("oom_report_memory_viz", ok) & check("oom_snapshot_from_observer", source == "oom_observer", source)


def leak(out: str) -> bool:
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept = []
    with gpumemd.attached(output_dir=out, sample_interval_s=0) as agent:
        for _ in range(1500):  # the detector at its defaults: warmup 50, window 500
            loss = model(torch.randn(256, 64, device="cuda")).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            kept.append(torch.empty(256 * 1024, device="cuda"))  # 1 MiB kept per step: the leak
        findings = [(f.kind, f.device, f.state) for f in agent.findings()]
    # One finding per cause: found by what it is (kind, device), never by its series' spelling.
    return check("leak_found_on_cuda", any(k == "tensor_leak" and d == Device.cuda(0) for k, d, _ in findings),
                 str(findings))


def exporter(out: str) -> bool:
    model = torch.nn.Linear(256, 256).cuda()
    agent = gpumemd.attach(port=0, output_dir=out, sample_interval_s=0)
    for _ in range(3):
        model(torch.randn(8, 256, device="cuda")).sum().backward()
        gpumemd.mark_step()
    agent.tick()
    assert agent.exporter_url is not None, "attach(port=0) serves metrics"
    with urllib.request.urlopen(agent.exporter_url, timeout=10) as response:
        text = response.read().decode()
    gpumemd.detach()
    want = ('gpumemd_allocator_allocated_bytes{', 'device="0"')
    return check("exporter_device_series", any(all(w in line for w in want) for line in text.splitlines()))


def main() -> int:
    which = sys.argv[1]
    with tempfile.TemporaryDirectory() as out:
        ok = {"oom": oom_report, "leak": leak, "exporter": exporter}[which](out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
