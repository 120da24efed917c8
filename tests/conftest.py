"""Shared fixtures: every test leaves no agent, hook or thread behind."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _no_agent_left_behind() -> Iterator[None]:
    yield
    import gpumemd

    gpumemd.detach()
    leftovers = [t.name for t in threading.enumerate() if t.name.startswith("gpumemd")]
    assert not leftovers, f"gpumemd threads left running: {leftovers}"


@pytest.fixture
def out_dir(tmp_path):  # type: ignore[no-untyped-def]
    """A fresh output directory for the agent."""
    return str(tmp_path / "gpumemd-out")
