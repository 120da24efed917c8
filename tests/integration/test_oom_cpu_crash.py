"""A real CPU training loop dies of a real CPU allocation failure (uncaught) and leaves a full report,
which ``gpumemd report`` then reads, alone and next to another rank's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from gpumemd.cli import main

SCRIPT = textwrap.dedent("""
    import sys, torch, gpumemd
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gpumemd.attach(model=model, optimizer=opt, output_dir=sys.argv[1], sample_interval_s=0, nvml=False)
    def train_step(step):
        hidden = model(torch.randn(32, 64))
        if step == 6:  # a shape bug: 2**60 bytes can never be allocated (malloc fails, no RAM is used)
            scratch = torch.empty(2**60, dtype=torch.uint8)
        hidden.pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for step in range(10):
        train_step(step)
""")


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: Any) -> tuple[subprocess.CompletedProcess[str], str]:
    root = tmp_path_factory.mktemp("crash")
    script = root / "train.py"
    script.write_text(SCRIPT)
    out = root / "rank1"
    env = {**os.environ, "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}
    proc = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, env=env,
                          timeout=120, check=False)
    return proc, str(out)


def _report_dir(out: str) -> str:
    dirs = [d for d in os.listdir(out) if d.startswith("oom-")]
    assert len(dirs) == 1, os.listdir(out)
    return os.path.join(out, dirs[0])


def test_the_job_still_dies_with_its_own_traceback(crashed: Any) -> None:
    proc, _ = crashed
    assert proc.returncode == 1
    assert "DefaultCPUAllocator: can't allocate memory" in proc.stderr
    assert 'line 10, in train_step' in proc.stderr  # the previous excepthook printed the real traceback


def test_a_full_report_is_left_behind(crashed: Any) -> None:
    _, out = crashed
    path = _report_dir(out)
    assert os.path.basename(path).startswith("oom-rank1-step000006-")
    assert sorted(os.listdir(path)) == ["report.html", "report.json", "report.md"]
    with open(os.path.join(path, "report.json"), encoding="utf-8") as f:
        report = json.load(f)
    assert report["source"] == "excepthook" and report["rank"] == 1 and report["world_size"] == 2
    assert report["oom"] == {**report["oom"], "kind": "cpu", "requested_bytes": 2**60}
    assert report["breakdown"]["device"] == "cpu"
    assert report["breakdown"]["verdict"] == "request_exceeds_device"
    assert report["suggestions"][0]["kind"] == "check_request_size"
    timeline = report["timeline"]
    # the steps that led there: sampled (every step until the agent knows its cost), none missing, and
    # last the memory read at the OOM, in the failing step
    assert [r["step"] for r in timeline][:3] == [0, 1, 2] and timeline[-2]["step"] <= 5
    assert timeline[-1]["step"] == 6 and timeline[-1]["at_oom"] is True
    assert sum(r["steps"] for r in timeline) == timeline[-1]["step"] + 1
    tensors = report["tensors"]
    assert tensors["available"]
    by_cat = tensors["bytes_by_category"]
    params = 64 * 256 * 4 + 256 * 4 + 256 * 8 * 4 + 8 * 4
    assert by_cat["parameter"] == params
    assert by_cat["optimizer_state"] >= 2 * params  # AdamW's two moments (plus step counters)
    # The census ran at the crash, while the failing frame still held its activations.
    assert by_cat["graph"] + by_cat["other"] >= 32 * 256 * 4
    assert report["environment"]["rank"] == 1
    assert "train_step" in report["exception"]["traceback"]


def test_gpumemd_report_reads_it(crashed: Any, capsys: Any) -> None:
    _, out = crashed
    assert main(["report", _report_dir(out)]) == 0
    text = capsys.readouterr().out
    assert "RuntimeError on cpu (rank 1, step 6" in text and "request_exceeds_device" in text
    assert "Check the size of the failing allocation" in text
    assert main(["report", "--json", out]) == 0
    assert json.loads(capsys.readouterr().out)["oom"]["kind"] == "cpu"
