"""Tensors kept in a ``deque(maxlen=N)`` stop growing at N: a healthy job's window of recent outputs is
no leak, and says nothing. Growth that goes on past the bound, or a bound the memory left cannot
hold, is still a leak. At default settings."""

from __future__ import annotations

import collections
import logging
import os
from typing import Any

import torch

import gpumemd


def _train(steps: int, keep: Any, out_dir: str, *, also: list[Any] | None = None, size: int = 0,
           graphs: bool = False) -> tuple[list[Any], list[str]]:
    """A small MLP for ``steps`` steps that puts each step's outputs (or a zero tensor of ``size``
    floats, or with ``graphs`` the loss with its retained graph) into ``keep`` (and the same tensor into
    ``also``); its findings and WARNING lines."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    warnings: list[str] = []

    class _Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    handler = _Lines()
    logging.getLogger("gpumemd").addHandler(handler)
    try:
        with gpumemd.attached(output_dir=out_dir) as agent:
            for _ in range(steps):
                x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
                out = model(x)
                loss = torch.nn.functional.cross_entropy(out, y)
                opt.zero_grad()
                loss.backward(retain_graph=graphs)
                opt.step()
                kept = loss if graphs else torch.zeros(size) if size else out.detach()
                keep.append(kept)
                if also is not None:
                    also.append(kept)
            findings = list(agent.findings())
    finally:
        logging.getLogger("gpumemd").removeHandler(handler)
    return findings, warnings


def test_a_window_of_recent_outputs_in_a_bounded_deque_is_no_leak(tmp_path: os.PathLike[str]) -> None:
    recent_outputs: collections.deque[torch.Tensor] = collections.deque(maxlen=1_000)
    findings, warnings = _train(3_000, recent_outputs, str(tmp_path))
    assert findings == [], [f.summary for f in findings]
    assert not [line for line in warnings if "leak" in line], warnings
    assert not os.path.exists(os.path.join(tmp_path, "leak-findings-rank0.jsonl"))


def test_recent_losses_kept_with_their_graphs_in_a_bounded_deque_are_no_leak(tmp_path: os.PathLike[str]) -> None:
    """The graphs' saved tensors (inputs, targets) grow and settle with the deque that keeps the losses:
    no line for them either, not even that they stopped."""
    recent_losses: collections.deque[torch.Tensor] = collections.deque(maxlen=1_000)
    findings, warnings = _train(3_000, recent_losses, str(tmp_path), graphs=True)
    assert findings == [], [f.summary for f in findings]
    assert not [line for line in warnings if "leak" in line or "graph" in line], warnings


def test_the_same_tensors_also_kept_in_a_list_are_a_leak_once_the_deque_is_full(
        tmp_path: os.PathLike[str]) -> None:
    recent_outputs: collections.deque[torch.Tensor] = collections.deque(maxlen=1_000)
    all_outputs: list[torch.Tensor] = []
    findings, warnings = _train(4_000, recent_outputs, str(tmp_path), also=all_outputs)
    [finding] = [f for f in findings if f.kind == "tensor_leak"]
    assert finding.state == "confirmed", finding.summary
    assert [line for line in warnings if "tensor leak confirmed" in line], warnings


def test_a_bound_past_the_memory_left_is_no_bound(tmp_path: os.PathLike[str]) -> None:
    """64 KiB a step into a deque of ten million: ~640 GB when full, more than this machine has."""
    huge: collections.deque[torch.Tensor] = collections.deque(maxlen=10**7)
    findings, _ = _train(2_000, huge, str(tmp_path), size=16 * 1024)
    [finding] = [f for f in findings if f.kind == "tensor_leak"]
    assert finding.state in ("suspected", "confirmed") and "maxlen 10,000,000" in finding.summary, finding.summary
