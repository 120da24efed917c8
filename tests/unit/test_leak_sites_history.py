"""Allocation history switched on for a suspicion goes off (if ours) once every suspicion that asked
for it is decided: confirmed, cleared or withdrawn; never while another on the device is still open."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from gpumemd.analysis.leak_types import LeakState, SeriesSpec, TrackStatus
from gpumemd.analysis.trend import Slope, Verdict
from gpumemd.components.leak_options import LeakOptions
from gpumemd.components.leak_sites import AllocationSites
from gpumemd.config import Config
from gpumemd.probes.device.allocation_history import AllocationHistory
from gpumemd.records.device import Device


class _HistoryTorch:
    def __init__(self) -> None:
        self.calls: list[str | None] = []
        self.cuda = SimpleNamespace(memory=SimpleNamespace(_record_memory_history=self._record))
        self._C = SimpleNamespace()

    def _record(self, enabled: str | None = "all", context: str | None = "all", stacks: str = "all",
                max_entries: int | None = None) -> None:
        self.calls.append(enabled)


def _status(name: str, state: LeakState | None, *, changed: bool = True) -> TrackStatus:
    verdict = Verdict(passed=state is not None, reason="leak", slope=Slope(1.0, 0.5, 2.0, 10),
                      p_increasing=0.0)
    return TrackStatus(spec=SeriesSpec(name, "tensor_leak", device=Device.cuda(0)), phase="train", state=state,
                       changed=changed, step=100, first_step=90, verdict=verdict, window_start=0.0,
                       onset_step=90, growth_bytes=1.0)


def _sites() -> tuple[AllocationSites, _HistoryTorch]:
    torch_ = _HistoryTorch()
    options = Config(leak_history_on_suspect=True).options(LeakOptions)
    snapshot: dict[str, Any] = {"segments": [], "device_traces": [[]]}
    return AllocationSites(options, AllocationHistory(torch_), snapshot_fn=lambda: snapshot), torch_


def test_a_cleared_suspicion_switches_history_off() -> None:
    sites, torch_ = _sites()
    sites.sites(_status("allocated_bytes{device=0}", LeakState.SUSPECTED))
    assert torch_.calls == ["all"] and sites.enabled_by_us
    sites.settle(_status("allocated_bytes{device=0}", LeakState.CLEARED))
    assert torch_.calls == ["all", None] and not sites.enabled_by_us


def test_a_withdrawn_suspicion_switches_history_off_but_not_while_another_is_open() -> None:
    sites, torch_ = _sites()
    sites.sites(_status("allocated_bytes{device=0}", LeakState.SUSPECTED))
    sites.sites(_status("census_bytes{device=cuda:0}", LeakState.SUSPECTED))
    sites.settle(_status("census_bytes{device=cuda:0}", None))  # explained by the other: withdrawn
    assert torch_.calls == ["all"]  # the allocated-bytes suspicion still needs its sites
    sites.settle(_status("reserved_bytes{device=0}", LeakState.CLEARED))  # never noted here: no effect
    assert torch_.calls == ["all"]
    sites.sites(_status("allocated_bytes{device=0}", LeakState.CONFIRMED))
    assert torch_.calls == ["all", None]
