"""Kineto's start/stop lines stay out of the job's stderr; everything else written meanwhile is kept
(``find_batch_size`` on CPU printed a dozen ``USDT:... profiler_start`` lines)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import gpumemd
from gpumemd.probes.planning.cpu_peak import measure_cpu_peak
from gpumemd.probes.planning.native_stderr import is_kineto_line, native_stderr_filtered

KINETO = b"USDT:2026-11-23 19:23:58 16452:16452 SyncActivityProfilerHandler.cpp:52] profiler_start\n"


def test_kineto_lines_are_recognised_and_nothing_else() -> None:
    assert is_kineto_line(KINETO)
    assert is_kineto_line(b"STAGE:2026-11-23 19:23:33 16243:16243 SyncActivityProfilerHandler.cpp:51] Completed\n")
    assert not is_kineto_line(b"USDT: my own line\n")
    assert not is_kineto_line(b"Traceback (most recent call last):\n")


def test_only_kineto_lines_vanish_in_order(capfd: pytest.CaptureFixture[str]) -> None:
    with native_stderr_filtered():
        os.write(2, b"before\n" + KINETO)
        print("python-level line", file=sys.stderr)
        os.write(2, b"after\n")
    os.write(2, b"outside\n")
    err = capfd.readouterr().err
    # pytest captures sys.stderr apart from fd 2, so only the descriptor's lines have an order here
    assert err.replace("python-level line\n", "") == "before\nafter\noutside\n"
    assert "python-level line\n" in err


def test_lines_written_before_an_exception_are_kept(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(KeyError), native_stderr_filtered():
        os.write(2, b"kept\n" + KINETO)
        raise KeyError("the block's own exception passes unchanged")
    assert capfd.readouterr().err == "kept\n"


def test_cpu_peak_and_batch_size_search_print_nothing(capfd: pytest.CaptureFixture[str]) -> None:
    _, peak = measure_cpu_peak(lambda: torch.randn(1024))
    assert peak.peak_bytes >= 4096
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch_size: int) -> None:
        model(torch.randn(batch_size, 64)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    found, _ = gpumemd.find_batch_size(step, start=8, max=64, budget_bytes=50_000_000)
    assert found == 64
    err = capfd.readouterr().err
    assert "profiler_start" not in err and "profiler_stop" not in err, err
