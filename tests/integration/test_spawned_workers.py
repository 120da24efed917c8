"""``attach()`` at the top of a script whose DataLoader workers use the spawn start method: every worker
re-imports the script, and only the training process may attach (one start line, one summary)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

JOB = textwrap.dedent('''
    import torch
    import gpumemd

    gpumemd.attach(output_dir={out!r})


    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return torch.full((2,), float(i))


    def worker_init(_):
        print("worker attached:", gpumemd.current() is not None, flush=True)


    if __name__ == "__main__":
        loader = torch.utils.data.DataLoader(Data(), batch_size=2, num_workers=1, multiprocessing_context="spawn",
                                             worker_init_fn=worker_init)
        print("total", sum(float(b.sum()) for b in loader), flush=True)
''')


def test_spawned_dataloader_workers_stay_silent(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(JOB.format(out=str(tmp_path / "out")))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "total 12.0" in proc.stdout
    # the worker re-imported the script: its attach() did not start an agent there
    assert "worker attached: False" in proc.stdout, proc.stdout
    lines = proc.stderr.splitlines()
    assert len([line for line in lines if line.startswith("gpumemd: watching pid")]) == 1, proc.stderr
    assert len([line for line in lines if " steps watched in " in line]) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
