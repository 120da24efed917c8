"""Shared fixtures: every test leaves no agent, hook or thread behind."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator

import pytest

# One intra-op thread for torch here and in every job a test starts (they inherit the environment),
# set before anything imports torch. The tests' tensors are tiny: a second OpenMP thread only
# synchronises, and where the cores are busy its spinning made an 800-step job take 26 s instead
# of 1.7 s. Nothing gpumemd reports depends on torch's thread count.
os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture(autouse=True)
def _no_agent_left_behind() -> Iterator[None]:
    excepthook, thread_excepthook = sys.excepthook, threading.excepthook
    yield
    import gpumemd

    gpumemd.detach()
    leftovers = [t.name for t in threading.enumerate() if t.name.startswith("gpumemd")]
    assert not leftovers, f"gpumemd threads left running: {leftovers}"
    if sys.excepthook is not excepthook and sys.excepthook.__name__ == "_distributed_excepthook":
        # torch.distributed.init_process_group installs a "[rankN]:" excepthook and never removes it;
        # tests that start an in-process group must not change how later tests' tracebacks look.
        sys.excepthook = excepthook
    assert sys.excepthook is excepthook, f"sys.excepthook left replaced by {sys.excepthook!r}"
    assert threading.excepthook is thread_excepthook, "threading.excepthook left replaced"


@pytest.fixture
def out_dir(tmp_path):  # type: ignore[no-untyped-def]
    """A fresh output directory for the agent."""
    return str(tmp_path / "gpumemd-out")
