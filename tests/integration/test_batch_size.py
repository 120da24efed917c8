"""Find_batch_size on real CPU training steps with an explicit budget."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn

import gpumemd
from gpumemd.analysis.oom_message import classify_exception
from gpumemd.batch_size import _Runner, find_batch_size


def make_step(calls: list[int] | None = None):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    opt = torch.optim.Adam(model.parameters())

    def step(batch_size: int) -> float:
        if calls is not None:
            calls.append(batch_size)
        x, y = torch.randn(batch_size, 256), torch.randint(0, 10, (batch_size,))
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    return step


def test_finds_the_largest_size_under_the_budget() -> None:
    calls: list[int] = []
    step = make_step(calls)
    budget = 12_000_000
    size, peak = find_batch_size(step, start=8, max=8192, budget_bytes=budget, margin=0.1)
    assert peak <= budget
    assert len(calls) <= 12
    # re-measure independently: the size is honest, and a clearly larger one would not fit
    runner = _Runner(make_step(), "cpu", budget)
    first = runner.run(size)
    assert first.fits
    larger = runner.run(int(size * 1.25) + 1)
    assert not larger.fits
    assert size >= 64  # the model state alone is ~5 MB: there is real room for activations


def test_real_allocation_failure_counts_as_out_of_memory() -> None:
    kept: list[weakref.ref[torch.Tensor]] = []

    def step(batch_size: int) -> None:
        activations = torch.ones(batch_size, 1000)
        kept.append(weakref.ref(activations))
        if batch_size > 100:
            torch.empty(2**60, dtype=torch.uint8)  # a real CPU allocator failure

    size, peak = find_batch_size(step, start=8, max=256, budget_bytes=10**9, max_tries=16)
    assert size == 100
    assert peak >= 100 * 1000 * 4
    assert all(ref() is None for ref in kept)  # the failed tries' frames were released


def test_other_exceptions_propagate_unchanged() -> None:
    error = ValueError("a bug in the user's step")

    def step(batch_size: int) -> None:
        if batch_size > 8:
            raise error

    with pytest.raises(ValueError) as info:
        find_batch_size(step, start=8, max=64, budget_bytes=10**9)
    assert info.value is error


def test_nothing_fits_and_bad_arguments() -> None:
    with pytest.raises(RuntimeError, match="does not fit"):
        find_batch_size(lambda bs: torch.ones(bs, 10_000), start=4, max=64, budget_bytes=1000)
    with pytest.raises(ValueError, match="needs budget_bytes"):
        find_batch_size(lambda bs: None, start=1, max=4, device="cpu")
    with pytest.raises(ValueError, match="max=2"):
        find_batch_size(lambda bs: None, start=4, max=2, budget_bytes=10)


def test_oom_classification() -> None:
    assert classify_exception(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    try:
        torch.empty(2**60, dtype=torch.uint8)
    except RuntimeError as exc:
        assert classify_exception(exc)
    assert classify_exception(RuntimeError("shape mismatch")) is None
    assert classify_exception(ValueError("out of memory")) is None


def test_exported_lazily() -> None:
    assert gpumemd.find_batch_size is find_batch_size
    assert "find_batch_size" in gpumemd.__all__


def test_reset_fn_runs_after_every_try_failed_or_not() -> None:
    """A step_fn that never zeroes its gradients lets one try's gradients count
    against the next; ``reset_fn`` is the documented way to clear them."""
    import gpumemd

    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    calls: list[int] = []

    def step(batch_size: int) -> None:
        if batch_size > 32:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 9999 bytes")
        model(torch.randn(batch_size, 64)).sum().backward()
        optimizer.step()

    def reset() -> None:
        calls.append(1)
        optimizer.zero_grad(set_to_none=True)

    found, _ = gpumemd.find_batch_size(step, start=8, max=64, budget_bytes=1 << 30, reset_fn=reset)
    assert found == 32
    assert len(calls) >= 3 and all(p.grad is None for p in model.parameters())


def test_cuda_capacity_counts_other_processes_and_the_context(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """An 80 GiB GPU capped at 0.9, with 30 GiB used by
    another process, leaves this one free + its own reserved, not 72 GiB."""
    from gpumemd import batch_size

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"total_memory": 80 * gib})())
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda i: 0.9, raising=False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (45 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i: 2 * gib)
    assert batch_size._cuda_capacity("cuda") == 47 * gib
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (78 * gib, 80 * gib))
    assert batch_size._cuda_capacity("cuda:0") == int(80 * gib * 0.9)  # the cap binds
