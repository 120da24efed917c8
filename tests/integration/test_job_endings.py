"""Real jobs ended the ways schedulers end them: SIGTERM (scancel, a time limit, pod deletion) under
``attach()`` and under ``gpumemd run``, a job with its own SIGTERM handler, and SIGKILL (the OOM
killer). Each is a real child process at default settings, leaking a tensor a step, signalled once its
leak finding exists; the three run side by side. (SIGTERM at the default action under ``attach()`` is
the same wrapper; a real such job is ``tests/e2e/test_vanished_e2e.py``'s ``terminated``, checked there
for the same files beside its last scrape.)

- SIGTERM: the exit summary, the textfile (with the exit marker), the findings and a final state file
  are written, and the job dies of SIGTERM (-15) as it would without gpumemd;
- a handler of the job's (installed after attach, ending with ``os._exit(7)``: no atexit, no summary)
  still decides the ending, exit status 7, and the agent wrote what it knew before calling it;
- SIGKILL: nothing can run, but the state file kept as the job ran tells ``gpumemd report`` what the
  job knew, and that it vanished;
- SIGTERM to the process group of a job with persistent DataLoader workers: the workers die of it
  while the agent writes, and the job still dies of SIGTERM, without a traceback of the DataLoader's
  "worker killed by signal" error (torch raises it into the main thread when a worker dies).
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

JOB = textwrap.dedent("""
    import os, signal, sys, torch, gpumemd
    agent = gpumemd.current() or gpumemd.attach()  # under `gpumemd run`, the agent is there already
    if sys.argv[1] == "own-handler":  # the job's own, installed after attach; it ends the process at once
        signal.signal(signal.SIGTERM, lambda signum, frame: (print("handled", file=sys.stderr, flush=True),
                                                             os._exit(7)))
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept, said = [], False
    batches, step = iter(()), 0
    if sys.argv[1] == "loader":  # persistent DataLoader workers, in the job's process group
        from torch.utils.data import DataLoader, TensorDataset
        loader = DataLoader(TensorDataset(torch.randn(10**5, 16)), batch_size=4, num_workers=2,
                            persistent_workers=True)
        batches = iter(loader)
    while True:
        step += 1
        x = next(batches)[0] if step % 50 == 0 and sys.argv[1] == "loader" else torch.randn(4, 16)
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        kept.append(torch.zeros(16 * 1024))  # the leak: 64 KiB a step, never freed
        if not said and agent.findings():
            print("found", flush=True)
            said = True
""")

CASES = {  # name: (how it is run, its argument, the signal)
    "run_sigterm": ("run", "plain", signal.SIGTERM),
    "own_handler": ("attach", "own-handler", signal.SIGTERM),
    "run_sigkill": ("run", "plain", signal.SIGKILL),
    "loader_group": ("attach", "loader", signal.SIGTERM),  # to the process group, workers too
}


@dataclass
class Ended:
    out: Path
    returncode: int
    stderr: str

    @property
    def textfile(self) -> str:
        path = self.out / "metrics.prom"
        return path.read_text() if path.exists() else ""

    def state(self) -> dict[str, object]:
        return dict(json.loads((self.out / "gpumemd-state-rank0.json").read_text()))


@pytest.fixture(scope="module")
def ended(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Ended]]:
    root = tmp_path_factory.mktemp("endings")
    script = root / "job.py"
    script.write_text(JOB)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMEMD_")}
    procs = {}
    for name, (how, arg, _sig) in CASES.items():
        out = root / name
        command = [sys.executable, str(script), arg] if how == "attach" else \
            [sys.executable, "-m", "gpumemd", "run", str(script), arg]
        procs[name] = subprocess.Popen(command, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       env={**env, "GPUMEMD_OUTPUT_DIR": str(out),
                                            "GPUMEMD_TEXTFILE": str(out / "metrics.prom")},
                                       start_new_session=name == "loader_group")
    results = {}
    try:
        deadline = time.monotonic() + 240  # four jobs side by side on a loaded 2-core box
        for name, proc in procs.items():
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = proc.stdout.readline() if ready else ""
            assert line.strip() == "found", f"{name}: no finding ({line!r}, rc {proc.poll()})"
            if name == "loader_group":
                os.killpg(proc.pid, CASES[name][2])  # as `timeout`, Slurm or a terminal's Ctrl-C do
            else:
                proc.send_signal(CASES[name][2])
        for name, proc in procs.items():
            _, err = proc.communicate(timeout=60)
            results[name] = Ended(root / name, proc.returncode, err)
        yield results
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_sigterm_writes_what_the_agent_knew_and_the_job_still_dies_of_it(ended: dict[str, Ended]) -> None:
    job = ended["run_sigterm"]
    assert job.returncode == -signal.SIGTERM, job.stderr  # as `python job.py` would: killed by SIGTERM
    assert "gpumemd: ended by SIGTERM · " in job.stderr and "leak finding" in job.stderr  # the exit summary
    # the exit marker of this run: its reason, and the run it ends (run_id, as on gpumemd_info)
    assert re.search(r'gpumemd_agent_exit_timestamp_seconds\{local_rank="0",rank="0",reason="SIGTERM",'
                     r'run_id="\d+-\d+"\}', job.textfile), job.textfile
    assert "gpumemd_leak_state{" in job.textfile
    assert (job.out / "leak-findings-rank0.jsonl").read_text().count("\n") >= 1
    assert job.state()["ended"] == "SIGTERM"


def test_a_handler_of_the_jobs_own_keeps_its_ending(ended: dict[str, Ended]) -> None:
    job = ended["own_handler"]
    assert job.returncode == 7 and job.stderr.endswith("handled\n"), job.stderr
    # written before the job's handler ran: the textfile and the state file, without an ending (the
    # job's handler decides it; os._exit gives the agent no say)
    assert "gpumemd_leak_state{" in job.textfile and "gpumemd_agent_exit_timestamp_seconds" not in job.textfile
    assert job.state()["ended"] is None and job.state()["findings"]
    assert (job.out / "leak-findings-rank0.jsonl").exists()


def test_a_sigkilled_job_leaves_a_state_file_that_report_reads(ended: dict[str, Ended]) -> None:
    job = ended["run_sigkill"]
    assert job.returncode == -signal.SIGKILL
    assert "watched in" not in job.stderr and not job.textfile  # nothing could run
    report = subprocess.run([sys.executable, "-m", "gpumemd", "report", str(job.out)], capture_output=True,
                            text=True, timeout=60, check=False)
    assert report.returncode == 0, report.stderr
    assert "VANISHED: no clean exit recorded" in report.stdout
    assert "at risk when last seen: " in report.stdout and "finding: " in report.stdout
    assert "tensor leak" in report.stdout and "out of memory in" in report.stdout


def test_sigterm_to_a_job_and_its_workers_ends_it_as_without_gpumemd(ended: dict[str, Ended]) -> None:
    job = ended["loader_group"]
    assert job.returncode == -signal.SIGTERM, job.stderr
    assert "Traceback" not in job.stderr, job.stderr
    assert "gpumemd: ended by SIGTERM · " in job.stderr
    assert job.state()["ended"] == "SIGTERM"
