"""What ``gpumemd top`` watching a job costs the job, and what the state file's 1 s cadence costs it.

Usage: python benchmarks/bench_top_overhead.py [--rounds 30] [--block-s 2] [--step-ms 5]

One CPU training job (an MLP with AdamW, one intra-op thread, width calibrated to ``--step-ms``) runs in
this process with ``gpumemd.attach()`` at its defaults, and ``gpumemd top`` watches its output directory
from a tmux pane, as a person would run it (without tmux: its read-and-lay-out loop in a process of its
own, at the same 1 s interval). The job runs in *rounds* of three blocks of ``--block-s`` seconds, in a
random order per round:

- ``every10s``: the state file written at most every 10 s (the cadence before ``gpumemd top``), top
  stopped (SIGSTOP: it reads nothing and takes no CPU);
- ``every1s``: the default cadence, at most every 1 s (the document built on the training thread, the
  file written on the component's writer thread), top stopped;
- ``every1s+top``: the default cadence with top running (SIGCONT).

Blocks paired within a round see the same drift of a shared machine. Printed as a markdown table, per
arm: the mean step time, its difference to ``every10s`` (per round, then the mean over rounds with its
standard error), the state-file writes per second, and the state-file component's CPU time on the
training thread as a share of the blocks' wall time (its own cost, free of the box's noise). On a 2-core
machine shared with other work, top's CPU competes with the job's (the point of measuring it there) and
the error is wide: rerun on a quiet machine before quoting a figure under ~0.5%.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable

import torch

import gpumemd
from gpumemd.components.state_writer import LastStateComponent

WATCH_LOOP = textwrap.dedent("""
    import sys, time
    from gpumemd.cli.top import frame_lines, read_frame
    from gpumemd.report.top_frame import History
    history = History()
    while True:
        frame_lines(read_frame([sys.argv[1]], history), 160, live=True)
        time.sleep(1.0)
""")
ARMS = ("every10s", "every1s", "every1s+top")


def training_step(step_ms: float) -> Callable[[], None]:
    """One step of an MLP whose width makes it take about ``step_ms`` here."""
    torch.set_num_threads(1)
    width = 256
    for _ in range(6):
        model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 10))
        opt = torch.optim.AdamW(model.parameters())
        x, y = torch.randn(64, width), torch.randint(0, 10, (64,))

        def step(model: torch.nn.Module = model, opt: torch.optim.Optimizer = opt,
                 x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()

        start = time.perf_counter()
        for _ in range(20):
            step()
        took = (time.perf_counter() - start) / 20 * 1000
        width = max(32, int(width * (step_ms / took) ** 0.5))
    print(f"MLP width {width}", file=sys.stderr)
    return step


class Watcher:
    """``gpumemd top`` on ``out``, stopped and continued by signal; in tmux when it is installed."""

    def __init__(self, out: str) -> None:
        tmux = shutil.which("tmux")
        self.tmux = [tmux, "-L", f"gpumemd-bench-{os.getpid()}"] if tmux else None
        if self.tmux:
            subprocess.run([*self.tmux, "new-session", "-d", "-x", "160", "-y", "50",
                            f"exec {sys.executable} -m gpumemd top {out}"], check=True)
            pids = subprocess.run([*self.tmux, "display", "-p", "#{pid} #{pane_pid}"], capture_output=True,
                                  text=True, check=True).stdout.split()
            self.pids = [int(p) for p in pids]  # the tmux server (it draws the pane) and top itself
            self.proc = None
        else:
            self.proc = subprocess.Popen([sys.executable, "-c", WATCH_LOOP, out])
            self.pids = [self.proc.pid]
        self.what = "gpumemd top in tmux" if self.tmux else "the read loop (no tmux)"

    def signal(self, sig: int) -> None:
        for pid in self.pids:
            os.kill(pid, sig)

    def close(self) -> None:
        self.signal(signal.SIGCONT)
        if self.tmux:
            subprocess.run([*self.tmux, "kill-server"], capture_output=True)
        if self.proc:
            self.proc.kill()
            self.proc.wait()


class Clocked:
    """The state-file component's ``on_step``, its CPU time on the training thread added up (thread CPU
    time: a preemption by another process on a busy box is not counted, as wall time would count it)."""

    def __init__(self, component: LastStateComponent) -> None:
        self.seconds = 0.0
        self._on_step = component.on_step
        component.on_step = self  # type: ignore[method-assign]

    def __call__(self, record: object) -> None:
        start = time.thread_time()
        self._on_step(record)  # type: ignore[arg-type]
        self.seconds += time.thread_time() - start


def block(step: Callable[[], None], seconds: float) -> float:
    """Mean step time (ms) over ``seconds`` of steps."""
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        step()
        n += 1
    return 1000 * (time.perf_counter() - start) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--block-s", type=float, default=2.0)
    parser.add_argument("--step-ms", type=float, default=5.0)
    args = parser.parse_args()
    step = training_step(args.step_ms)
    with tempfile.TemporaryDirectory(prefix="gpumemd-bench-top-") as out:
        agent = gpumemd.attach(output_dir=out, quiet=True)
        component = agent.component(LastStateComponent)
        assert component is not None
        block(step, 3.0)  # warm-up: attach, the first census, the first state file
        watcher = Watcher(out)
        time.sleep(1.0)  # top has read its first frame
        times: dict[str, list[float]] = {a: [] for a in ARMS}
        writes: dict[str, int] = dict.fromkeys(ARMS, 0)
        own: dict[str, float] = dict.fromkeys(ARMS, 0.0)  # the component's training-thread CPU seconds
        clocked = Clocked(component)
        try:
            for _ in range(args.rounds):
                for arm in random.sample(ARMS, len(ARMS)):
                    every_s = 10.0 if arm == "every10s" else 1.0  # the arm's cadence, counted from the last write
                    component._due += every_s - component._every_s
                    component._every_s = every_s
                    watcher.signal(signal.SIGCONT if arm.endswith("+top") else signal.SIGSTOP)
                    before, seconds = component.writes, clocked.seconds
                    times[arm].append(block(step, args.block_s))
                    own[arm] += clocked.seconds - seconds
                    component.drain()
                    writes[arm] += component.writes - before
        finally:
            watcher.close()
            gpumemd.detach()
    print(f"{args.rounds} rounds of {args.block_s:g} s blocks; watcher: {watcher.what}\n")
    print("| arm | mean step (ms) | vs every10s | ± s.e. | state file writes/s | its training-thread CPU |")
    print("|---|---|---|---|---|---|")
    base = times["every10s"]
    for arm in ARMS:
        diffs = [100 * (t - b) / b for t, b in zip(times[arm], base, strict=True)]
        err = statistics.stdev(diffs) / len(diffs) ** 0.5
        rate = writes[arm] / (args.rounds * args.block_s)
        share = 100 * own[arm] / (args.rounds * args.block_s)
        print(f"| {arm} | {statistics.mean(times[arm]):.3f} | {statistics.mean(diffs):+.2f}% | {err:.2f}% | "
              f"{rate:.2f} | {share:.3f}% |")


if __name__ == "__main__":
    main()
