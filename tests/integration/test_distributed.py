"""A real two-process CPU DDP job (gloo) under torchrun, each rank run by ``gpumemd run``.

Rank 1 plants a leak, rank 0 dies of an allocation failure; each rank's exporter serves on
``port + LOCAL_RANK``. What each rank saw is written to ``rank<N>.json`` by the worker itself.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

STEPS = 240

WORKER = textwrap.dedent(
    """
    import json, os, re, sys, urllib.request
    import torch
    import torch.distributed as dist
    import gpumemd

    out, base_port, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    agent = gpumemd.current()
    assert agent is not None, "gpumemd run did not attach"
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    leaky_cache = []  # the planted leak: 256 KiB kept per step, on rank 1 only
    for step in range(steps):
        loss = model(torch.randn(8, 64)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 1:
            leaky_cache.append(torch.ones(64 * 1024))
    dist.barrier()  # both exporters are up
    scraped = {}
    for other in range(dist.get_world_size()):
        url = f"http://127.0.0.1:{base_port + other}/metrics"
        scraped[other] = urllib.request.urlopen(url, timeout=30).read().decode()
    state = agent.state()
    seen = {
        "identity": [state.identity.rank, state.identity.local_rank, state.identity.world_size,
                     state.identity.source],
        "steps": state.steps_total,
        "url": agent.exporter_url,
        "findings": [[f.kind, f.state, f.summary, [c.holder for c in f.culprits]] for f in state.findings],
        "scraped_rank_labels": {str(k): sorted(set(re.findall(r'[{,]rank="(\\d+)"', v))) for k, v in scraped.items()},
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    dist.barrier()  # nobody stops serving before both have scraped
    if rank == 0:
        torch.empty(2**60, dtype=torch.uint8)  # a CPU allocation failure, uncaught: rank 0 dies
    dist.destroy_process_group()
    """
)


def _free_port_pair() -> int:
    """A port P with P and P+1 free now (the exporters bind P + LOCAL_RANK)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no free pair of ports")


@pytest.mark.slow
def test_two_rank_ddp_job_under_torchrun(tmp_path: Path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUMEMD_", "RANK", "LOCAL_RANK"))}
    env["OMP_NUM_THREADS"] = "1"
    for _attempt in range(3):
        port = _free_port_pair()
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--monitor-interval", "0.1",
            # torchrun runs `python -u -m gpumemd run ...` for each worker.
            "-m", "gpumemd", "run",
            "--output-dir", str(out), "--port", str(port), "--sample-interval-s", "0",
            "--oom-linger-s", "0",  # rank 0 dies with no scrape to wait for: exit at once
            "--leak-warmup-steps", "20", "--leak-min-bytes-per-step", "65536", "--leak-window-steps", "60",
            "--leak-check-every-steps", "10", "--census-every-steps", "10",
            str(worker), str(out), str(port), str(STEPS),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path)
        # Another process may take P or P+1 between our probe and the exporters' bind: only then retry.
        if "without an exporter" not in proc.stderr:
            break
        shutil.rmtree(out)
        out.mkdir()
    log = proc.stdout[-4000:] + proc.stderr[-8000:]

    assert proc.returncode != 0, log  # rank 0 failed, so the job failed
    ranks = {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}
    for r, seen in ranks.items():
        # Attached from torchrun's env, refined once init_process_group ran (after attach).
        assert seen["identity"] == [r, r, 2, "torch.distributed"], seen
        assert seen["steps"] == STEPS
        assert seen["url"] == f"http://127.0.0.1:{port + r}/metrics"
        # Both exporters answer, each with its own rank's label, on port + LOCAL_RANK.
        assert seen["scraped_rank_labels"] == {"0": ["0"], "1": ["1"]}, seen

    # The leak planted on rank 1 is found there, and only there.
    assert ranks[0]["findings"] == [], ranks[0]["findings"]
    assert ranks[1]["findings"], log
    assert any("leaky_cache" in " ".join(filter(None, holders)) for *_, holders in ranks[1]["findings"]), \
        ranks[1]["findings"]

    findings_files = sorted(p.name for p in out.glob("leak-findings-rank*.jsonl"))
    assert findings_files == ["leak-findings-rank1.jsonl"], findings_files

    # Rank 0's allocation failure left rank 0's report, and only rank 0's.
    reports = sorted(p.name for p in out.iterdir() if p.is_dir() and p.name.startswith("oom-"))
    assert len(reports) == 1 and reports[0].startswith("oom-rank0-"), (reports, log)
    assert "can't allocate memory" in proc.stderr  # the traceback still reached the user


@pytest.mark.slow
def test_torchrun_no_python_runs_the_gpumemd_command(tmp_path: Path) -> None:
    """`torchrun --no-python gpumemd run train.py`: torchrun execs the console script as given."""
    gpumemd_cmd = Path(sys.executable).parent / "gpumemd"  # installed with the package (pip install -e .)
    assert gpumemd_cmd.exists(), f"{gpumemd_cmd} missing: install the package so its console script exists"
    worker = tmp_path / "train.py"
    worker.write_text(textwrap.dedent(
        """
        import json, os, sys
        import gpumemd
        agent = gpumemd.current()
        ident = agent.state().identity
        with open(sys.argv[1], "w") as f:
            json.dump({"argv": sys.argv[2:], "rank": [ident.rank, ident.world_size, ident.source],
                       "keep_steps": agent.config.keep_steps}, f)
        """
    ))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUMEMD_", "RANK", "LOCAL_RANK"))}
    seen_path = tmp_path / "seen.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
         "--monitor-interval", "0.1", "--no-python", str(gpumemd_cmd), "run", "--keep-steps", "9",
         "--sample-interval-s", "0", "--output-dir", str(tmp_path / "out"),
         str(worker), str(seen_path), "--lr", "3e-4"],
        capture_output=True, text=True, env=env, timeout=180, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = json.loads(seen_path.read_text())
    assert seen == {"argv": ["--lr", "3e-4"], "rank": [0, 1, "torchrun"], "keep_steps": 9}
