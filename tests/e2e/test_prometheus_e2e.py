"""End to end: a real CPU training job that leaks, the agent serving /metrics, a real Prometheus
scraping it every second with gpumemd's rules loaded, checked through Prometheus's HTTP API.

The machine has no GPU, so the CUDA allocator and NVML are fed through the probes' seams with data
in exactly the shape PyTorch and NVML produce, driven by the job's real tensors: the leaked tensors
raise "allocated" just as they would on a device. Everything else (steps, census, host, the leak
detector, the exporter, Prometheus, the rules) is the real thing.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from fakes import FakeGpu, FakeNvml
from prom_binaries import require_binary
from prometheus_server import Prometheus

from gpumemd.api import build_agent
from gpumemd.components.leak import LeakComponent
from gpumemd.config import Config
from gpumemd.probes.device.allocator import AllocatorProbe
from gpumemd.probes.device.nvml import NvmlProbe
from gpumemd.probes.process.host import HostProbe

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "exporters" / "prometheus" / "rules" / "gpumemd.rules.yml"
DASHBOARD = ROOT / "grafana" / "dashboards" / "gpumemd.json"
MIB = 1024**2
GIB = 1024**3
LEAK_BYTES_PER_STEP = 256 * 1024
DEADLINE_S = 75.0
DEVICE_TOTAL = 16 * GIB


class Ledger:
    """What the fake device holds: a fixed base plus the bytes of the job's leaked tensors."""

    def __init__(self) -> None:
        self.leaked: list[torch.Tensor] = []
        self.step = 0

    @property
    def allocated(self) -> int:
        return 64 * MIB + sum(t.untyped_storage().nbytes() for t in self.leaked)


def memory_stats_fn(ledger: Ledger) -> Callable[[int], dict[str, int]]:
    """``torch.cuda.memory_stats(device)`` as the native allocator flattens it (see TORCH_MEMORY_API.md)."""

    def stats(device: int) -> dict[str, int]:
        allocated = ledger.allocated
        reserved = (allocated // (20 * MIB) + 2) * 20 * MIB
        out = {f"{s}.{p}.{k}": 0 for s in ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
                                             "reserved_bytes", "active_bytes", "inactive_split_bytes",
                                             "requested_bytes")
               for p in ("all", "large_pool", "small_pool") for k in ("current", "peak", "allocated", "freed")}
        out.update({
            "allocated_bytes.all.current": allocated, "allocated_bytes.all.peak": allocated + 32 * MIB,
            "reserved_bytes.all.current": reserved, "reserved_bytes.all.peak": reserved,
            "active_bytes.all.current": allocated, "active_bytes.all.peak": allocated + 32 * MIB,
            "inactive_split_bytes.all.current": 3 * MIB, "requested_bytes.all.current": allocated - 4096,
            "segment.all.current": reserved // (20 * MIB), "segment.all.allocated": reserved // (20 * MIB),
            "num_alloc_retries": ledger.step // 100, "num_ooms": 0, "num_oom_rejections": 0, "num_sync_all_streams": 0,
            "num_device_alloc": reserved // (20 * MIB), "num_device_free": 0, "max_split_size": -1,
        })
        return out

    return stats


def fake_nvml(ledger: Ledger) -> FakeNvml:
    """NVML for one 16 GiB device used by this process: its reserved bytes plus the CUDA context and
    libraries outside the allocator, and 300 MiB more on the device."""

    def process_used() -> int:
        return stats_reserved(ledger) + 500 * MIB

    return FakeNvml([FakeGpu(DEVICE_TOTAL, used=lambda: process_used() + 300 * MIB)],
                    processes={os.getpid(): process_used})


def stats_reserved(ledger: Ledger) -> int:
    return int(memory_stats_fn(ledger)(0)["reserved_bytes.all.current"])


def panel_queries() -> list[tuple[str, str]]:
    import json

    dashboard = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, value in (("$__rate_interval", "15s"), ("$job", ".+"), ("$instance", ".+"),
                               ("$rank", ".+"), ("$device", ".+"), ("$training_job", ".*")):
                expr = expr.replace(var, value)
            out.append((f"{panel['title']} / {target['refId']}", expr))
    return out


def firing(prom: Prometheus, name: str) -> list[dict[str, Any]]:
    return [a for a in prom.api("alerts")["alerts"] if a["labels"]["alertname"] == name and a["state"] == "firing"]


def test_prometheus_scrapes_the_agent_and_the_leak_alert_fires(prometheus: Prometheus, tmp_path: Path) -> None:
    started = time.monotonic()
    ledger = Ledger()
    config = Config(
        port=0, output_dir=str(tmp_path / "gpumemd-out"), sample_interval_s=0.5, leak_warmup_steps=20,
        leak_min_bytes_per_step=64 * 1024, leak_window_steps=100,
        leak_check_every_steps=20, census_every_steps=50,
        # the dashboard's "Memory by step profile point" panel needs data
        step_profile=True, step_profile_every_steps=10,
    )
    agent = build_agent(
        config,
        # the job capped itself at half the device (set_per_process_memory_fraction): the cap series
        # and the capped headroom panel need it
        allocator_probe=AllocatorProbe(stats_fn=memory_stats_fn(ledger), is_initialized=lambda: True,
                                       device_count=lambda: 1, cap_fn=lambda device: (0.5, DEVICE_TOTAL)),
        nvml_probe=NvmlProbe(nvml=fake_nvml(ledger), visible="0"),
        host_probe=HostProbe(pinned_fn=lambda: 64 * MIB),
    )
    agent.start()
    try:
        url = agent.exporter_url
        assert url is not None
        target = url.split("//")[1].split("/")[0]
        prometheus.start([target], [str(RULES)])
        assert agent.component(LeakComponent) is not None, "the default components lost the leak detector"

        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        agent.register(model)
        # This job has a device: the targets that show host memory on ranks without one ("unless on"
        # the device's series) are empty by design (test_grafana_dashboard evaluates them on a CPU job).
        queries = [(name, expr) for name, expr in panel_queries() if "unless on" not in expr]
        empty: list[str] = [name for name, _ in queries]
        alert: list[dict[str, Any]] = []
        next_poll = 0.0
        while time.monotonic() - started < DEADLINE_S:
            for _ in range(25):  # the job: a real loop that keeps every step's loss tensor (the leak)
                loss = model(torch.randn(32, 64)).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                ledger.leaked.append(torch.zeros(LEAK_BYTES_PER_STEP // 4))
                ledger.step += 1
            if time.monotonic() < next_poll:
                continue
            next_poll = time.monotonic() + 1.0
            alert = firing(prometheus, "GpumemdLeakConfirmed")
            if alert:
                empty = [name for name, expr in queries if not prometheus.query(expr)]
                if not empty:
                    break

        # The series arrived, with the labels the dashboard and the rules rely on.
        [info] = prometheus.query("gpumemd_info")
        assert info["metric"]["job"] == "gpumemd" and info["metric"]["instance"] == target
        assert info["metric"]["rank"] == "0" and info["metric"]["local_rank"] == "0"
        [allocated] = prometheus.query("gpumemd_allocator_allocated_bytes")
        assert allocated["metric"]["device"] == "0"
        assert float(allocated["value"][1]) > 64 * MIB  # the leaked tensors show up
        census = {r["metric"]["category"] for r in prometheus.query("gpumemd_census_bytes")}
        assert census == {"parameter", "gradient", "optimizer_state", "buffer", "graph", "other"}
        # A CPU job: the points measured everywhere, none of the allocator's (absent, not 0).
        profile = {r["metric"]["point"] for r in prometheus.query("gpumemd_step_profile_bytes")}
        assert profile == {"saved_for_backward", "parameters", "gradients", "optimizer_state"}, profile
        [invisible] = prometheus.query("gpumemd_census_invisible_bytes")
        assert invisible["metric"]["device"] == "0"  # the fake CUDA allocator's bytes no census tensor holds
        [steps] = prometheus.query("gpumemd_steps_total")
        assert float(steps["value"][1]) >= 100, "the job's steps did not reach Prometheus"
        for series in prometheus.api("series", **{"match[]": '{__name__=~"gpumemd_.+"}'}):
            assert not set(series) & {"step", "pid", "shape", "file"}, series

        # The leak alert fired, from the agent's own finding: the CUDA series (device 0) leaks.
        assert alert, f"GpumemdLeakConfirmed did not fire within {DEADLINE_S:.0f} s; findings: {agent.findings()}"
        assert {a["labels"]["instance"] for a in alert} == {target}
        assert any(a["labels"].get("device") == "0" for a in alert), alert
        assert all("leak-findings-rank0.jsonl" in a["annotations"]["description"] for a in alert)

        # Every dashboard panel query returns data.
        assert not empty, f"dashboard queries without data: {empty}\n{prometheus.logs()}"

        # promtool finds nothing to complain about in the live exposition.
        with urllib.request.urlopen(url, timeout=10) as response:
            exposition = response.read()
        check = subprocess.run([require_binary("promtool"), "check", "metrics"], input=exposition,
                               capture_output=True, timeout=60, check=False)
        assert check.returncode == 0 and not (check.stdout + check.stderr).strip(), check.stdout + check.stderr
        assert not re.search(rb"_created\b", exposition)
    finally:
        agent.stop()
