"""Host RSS that rises while a census diff shows tensors grown: the tensors explain it only by what they
gained while RSS rose. A fast loop's censuses are thousands of steps apart; one from before a
deque(maxlen=1000) of graphs filled counted the whole fill, over before RSS (lagging it on a fragmented
heap) crept past its level, and a healthy job was told of a graph leak."""

from __future__ import annotations

from gpumemd.components.leak_counts import GroupSeries, grown_since
from gpumemd.probes.survival.survivor_counts import GroupKey
from gpumemd.records.findings import Culprit

SAVED: GroupKey = ("cpu", "float32", (32, 128), True)
SAVED_ON_GPU: GroupKey = ("cuda:0", "float32", (32, 128), True)
KIB = 1024


def _deque_of_graphs() -> GroupSeries[GroupKey]:
    """Two saved tensors a step into a deque of 1,000 graphs from step 0, full at 1,000, then churned;
    scans every 100 steps. The same group on a GPU fills at another time."""
    counts: GroupSeries[GroupKey] = GroupSeries()
    for step in range(100, 1_700, 100):
        counts.count_past.append((step, {SAVED: 2 * min(step, 1_000), SAVED_ON_GPU: 2 * step}))
    return counts


def _culprit(count: int) -> Culprit:
    return Culprit(description="float32[32, 128] with grad_fn", count_delta=count, bytes_delta=count * 16 * KIB,
                   category="graph")


def test_a_group_that_stopped_growing_before_rss_rose_explains_none_of_it() -> None:
    assert grown_since(_deque_of_graphs(), _culprit(2_000), since=1_100) == 0.0


def test_a_group_explains_what_it_gained_since_the_rise() -> None:
    # since 850: the scan at 800 counted 1,600, the newest 2,000: 400 of the census's 2,000 tensors
    assert grown_since(_deque_of_graphs(), _culprit(2_000), since=850) == 400 * 16 * KIB


def test_without_counts_that_reach_back_the_census_growth_stands() -> None:
    counts = _deque_of_graphs()
    assert grown_since(counts, _culprit(2_000), since=50) == 2_000 * 16 * KIB  # before the kept scans
    other = Culprit(description="float32[8] (parameter)", count_delta=4, bytes_delta=128)
    assert grown_since(counts, other, since=1_100) == 128  # no survivor group is described so
