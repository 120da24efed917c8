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
from gpumemd.probes.heap.host_objects import ContainerGrowth
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
    """Looks whose heap shows nothing grown, and malloc's in-use bytes as the test sets them, read (as the
    leak component does at an evaluation's start) by ``state.read(step)``."""
    state = SimpleNamespace(in_use=100 * MIB)

    def nothing_grown(*args: Any, **kwargs: Any) -> Any:
        yield
        return []

    monkeypatch.setattr(leak_host.host_objects, "growing_containers_stepwise", nothing_grown)
    monkeypatch.setattr(leak_host.host_objects, "growing_graph", lambda *args, **kwargs: None)
    state.looks = HostLooks(window_steps=WINDOW, overhead_budget=0.01, clock=lambda: 0.0,
                            container_lengths=dict, largest_graph_nodes=lambda: 0, in_use=lambda: state.in_use)
    state.job = SimpleNamespace(steps_total=1_000, seconds_per_step=0.01, current_step=None)
    state.read = lambda step: state.looks.read_in_use(step, state.job, force=True)
    run_to_end(state.looks.look_stepwise(1_000, state.job))  # the baseline, with 100 MiB in use
    state.read(1_000)
    return state


def _culprits(heap: SimpleNamespace, step: int, headroom: float = 8e9) -> Any:
    heap.job.current_step = step
    heap.read(step)
    return run_to_end(heap.looks.culprits(_status(step, 40_960.0), heap.job, ignore=set(), headroom=headroom))


def test_rss_grown_with_malloc_in_use_flat_is_fragmentation_and_looked_at_again_a_window_on(
        heap: SimpleNamespace) -> None:
    # 40 KiB/step over 400 steps since the first reading inside the window: ~16 MiB of RSS, malloc +1 MiB
    heap.in_use += MIB
    evidence = _culprits(heap, 1_400)
    assert evidence.fragmented and evidence.bounded_until == 1_400 + WINDOW and not evidence.culprits


def test_malloc_in_use_grown_with_rss_is_no_fragmentation(heap: SimpleNamespace) -> None:
    heap.in_use += 12 * MIB  # a C extension's leak: malloc hands out most of what RSS gained
    evidence = _culprits(heap, 1_400)
    assert not evidence.culprits and not evidence.fragmented and evidence.bounded_until is None  # said
    # ... saying what was ruled out and where it grows: 12 MiB over the 400 steps since the first reading
    assert evidence.sentence == ("no Python object grew with it, and malloc's bytes in use rose +30.7 KiB/step: "
                                 "memory a C extension or a native library allocates")


def test_fragmentation_past_an_eighth_of_the_memory_left_is_said(heap: SimpleNamespace) -> None:
    assert _culprits(heap, 1_400, headroom=100 * MIB) == NO_EVIDENCE


def test_a_reading_of_malloc_older_than_the_window_is_not_judged_from(heap: SimpleNamespace) -> None:
    """Malloc +30 MiB since a reading 500 steps before the window: the growth of another time (or this
    leak's). A fresh look is taken, and the finding withheld until it can be compared with."""
    heap.in_use += 30 * MIB
    evidence = _culprits(heap, 2_000)
    assert evidence.bounded_until == 2_000 + WINDOW // 2 and not evidence.fragmented and not evidence.culprits
    heap.in_use += 12 * MIB  # then malloc grows with RSS: a leak no Python object shows, said
    said = _culprits(heap, 2_250)
    assert said.bounded_until is None and not said.fragmented and "malloc's bytes in use rose" in (said.sentence or "")


def test_malloc_is_compared_over_half_a_window_at_least(heap: SimpleNamespace) -> None:
    """Over 100 steps, a few hundred KiB of noise in malloc's bytes in use outweigh a quarter of RSS's
    growth: the finding waits until the first reading inside the window is half a window old."""
    heap.read(1_900)  # the reading at 1,000 is outside the window (1,500-2,000)
    heap.in_use += 2 * MIB
    evidence = _culprits(heap, 2_000)
    assert evidence.bounded_until == 1_900 + WINDOW // 2 and not evidence.fragmented and not evidence.culprits


@pytest.mark.parametrize(("malloc_grown", "named"), [(MIB, False), (12 * MIB, True)])
def test_a_container_holding_little_of_the_growth_is_named_only_if_malloc_grew(
        heap: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, malloc_grown: int, named: bool) -> None:
    """A list that gains a tuple per check (512 B) beside ~16 MiB of RSS: the heap fragmenting when malloc
    stayed flat; when malloc grew, its items may hold more than their shallow sizes, and it is named."""
    def small_list(*args: Any, **kwargs: Any) -> Any:
        yield
        return [ContainerGrowth("list", "tuple", items_added=8, approx_bytes=512, length=37, holder="`tracked`")]

    monkeypatch.setattr(leak_host.host_objects, "growing_containers_stepwise", small_list)
    heap.in_use += malloc_grown
    evidence = _culprits(heap, 1_400)
    assert evidence.fragmented is not named
    assert [c.holder for c in evidence.culprits] == (["`tracked`"] if named else [])


def test_a_fill_that_stopped_before_the_window_is_not_held_against_its_fragmentation(heap: SimpleNamespace) -> None:
    """A deque(maxlen=N) of graphs filled after the baseline (malloc +30 MiB), then churned while RSS
    crept on: the window is judged from the first reading of malloc's bytes in use inside it."""
    heap.in_use += 30 * MIB  # the fill, over before the window the verdict judges (1,500-2,000)
    heap.read(1_600)
    heap.in_use += MIB // 2
    evidence = _culprits(heap, 2_000)
    assert evidence.fragmented and evidence.bounded_until == 2_000 + WINDOW and not evidence.culprits


def test_without_a_baseline_a_look_is_taken_and_the_finding_waits_for_it() -> None:
    looks = HostLooks(window_steps=WINDOW, overhead_budget=0.01, clock=lambda: 0.0, container_lengths=dict,
                      largest_graph_nodes=lambda: 0, in_use=lambda: 100 * MIB)
    job = SimpleNamespace(steps_total=2_000, seconds_per_step=0.01, current_step=2_000)
    looks.read_in_use(2_000, job)
    evidence = run_to_end(looks.culprits(_status(2_000, 40_960.0), job, ignore=set(), headroom=8e9))
    assert evidence.bounded_until == 2_000 + WINDOW // 2 and not evidence.culprits


def test_readings_keep_to_the_budget_unless_a_search_needs_one() -> None:
    reads: list[int] = []
    ticks = iter(range(1_000_000))  # each clock reading a second later: a reading costs 1 s

    def in_use() -> int:
        reads.append(1)
        return 100 * MIB

    looks = HostLooks(window_steps=WINDOW, overhead_budget=0.01, clock=lambda: float(next(ticks)),
                      container_lengths=dict, largest_graph_nodes=lambda: 0, in_use=in_use)
    job = SimpleNamespace(steps_total=1_000, seconds_per_step=0.001)
    looks.read_in_use(1_000, job)
    looks.read_in_use(1_000, job, force=True)  # one reading a step
    for step in range(1_050, 2_000, 50):  # 1 ms steps have not paid for a 1 s reading within the share
        job.steps_total = step
        looks.read_in_use(step, job)
    assert len(reads) == 1
    looks.read_in_use(2_000, job, force=True)  # a search of host RSS's culprits compares with it
    assert len(reads) == 2


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
