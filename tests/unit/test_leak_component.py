"""The leak component on the CUDA path, fed allocator stats, NVML and snapshots in torch's exact shapes.

No GPU here: the allocator probe reads a flattened ``memory_stats`` dict (TORCH_MEMORY_API.md §1.1),
NVML is a fake module with pynvml's call shapes, and snapshots are ``_snapshot()`` dicts (§2.2).
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from fakes import FakeGpu, FakeNvml

from gpumemd.agent import Agent
from gpumemd.api import build_agent
from gpumemd.components.leak import LeakComponent, LeakOptions
from gpumemd.config import Config
from gpumemd.probes.device.allocation_history import AllocationHistory
from gpumemd.probes.device.allocator import AllocatorProbe
from gpumemd.probes.device.nvml import NvmlProbe
from gpumemd.records.device import Device
from gpumemd.records.step import Identity

MIB = 1024 * 1024
GIB = 1024 * MIB
ONSET = 60


class FakeDevice:
    """A job whose step-end allocated bytes grow by ``leak`` per step from ONSET (and/or whose
    cache fragments by ``frag`` per step); ``snapshot()`` shows the leaked blocks at train.py:57."""

    def __init__(self, leak: int = 0, frag: int = 0) -> None:
        self.step = 0
        self.leak = leak
        self.frag = frag

    def leaked_blocks(self) -> int:
        return max(0, self.step - ONSET)

    def stats(self, device: int) -> dict[str, int]:
        allocated = 4 * GIB + self.leaked_blocks() * self.leak + (self.step % 3) * 512 * 1024
        reserved = 6 * GIB + self.leaked_blocks() * (self.leak + self.frag)
        return {
            "allocated_bytes.all.current": allocated,
            "allocated_bytes.all.peak": allocated + GIB,
            "reserved_bytes.all.current": reserved,
            "reserved_bytes.all.peak": reserved,
            "inactive_split_bytes.all.current": self.leaked_blocks() * self.frag,
            "segment.all.current": 10,
        }

    def snapshot(self) -> dict[str, Any]:
        frames = [
            # torch's frames as Python records them: under the installed torch package
            {"filename": os.path.join(os.path.dirname(torch.__file__), "nn", "modules", "linear.py"), "line": 125,
             "name": "forward"},
            {"filename": "/job/train.py", "line": 57, "name": "main"},
        ]
        params = {"address": 0, "size": 4 * GIB, "requested_size": 4 * GIB, "state": "active_allocated", "frames": []}
        leaked = [{"address": 0, "size": self.leak, "requested_size": self.leak, "state": "active_allocated",
                   "frames": frames} for _ in range(self.leaked_blocks())]
        blocks: list[dict[str, Any]] = [params, *leaked]
        total = sum(b["size"] for b in blocks)
        return {"segments": [{"device": 0, "address": 1 << 40, "total_size": total, "allocated_size": total,
                              "active_size": total, "requested_size": total, "stream": 0, "segment_type": "large",
                              "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": blocks}],
                "device_traces": [[]]}


class HistoryTorch:
    """Torch's allocation-history switch, recording what it was asked (``(enabled, max_entries)``)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str | None, int | None]] = []
        self.cuda = SimpleNamespace(memory=SimpleNamespace(_record_memory_history=self._record))
        self._C = SimpleNamespace()  # no _cuda_isHistoryEnabled: the job records nothing itself

    def _record(self, enabled: str | None = "all", context: str | None = "all", stacks: str = "all",
                max_entries: int | None = None) -> None:
        self.calls.append((enabled, max_entries))


def run(device: FakeDevice, out_dir: str, steps: int = 300, before_stop: list[Any] | None = None,
        **config: Any) -> tuple[Agent, LeakComponent, list[tuple[str | None, int | None]]]:
    torch_history = HistoryTorch()
    config_ = Config(output_dir=out_dir, sample_interval_s=0, census=False, leak_warmup_steps=20,
                     leak_window_steps=100, leak_check_every_steps=10, leak_min_bytes_per_step=256 * 1024, **config)
    component = LeakComponent(config_.options(LeakOptions), census=None, snapshot_fn=device.snapshot,
                              history=AllocationHistory(torch_history))
    agent = build_agent(
        config_,
        allocator_probe=AllocatorProbe(stats_fn=device.stats, is_initialized=lambda: True, device_count=lambda: 1),
        nvml_probe=NvmlProbe(nvml=FakeNvml([FakeGpu(used=12 * GIB)]), visible="0"),
        identity=Identity(rank=3, world_size=4),
        components=[component],
        max_stride=1,  # a mechanism test: every step sampled (the scenario suite runs at defaults)
    )
    agent.start()
    try:
        for step in range(steps):
            device.step = step
            agent.mark_step(step)
        if before_stop is not None:  # what history looked like while the job still ran (stop switches it off)
            before_stop.extend(torch_history.calls)
        return agent, component, torch_history.calls
    finally:
        agent.stop()


def test_allocated_leak_names_the_allocation_site_once_history_is_on(out_dir: str) -> None:
    device = FakeDevice(leak=2 * MIB)
    agent, component, history_calls = run(device, out_dir, leak_history_on_suspect=True, history_max_entries=5000)
    # switched on once, when the leak was first suspected, and off once its sites were named
    assert history_calls == [("all", 5000), (None, None)]
    findings = agent.findings()
    assert [(f.kind, f.series, f.state) for f in findings] == [("tensor_leak", "allocated_bytes{device=0}",
                                                               "confirmed")]
    f = findings[0]
    assert f.slope_bytes_per_step == pytest.approx(2 * MIB, rel=0.05)
    assert f.device == Device.cuda(0) and abs((f.onset_step or 0) - ONSET) <= 15
    # headroom = NVML free + allocator cache beyond the step's peak; OOM when the leak has eaten it
    state = agent.state()
    sample = state.allocator[0]
    headroom = state.nvml[0].free_bytes + max(0, (sample.reserved_bytes or 0) - (sample.allocated_peak_bytes or 0))
    assert f.steps_to_oom == pytest.approx(headroom / f.slope_bytes_per_step, rel=0.01)  # read 9 steps earlier
    assert f.sites and f.sites[0].startswith("train.py:57 in main (+")
    assert "allocated at train.py:57 in main" in f.summary
    assert not component._sites.enabled_by_us  # off once the sites are named
    # the findings file carries the rank in its name and one line per state change
    path = os.path.join(out_dir, "leak-findings-rank3.jsonl")
    assert component.findings_path == path
    with open(path, encoding="utf-8") as fh:
        states = [json.loads(line)["state"] for line in fh]
    assert states == ["suspected", "confirmed"]


def test_growing_cache_is_fragmentation_not_a_tensor_leak(out_dir: str) -> None:
    agent, _, history_calls = run(FakeDevice(frag=1 * MIB), out_dir)
    kinds = {(f.kind, f.series) for f in agent.findings()}
    assert kinds == {("fragmentation", "inactive_split_bytes{device=0}")}  # what empty_cache() cannot release
    assert history_calls == []  # history is only for tensor leaks, and off by default


def test_flat_device_raises_nothing(out_dir: str) -> None:
    agent, _, _ = run(FakeDevice(), out_dir)
    assert agent.findings() == []
    assert not os.path.exists(os.path.join(out_dir, "leak-findings-rank3.jsonl"))


class PassingLeak(FakeDevice):
    """A suspicion that clears: the leaked blocks are freed 50 steps after ONSET (a cache that filled)."""

    def leaked_blocks(self) -> int:
        n = super().leaked_blocks()
        return n if n < 50 else 0


def test_history_switched_on_at_suspicion_goes_off_when_it_clears(out_dir: str) -> None:
    running: list[Any] = []
    run(PassingLeak(leak=2 * MIB), out_dir, before_stop=running, leak_history_on_suspect=True,
        history_max_entries=5000)
    with open(os.path.join(out_dir, "leak-findings-rank3.jsonl"), encoding="utf-8") as fh:
        assert [json.loads(line)["state"] for line in fh] == ["suspected", "cleared"]
    assert running == [("all", 5000), (None, None)]  # never confirmed, yet off again while the job runs


class GraphPool(FakeDevice):
    """torch.compile "reduce-overhead": each new shape records a CUDA graph whose private pool grows
    by what its blocks hold; allocated bytes grow with it (reserved_bytes_by_private_pools, 2.13)."""

    def stats(self, device: int) -> dict[str, int]:
        stats = super().stats(device)
        stats["reserved_bytes_by_private_pools.1_0.all.current"] = self.leaked_blocks() * self.leak
        return stats


def test_private_pool_growth_is_not_an_allocated_bytes_leak(out_dir: str) -> None:
    agent, _, _ = run(GraphPool(leak=2 * MIB), out_dir)
    assert [f.series for f in agent.findings() if f.series.startswith("allocated_bytes")] == []



def test_a_count_series_of_a_group_born_later_starts_with_the_zeros_it_had() -> None:
    """A group first counted at a late scan (a leak from there on) gets its series with the counts it
    had at the earlier scans, zeros where it was absent: its track covers the job's history, so the
    detector can judge its ramp against a flat start at once, not a window after its birth."""
    from gpumemd.analysis.leak_types import SeriesSpec
    from gpumemd.components.leak_counts import _COUNT_MIN
    from gpumemd.components.leak_series import LeakSeries

    series = LeakSeries(Config(output_dir="unused").options(LeakOptions), SimpleNamespace(),  # type: ignore[arg-type]
                        tracker=None, chains=None)
    fed: list[tuple[str, int, float]] = []
    series.detector.observe = lambda name, step, value, phase="train": fed.append((name, step, value))  # type: ignore[method-assign]
    spec = SeriesSpec("tensors{device=cpu,group=float32[256]}", "tensor_leak", Device.of("cpu"), sparse=True,
                      unit="tensors")
    few = SeriesSpec("tensors{device=cpu,group=float32[8]}", "tensor_leak", Device.of("cpu"), sparse=True,
                     unit="tensors")
    for step in range(100, 500, 50):
        groups = [("few", _COUNT_MIN - 1, lambda: few)]  # present at every scan, never watched
        if step == 450:
            groups.append(("leak", _COUNT_MIN + 1, lambda: spec))
        series.scans._observe_groups(series.scans.counts, step, "train", groups)
    assert [(s, v) for name, s, v in fed if name == spec.name] == [*((s, 0) for s in range(100, 450, 50)),
                                                                   (450, _COUNT_MIN + 1)]
    assert not any(name == few.name for name, _, _ in fed)


def test_host_growth_over_a_long_episode_is_stated_below_the_windows_floor() -> None:
    """A CPU tensor finding states host RSS's growth since its onset. Over one window a burst of RSS
    (``RSS_BURST_BYTES``) can fake 16 KiB/step; over a long episode it cannot, so growth under that
    floor is still stated there: judged by the window's floor, a finding that had said "host RSS +45
    KiB/step, out of memory in ~8 h" ended projecting from its 4 B/step of tensors, "~127 days"."""
    import dataclasses

    from gpumemd.analysis.leak_types import LeakState, SeriesSpec, TrackStatus
    from gpumemd.analysis.leak_verdicts import UNCOVERED
    from gpumemd.components.leak_series import RSS_BURST_BYTES, LeakSeries

    options = Config(output_dir="unused").options(LeakOptions)
    agent = SimpleNamespace(published=SimpleNamespace(host=None, updated_at=0.0))  # no headroom read yet
    series = LeakSeries(options, agent, tracker=None, chains=None)  # type: ignore[arg-type]
    host = series.host_spec
    series.detector.add_series(host)
    rate = 10 * 1024  # under the window's floor (16 KiB/step), far over a 6,000-step episode's
    for step in range(6_001):
        series.detector.observe(host.name, step, 1e9 + max(0, step - 100) * rate)
    tensors = SeriesSpec("tensors{device=cpu,group=float32[1]}", "tensor_leak", Device.of("cpu"), sparse=True,
                         unit="tensors", unit_bytes=4)
    status = TrackStatus(spec=tensors, phase="train", state=LeakState.CONFIRMED, changed=True, step=6_000,
                         first_step=400, verdict=UNCOVERED, window_start=5_500, onset_step=100, growth_bytes=5_900)
    assert rate >= RSS_BURST_BYTES / 5_900
    assert series.host_rate(status) == pytest.approx(rate, rel=0.01)
    early = dataclasses.replace(status, step=600)  # one window in: a burst could fake this rate
    assert series.host_rate(early) is None
