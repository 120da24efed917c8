"""Pages a job maps from files (a memory-mapped dataset, as Arrow and np.memmap read) count in its RSS but are
page cache the kernel takes back when memory runs short: the host probe reads them apart (statm's
``shared``), and the leak detector's host series leaves them out, so reading through a dataset is no leak
and sets off no search for one."""

from __future__ import annotations

import mmap
import tempfile
from pathlib import Path

import pytest
import torch

import gpumemd
from gpumemd.components.leak import LeakComponent
from gpumemd.probes.process.host import HostProbe

MiB = 1024**2

pytestmark = pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads /proc/self/statm")


def _mapped(path: Path, size: int) -> mmap.mmap:
    with open(path, "wb") as f:
        f.truncate(size)  # sparse: reading it still fills the page cache, page by page
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def test_the_host_probe_reads_the_pages_mapped_from_a_file_apart(tmp_path: Path) -> None:
    probe = HostProbe()
    data = _mapped(tmp_path / "dataset.bin", 64 * MiB)
    try:
        before = probe.resident()
        for offset in range(0, 64 * MiB, 4096):
            data[offset]  # touch each page through the mapping
        after = probe.resident()
        sample = probe.read()
    finally:
        data.close()
    assert before is not None and after is not None and before[1] is not None and after[1] is not None
    assert after[0] - before[0] >= 60 * MiB  # RSS grew by the pages read...
    assert after[1] - before[1] >= 60 * MiB  # ...all of them mapped from the file
    assert sample is not None and sample.file_bytes is not None and sample.file_bytes >= 60 * MiB


def test_reading_through_a_mapped_dataset_is_no_host_leak_and_no_search_for_one(tmp_path: Path) -> None:
    steps, per_step = 1500, 256 * 1024  # 375 MiB of the file's pages resident by the end
    data = _mapped(tmp_path / "dataset.bin", steps * per_step)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    y = torch.randint(0, 10, (32,))
    try:
        with gpumemd.attached(output_dir=tempfile.mkdtemp(dir=tmp_path), quiet=True) as agent:
            for step in range(steps):
                start = step * per_step
                for offset in range(start, start + per_step, 4096):
                    data[offset]  # the batch's bytes, read through the mapping
                loss = torch.nn.functional.cross_entropy(model(torch.randn(32, 64)), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
            host = agent.state().host
            leak = agent.component(LeakComponent)
            assert host is not None and host.file_bytes is not None and host.file_bytes >= 300 * MiB
            assert agent.state().findings == ()
            assert leak is not None and leak.host_look_seconds == 0.0  # no look for a culprit ever began
    finally:
        data.close()
