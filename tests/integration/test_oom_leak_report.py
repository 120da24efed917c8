"""Acceptance: a job that leaks, then dies of out-of-memory, at default settings (only
``output_dir`` set). The first screen of report.md and report.html names the holder and the leak,
and no tensor group appears as more than one row; ``gpumemd report`` says the same, and report.html
renders in a real browser without asking the network for anything.

"First screen", concretely: the first 40 lines of report.md; in report.html everything before the
first chart (the first ``<svg``); the first 20 lines of ``gpumemd report``.

The OOM is real: the job runs under an address-space cap (``ulimit -v``, as a cgroup-capped job
would), and after ~800 steps of keeping 2 MiB/step in a list ``kept`` its next 512 MiB batch no
longer fits, so malloc fails inside PyTorch's CPU allocator. The leak detector has found the leak
by then at its defaults (it needs ~450-550 steps after the onset at this rate).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from browser import page_requests, png_size, require_chromium, run_chromium

from gpumemd.cli import main

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS caps malloc on Linux only"),
]

STEPS = 800
SCRIPT = textwrap.dedent(f"""
    import resource, sys, torch, gpumemd
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gpumemd.attach(output_dir=sys.argv[1])

    def address_space() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))

    kept = []
    for step in range({STEPS}):
        model(torch.randn(32, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= 30:
            kept.append(torch.ones(512, 1024))  # the leak: 2 MiB/step, never released
    # The cap the job runs under leaves 256 MiB; the next batch needs 512 MiB.
    resource.setrlimit(resource.RLIMIT_AS, (address_space() + 256 * 2**20, resource.RLIM_INFINITY))
    batch = torch.empty(512 * 2**20, dtype=torch.uint8)
""")
FIRST_SCREEN_LINES = 40
LEAK_SENTENCE = re.compile(r"`kept` grew ~\d+\.\d\d MiB/step since step \d+ and held \d+\.\d\d GiB of the host's")


@pytest.fixture(scope="module")
def job(tmp_path_factory: Any) -> tuple[subprocess.CompletedProcess[str], Path]:
    root = tmp_path_factory.mktemp("leak")
    script = root / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMEMD_")}  # defaults, nothing else
    proc = subprocess.run([sys.executable, str(script), str(root / "out")], capture_output=True, text=True,
                          env=env, timeout=420, check=False)
    dirs = sorted((root / "out").glob("oom-*"))
    assert len(dirs) == 1, proc.stderr[-3000:]
    return proc, dirs[0]


def _read(job: Any, name: str) -> str:
    return (job[1] / name).read_text(encoding="utf-8")


def _group_rows(md: str) -> list[str]:
    lines = md.split("## Largest tensor groups", 1)[1].split("\n## ", 1)[0].splitlines()
    return [line for line in lines if line.startswith("| ") and not line.startswith("| bytes")]


def test_the_job_died_of_a_real_allocation_failure(job: Any) -> None:
    proc, path = job
    assert proc.returncode == 1
    assert "DefaultCPUAllocator: can't allocate memory: you tried to allocate 536870912 bytes" in proc.stderr
    assert path.name.startswith(f"oom-rank0-step{STEPS:06d}-")


def test_the_verdict_blames_the_leak_and_its_fix_comes_first(job: Any) -> None:
    report = json.loads(_read(job, "report.json"))
    b = report["breakdown"]
    assert b["verdict"] == "leak" and LEAK_SENTENCE.match(b["verdict_why"])
    assert b["leak"]["holder"] == "`kept`" and b["leak"]["held_bytes"] >= 700 * 2 * 2**20
    kinds = [s["kind"] for s in report["suggestions"]]
    assert kinds[0] == "fix_leak" and "`kept`" in report["suggestions"][0]["title"]
    # the leak is no activation: nothing is sized on it
    assert "activation_checkpointing" not in kinds and "smaller_micro_batch" not in kinds


def test_the_first_screen_of_report_md_names_the_holder_and_the_leak(job: Any) -> None:
    md = _read(job, "report.md")
    first = "\n".join(md.splitlines()[:FIRST_SCREEN_LINES])
    assert "**leak** — " in first and LEAK_SENTENCE.search(first)
    [leaking] = [row for row in _group_rows(md) if "← the leak" in row]
    assert leaking in first and "× float32[512, 1024] | other |" in leaking and "kept" in leaking
    assert "1. **Stop `kept` from growing" in first


def test_no_group_appears_as_more_than_one_row(job: Any, capsys: Any) -> None:
    md = _read(job, "report.md")
    rows = _group_rows(md)
    keys = [tuple(cell.strip() for cell in row.split(" | ")[1:]) for row in rows]  # everything but the bytes
    assert rows and len(set(keys)) == len(keys)
    assert sum("float32[512, 1024]" in line for line in md.splitlines() if line.startswith("|")) == 1
    html = _read(job, "report.html")
    assert html.count("× float32[512, 1024]</td>") == 1
    assert main(["report", str(job[1])]) == 0
    cli = capsys.readouterr().out
    block = cli.split("largest tensor groups (", 1)[1].split("\nsuggestions", 1)[0].splitlines()[1:]
    assert len(block) == len(set(block)) and sum("× float32[512, 1024]" in line for line in block) == 1


def test_the_first_screen_of_report_html_names_the_holder_and_the_leak(job: Any) -> None:
    html = _read(job, "report.html")
    first = html[:html.index("<svg")]
    text = re.sub(r"<[^>]+>", "", first).replace("&#x27;", "'")
    assert re.search(r"kept grew ~\d+\.\d\d MiB/step since step \d+ and held", text)
    assert 'class="leak"' in first and "← the leak" in first
    assert first.index(">Largest tensor groups<") < first.index(">Suggestions<")


def test_gpumemd_report_tells_the_same_story_first(job: Any, capsys: Any) -> None:
    assert main(["report", str(job[1])]) == 0
    first = capsys.readouterr().out.splitlines()[:20]
    assert first[3].startswith("verdict: leak: `kept` grew ~")
    assert any("× float32[512, 1024]" in line and "← the leak" in line for line in first)
    assert any(line.startswith("  1. Stop `kept` from growing") for line in first)


def test_report_html_renders_in_chromium_and_asks_the_network_for_nothing(job: Any, tmp_path: Path) -> None:
    chromium = require_chromium()
    page = (job[1] / "report.html").as_uri()
    shot, net = tmp_path / "report.png", tmp_path / "net.json"
    run_chromium(chromium, page, tmp_path, f"--screenshot={shot}", "--window-size=1280,2000",
                 f"--log-net-log={net}")
    assert png_size(shot) == (1280, 2000) and shot.stat().st_size > 30_000  # a page, not a blank
    assert page_requests(net) == []
    dom = run_chromium(chromium, page, tmp_path, "--dump-dom")
    assert "Largest tensor groups" in dom
    loads = re.findall(r"<(?:script|img|link|iframe|object|embed|source|image|use)\b[^>]*>", dom)
    assert not [tag for tag in loads if re.search(r"(?:src|href)=\"?https?://", tag)]
    # The net-log check sees a page's request when there is one (the control).
    control = tmp_path / "control.html"
    control.write_text('<html><body><img src="https://example.invalid/x.png"></body></html>', encoding="utf-8")
    control_net = tmp_path / "control-net.json"
    run_chromium(chromium, control.as_uri(), tmp_path, "--dump-dom", f"--log-net-log={control_net}")
    assert page_requests(control_net) == ["https://example.invalid/x.png"]
