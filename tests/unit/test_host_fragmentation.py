"""Host RSS that grows while nothing grows in the heap and malloc hands out no more: the heap fragmented
around churning tensors, which is no leak. Malloc's in-use bytes tell it from a C extension's leak."""

from __future__ import annotations

import platform
from types import SimpleNamespace
from typing import Any

import pytest

from gpumemd.analysis.leak_detector import LeakState, SeriesSpec, TrackStatus
from gpumemd.analysis.trend import Slope, Verdict
from gpumemd.components import leak_host
from gpumemd.components.leak_evidence import NO_EVIDENCE
from gpumemd.components.leak_host import HostLooks
from gpumemd.probes.heap.stepwise import run_to_end
from gpumemd.probes.process.malloc_in_use import malloc_in_use
from gpumemd.records.device import CPU

MIB = 1 << 20
WINDOW = 500


def _status(step: int, slope: float) -> TrackStatus:
    verdict = Verdict(passed=True, reason="leak", slope=Slope(slope, slope / 2, slope * 2, 10), p_increasing=0.0)
    return TrackStatus(spec=SeriesSpec("host_rss_bytes", "host_leak", CPU), phase="train", state=LeakState.SUSPECTED,
                       changed=True, step=step, first_step=step, verdict=verdict, window_start=step - WINDOW,
                       onset_step=step - 100, growth_bytes=slope * 100)


@pytest.fixture
def heap(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """Looks whose heap shows nothing grown, and malloc's in-use bytes as the test sets them."""
    state = SimpleNamespace(in_use=100 * MIB)

    def nothing_grown(*args: Any, **kwargs: Any) -> Any:
        yield
        return []

    monkeypatch.setattr(leak_host.host_objects, "growing_containers_stepwise", nothing_grown)
    monkeypatch.setattr(leak_host.host_objects, "growing_graph", lambda *args, **kwargs: None)
    state.looks = HostLooks(window_steps=WINDOW, overhead_budget=0.01, clock=lambda: 0.0,
                            container_lengths=dict, largest_graph_nodes=lambda: 0, in_use=lambda: state.in_use)
    state.job = SimpleNamespace(steps_total=0, seconds_per_step=0.01)
    run_to_end(state.looks.look_stepwise(1_000, state.job))  # the baseline, with 100 MiB in use
    return state


def test_rss_grown_with_malloc_in_use_flat_is_fragmentation_and_looked_at_again_a_window_on(
        heap: SimpleNamespace) -> None:
    # 40 KiB/step over 1,000 steps since the baseline: ~39 MiB of RSS, malloc +1 MiB
    heap.in_use += MIB
    evidence = run_to_end(heap.looks.culprits(_status(2_000, 40_960.0), heap.job, ignore=set(), headroom=8e9))
    assert evidence.fragmented and evidence.bounded_until == 2_000 + WINDOW and not evidence.culprits


def test_malloc_in_use_grown_with_rss_is_no_fragmentation(heap: SimpleNamespace) -> None:
    heap.in_use += 30 * MIB  # a C extension's leak: malloc hands out most of what RSS gained
    evidence = run_to_end(heap.looks.culprits(_status(2_000, 40_960.0), heap.job, ignore=set(), headroom=8e9))
    assert evidence == NO_EVIDENCE


def test_fragmentation_past_an_eighth_of_the_memory_left_is_said(heap: SimpleNamespace) -> None:
    evidence = run_to_end(heap.looks.culprits(_status(2_000, 40_960.0), heap.job, ignore=set(), headroom=200 * MIB))
    assert evidence == NO_EVIDENCE


def test_malloc_in_use_reads_this_process_where_the_c_library_has_mallinfo2() -> None:
    """glibc 2.33 and later have it; elsewhere (musl, macOS) the reading is absent, never made up."""
    libc, version = platform.libc_ver()
    has_mallinfo2 = libc == "glibc" and tuple(int(part) for part in version.split(".")[:2]) >= (2, 33)
    before = malloc_in_use()
    if not has_mallinfo2:
        assert before is None
        return
    assert before is not None
    kept = bytearray(64 * MIB)  # one chunk malloc maps on its own
    after = malloc_in_use()
    assert after is not None and after - before >= 64 * MIB
    del kept
