"""The default output directory cannot shadow the package."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import torch
import gpumemd

gpumemd.attach()
m = torch.nn.Linear(2, 2)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for _ in range(3):
    m(torch.randn(1, 2)).sum().backward()
    opt.step()
print(gpumemd.current().output_dir)
"""


def test_a_script_runs_twice_from_the_directory_it_wrote_into(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "train.py"
    script.write_text(SCRIPT, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMEMD_")}
    for run in range(2):
        done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, f"run {run + 1}: {done.stderr[-2000:]}"
        out_dir = done.stdout.strip().splitlines()[-1]
        assert os.path.basename(out_dir) == "gpumemd-out"
        os.makedirs(out_dir, exist_ok=True)  # as a run that wrote findings or a report leaves it
