"""The batch-size search on synthetic peak curves (no torch: the search is pure over run())."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumemd.batch_size import Try, search


def runner(peak: Callable[[int], int], budget: int, calls: list[int]) -> Callable[[int], Try]:
    def run(size: int) -> Try:
        calls.append(size)
        value = peak(size)
        if value > budget:  # a real allocator would have raised
            return Try(size, ran=False, peak_bytes=None, fits=False)
        return Try(size, ran=True, peak_bytes=value, fits=True)

    return run


@settings(max_examples=200, deadline=None)
@given(
    fixed=st.integers(0, 10**9),
    slope=st.integers(1, 10**7),
    headroom=st.integers(1, 10**10),
    start=st.integers(1, 64),
    max_size=st.integers(64, 4096),
)
def test_linear_peaks_land_on_the_margin_target(fixed: int, slope: int, headroom: int, start: int,
                                                max_size: int) -> None:
    budget = -(-(fixed + slope) * 10 // 9) + headroom  # batch size 1 always fits within the margin
    calls: list[int] = []
    size, peak = search(runner(lambda b: fixed + slope * b, budget, calls), start=start, max_size=max_size,
                        budget_bytes=budget, margin=0.1, max_tries=12)
    assert peak == fixed + slope * size <= budget * 0.9  # the margin is kept, not only steered towards
    assert 1 <= size <= max_size
    assert len(calls) <= 12
    target = budget * 0.9
    expected = min(max_size, max(1, int((target - fixed) // slope)))
    # the answer is the largest size under the margin target (or the last that fit, when even
    # `start` is over the target), up to one unit of float rounding
    assert size >= min(expected, max(s for s in calls if fixed + slope * s <= target)) - 1


@settings(max_examples=100, deadline=None)
@given(
    flat=st.integers(10**6, 10**9),
    knee=st.integers(1, 2000),
    slope=st.integers(1, 10**6),
    multiple_of=st.sampled_from([1, 8]),
)
def test_flat_then_linear_peaks_never_exceed_the_budget(flat: int, knee: int, slope: int, multiple_of: int) -> None:
    # Below the knee the optimizer step's temporaries dominate (flat); above it activations do.
    def peak(b: int) -> int:
        return max(flat, flat + slope * (b - knee))

    budget = -(-(flat + slope * 3000) * 10 // 9)  # the default margin (10%) above flat + slope·3000
    calls: list[int] = []
    size, measured = search(runner(peak, budget, calls), start=8, max_size=1 << 16, budget_bytes=budget,
                            max_tries=16, multiple_of=multiple_of)
    assert measured == peak(size) <= budget * 0.9
    assert size % multiple_of == 0
    assert len(calls) <= 16
    assert all(b2 <= 4 * max(b for b in calls[: i + 1] if peak(b) <= budget) for i, b2 in enumerate(calls[1:]))


def test_start_too_large_halves_until_it_fits() -> None:
    calls: list[int] = []
    size, _ = search(runner(lambda b: 100 * b, 1000, calls), start=64, max_size=64, budget_bytes=1000,
                     margin=0.0)
    assert calls[:4] == [64, 32, 16, 8]
    assert size == 10


def test_nothing_fits() -> None:
    with pytest.raises(RuntimeError, match=r"batch size 1 does not fit in 9 bytes \(10 less the margin of 10%\)"):
        search(runner(lambda b: 100 * b, 10, []), start=4, max_size=8, budget_bytes=10)


def test_a_size_that_ran_at_99_percent_of_the_capacity_does_not_fit() -> None:
    calls: list[int] = []
    size, peak = search(runner(lambda b: b, 100, calls), start=99, max_size=99, budget_bytes=100, margin=0.1)
    assert calls[0] == 99 and size <= 90 and peak <= 90


def test_find_batch_size_refuses_under_torch_distributed(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from gpumemd.batch_size import find_batch_size

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 8)
    ran: list[int] = []
    with pytest.raises(RuntimeError, match=r"world size 8.*torchrun --nproc-per-node 1"):
        find_batch_size(ran.append, budget_bytes=1 << 30, device="cpu")
    assert ran == []  # refused before the first try
