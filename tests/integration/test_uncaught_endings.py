"""Each way a job ends on its own is recorded as it was, and ``gpumemd report`` says it in words:
Ctrl-C (SIGINT, an uncaught KeyboardInterrupt), an uncaught out-of-memory error, another uncaught
exception (with its type), ``sys.exit(3)``. Real child processes at default settings, side by side,
under ``attach()`` and under ``gpumemd run``; each job's own ending (exit status, traceback) is what
plain python gives."""

from __future__ import annotations

import json
import os
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
    import signal, sys, torch, gpumemd
    # Ctrl-C raises KeyboardInterrupt, as in a terminal (a background job of a non-interactive shell,
    # as CI may run the tests, starts with SIGINT ignored, and python leaves it so)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    gpumemd.current() or gpumemd.attach()  # under `gpumemd run`, the agent is there already
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, 1000):
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
        if step == 20:
            how = sys.argv[1]
            if how == "sigint":
                # as Ctrl-C in a terminal; to this thread (os.kill may hand it to the sampler's, late)
                signal.raise_signal(signal.SIGINT)
            if how == "oom":
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB. GPU 0 has a total "
                                             "capacity of 79.10 GiB of which 1.00 GiB is free.")
            if how == "exception":
                raise ValueError("the job's own bug")
            if how == "exit":
                sys.exit(3)
""")

INTERRUPTED = "interrupted (SIGINT: Ctrl-C, or an uncaught KeyboardInterrupt)"
CASES = {  # name: (how it is run, its argument, the exit status plain python gives, what the report says)
    "sigint_attach": ("attach", "sigint", -signal.SIGINT, INTERRUPTED),
    "sigint_run": ("run", "sigint", -signal.SIGINT, INTERRUPTED),
    "oom_attach": ("attach", "oom", 1, "ended by an uncaught out-of-memory error"),
    "exception_attach": ("attach", "exception", 1, "ended by an uncaught ValueError"),
    "exception_run": ("run", "exception", 1, "ended by an uncaught ValueError"),
    "exit_run": ("run", "exit", 3, "exited with status 3"),
    # python tells an atexit handler nothing of sys.exit(3): the report must not say "normally"
    "exit_attach": ("attach", "exit", 3, "exited (no uncaught exception; its status is known under gpumemd run)"),
}


@dataclass
class Ended:
    out: Path
    returncode: int
    stderr: str


@pytest.fixture(scope="module")
def ended(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Ended]]:
    root = tmp_path_factory.mktemp("uncaught")
    script = root / "job.py"
    script.write_text(JOB)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMEMD_")}
    procs = {}
    for name, (how, arg, _code, _words) in CASES.items():
        command = [sys.executable, str(script), arg] if how == "attach" else \
            [sys.executable, "-m", "gpumemd", "run", str(script), arg]
        procs[name] = subprocess.Popen(command, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       env={**env, "GPUMEMD_OUTPUT_DIR": str(root / name)})
    try:
        results = {}
        deadline = time.monotonic() + 600  # six jobs side by side on a loaded 2-core box
        for name, proc in procs.items():
            _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results[name] = Ended(root / name, proc.returncode, err)
        yield results
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("name", list(CASES))
def test_the_ending_is_recorded_and_reported_as_it_was(name: str, ended: dict[str, Ended]) -> None:
    job = ended[name]
    _how, arg, code, words = CASES[name]
    assert job.returncode == code, job.stderr
    state = json.loads((job.out / "gpumemd-state-rank0.json").read_text())
    report = subprocess.run([sys.executable, "-m", "gpumemd", "report", str(job.out)], capture_output=True,
                            text=True, timeout=60)
    assert report.returncode == 0, report.stderr
    assert f"  {words} at " in report.stdout, report.stdout
    assert "VANISHED" not in report.stdout
    if arg in ("oom", "exception"):  # the job's own traceback, as python prints it
        assert job.stderr.count("Traceback (most recent call last)") == 1, job.stderr
    if arg != "oom":
        exit_ended = "exit:3" if name == "exit_run" else "exit"
        assert state["ended"] == {"sigint": "SIGINT", "exception": "exception:ValueError", "exit": exit_ended}[arg]
    else:  # the exit summary says it too
        assert state["ended"] == "oom" and "gpumemd: ended by an uncaught out-of-memory error · " in job.stderr
