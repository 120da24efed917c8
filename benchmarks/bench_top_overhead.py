"""What ``gpumemd top`` watching a job costs the job, and what the state file's 1 s cadence costs it.

Usage: python benchmarks/bench_top_overhead.py [--rounds 6] [--seconds 10] [--step-ms 5]

Three arms, each a fresh CPU training process (an MLP with AdamW, one intra-op thread, ``gpumemd.attach()``
at its defaults), run in rounds in a random order so that the drift of a shared machine falls on all arms:

- ``every10s``: the state file written at most every 10 s (the cadence before ``gpumemd top``);
- ``every1s``: the default, at most every 1 s (its document built on the training thread, the file
  written on the component's writer thread);
- ``every1s+top``: the default with ``gpumemd top`` watching the job's output directory: the live view
  in a tmux pane when tmux is installed (as a person would run it), else its read-and-lay-out loop in a
  process of its own at the same interval.

Each process warms up for 3 s (attach, first census), then counts steps for ``--seconds``; the mean step
time per arm, and each arm's difference to ``every10s`` per round with its standard error, are printed
as a markdown table. On a 2-core machine shared with other work the differences are noise-bound: rerun
on a quiet one before quoting a figure below ~0.5%.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

JOB = textwrap.dedent("""
    import json, sys, time, torch, gpumemd
    from gpumemd.components import last_state
    every_s, seconds, width = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    last_state.LastStateComponent.__init__.__defaults__ = (every_s, time.monotonic)  # the arm's cadence
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 10))
    opt = torch.optim.AdamW(model.parameters())
    x, y = torch.randn(64, width), torch.randint(0, 10, (64,))
    agent = gpumemd.attach()
    def step():
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    end = time.perf_counter() + 3.0
    while time.perf_counter() < end:
        step()
    print("ready", flush=True)
    sys.stdin.readline()  # the watcher, if any, is up
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        step()
        n += 1
    elapsed = time.perf_counter() - start
    print(json.dumps({"step_ms": 1000 * elapsed / n, "steps": n}), flush=True)
    gpumemd.detach()
""")

WATCH_LOOP = textwrap.dedent("""
    import sys, time
    from gpumemd.cli.top import frame_lines, read_frame
    from gpumemd.report.top import History
    history = History()
    while True:
        frame_lines(read_frame([sys.argv[1]], history), 160, live=True)
        time.sleep(1.0)
""")


def width_for(step_ms: float) -> int:
    """An MLP width whose step takes about ``step_ms`` here (a quick calibration in this process)."""
    import torch

    torch.set_num_threads(1)
    width = 256
    for _ in range(6):
        model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 10))
        opt = torch.optim.AdamW(model.parameters())
        x, y = torch.randn(64, width), torch.randint(0, 10, (64,))
        start = time.perf_counter()
        for _ in range(20):
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        took = (time.perf_counter() - start) / 20 * 1000
        width = max(32, int(width * (step_ms / took) ** 0.5))
    return width


def watcher(out: str) -> tuple[subprocess.Popen[bytes] | None, list[str] | None]:
    tmux = shutil.which("tmux")
    if tmux:
        cmd = [tmux, "-L", f"gpumemd-bench-{os.getpid()}"]
        subprocess.run([*cmd, "new-session", "-d", "-x", "160", "-y", "50",
                        f"{sys.executable} -m gpumemd top {out}"], check=True)
        return None, cmd
    return subprocess.Popen([sys.executable, "-c", WATCH_LOOP, out]), None


def run_arm(arm: str, seconds: float, width: int) -> float:
    with tempfile.TemporaryDirectory(prefix="gpumemd-bench-top-") as out:
        every_s = "10" if arm == "every10s" else "1"
        job = subprocess.Popen([sys.executable, "-c", JOB, every_s, str(seconds), str(width)],
                               env={**os.environ, "GPUMEMD_OUTPUT_DIR": out}, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert job.stdout is not None and job.stdin is not None
        assert job.stdout.readline().strip() == "ready"
        proc, tmux = watcher(out) if arm.endswith("+top") else (None, None)
        if proc or tmux:
            time.sleep(1.0)  # top has read its first frame
        job.stdin.write("\n")
        job.stdin.flush()
        result = json.loads(job.stdout.readline())
        job.wait()
        if proc:
            proc.kill()
            proc.wait()
        if tmux:
            subprocess.run([*tmux, "kill-server"], capture_output=True)
        return float(result["step_ms"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--step-ms", type=float, default=5.0)
    args = parser.parse_args()
    width = width_for(args.step_ms)
    arms = ["every10s", "every1s", "every1s+top"]
    times: dict[str, list[float]] = {a: [] for a in arms}
    for r in range(args.rounds):
        order = random.sample(arms, len(arms))
        for arm in order:
            times[arm].append(run_arm(arm, args.seconds, width))
        print(f"round {r + 1}: " + ", ".join(f"{a} {times[a][-1]:.3f} ms" for a in arms), file=sys.stderr)
    base = times["every10s"]
    print(f"MLP width {width}, {args.rounds} rounds of {args.seconds:g} s per arm; watcher: "
          f"{'gpumemd top in tmux' if shutil.which('tmux') else 'the read loop (no tmux)'}\n")
    print("| arm | mean step (ms) | vs every10s per round | ± s.e. |")
    print("|---|---|---|---|")
    for arm in arms:
        diffs = [100 * (t - b) / b for t, b in zip(times[arm], base, strict=True)]
        err = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
        print(f"| {arm} | {statistics.mean(times[arm]):.3f} | {statistics.mean(diffs):+.2f}% | {err:.2f}% |")


if __name__ == "__main__":
    main()
