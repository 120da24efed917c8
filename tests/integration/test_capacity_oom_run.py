"""Acceptance: a capacity OOM under ``gpumemd run``, at defaults. A module global ``x`` is the largest
tensor; ``model(x)`` asks for more than the address-space cap the job set (RLIMIT_AS, as ``ulimit -v``
would: the failing request stays far below the host's RAM). The report names the tensor by ``x`` (not
by torch's ``forward()`` local ``input``), and advises with savings sized on the measurements."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS caps malloc on Linux only")

MiB = 2**20
ROWS = 32768
JOB = textwrap.dedent(f"""
    import resource
    import torch

    def address_space() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))

    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 4096)
    x = torch.randn({ROWS}, 1024)  # 128 MiB: the largest tensor, a module global
    resource.setrlimit(resource.RLIMIT_AS, (address_space() + 256 * 2**20, resource.RLIM_INFINITY))
    y = model(x)  # a 512 MiB output: over the cap
""")


def _run(root: Any, job: str) -> tuple[dict[str, Any], str]:
    """``job`` under ``gpumemd run`` at defaults in ``root``: its one OOM report's json and markdown."""
    (root / "job.py").write_text(job)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMEMD_")}  # defaults
    proc = subprocess.run([sys.executable, "-m", "gpumemd", "run", "--output-dir", str(root / "out"), "job.py"],
                          cwd=root, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 1 and "DefaultCPUAllocator: can't allocate memory" in proc.stderr, proc.stderr[-2000:]
    (path,) = sorted((root / "out").glob("oom-*"))
    return json.loads((path / "report.json").read_text()), (path / "report.md").read_text()


@pytest.fixture(scope="module")
def report(tmp_path_factory: Any) -> tuple[dict[str, Any], str]:
    return _run(tmp_path_factory.mktemp("capacity"), JOB)


def test_the_largest_tensor_is_named_by_the_module_global(report: tuple[dict[str, Any], str]) -> None:
    doc, md = report
    top = doc["tensors"]["top"][0]
    assert top["shape"] == [ROWS, 1024] and top["holder"] == "module global `__main__.x`"
    assert "name" in top  # the key is there, as in the groups (None: no parameter name)
    [row] = [line for line in md.splitlines() if f"float32[{ROWS}, 1024]" in line and line.startswith("|")]
    assert "`__main__.x`" in row and "input" not in row
    assert doc["outcome"].startswith("fatal")


def test_a_capacity_oom_gets_advice_with_savings_in_bytes(report: tuple[dict[str, Any], str]) -> None:
    doc, md = report
    assert doc["breakdown"]["verdict"] == "capacity" and doc["breakdown"]["host_limit"] == "rlimit_as"
    by_kind = {s["kind"]: s for s in doc["suggestions"]}
    assert {"smaller_batch", "chunk_operation", "autocast_bf16"} <= set(by_kind)
    assert all(isinstance(s["saving_bytes"], int) and s["saving_bytes"] > 0 for s in doc["suggestions"])
    batch = by_kind["smaller_batch"]
    assert f"(now {ROWS:,})" in batch["title"] and "`__main__.x`" in batch["why"]
    assert doc["suggestions_none"] is None and "No suggestion" not in md


TRAINED_FIRST = JOB.replace("y = model(x)", textwrap.dedent("""\
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(30):  # steps, and a census of them, before the OOM: x is in it already
        model(torch.randn(8, 1024)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    y = model(x)"""))


def test_after_steps_the_largest_tensor_is_still_named(tmp_path: Any) -> None:
    """The census at the OOM looks up holders for the groups that grew since the census before it, and
    then for the largest: ``x`` grew by nothing since the step's census, and went unnamed ("-")."""
    doc, _ = _run(tmp_path, TRAINED_FIRST)
    assert doc["step"] is not None and doc["step"] >= 29, doc["step"]
    top = doc["tensors"]["top"][0]
    assert top["shape"] == [ROWS, 1024] and top["holder"] == "module global `__main__.x`", top
